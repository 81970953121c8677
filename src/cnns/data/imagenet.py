"""ImageNet loading shared by both layouts (TFRecord shards, JPEG folder tree): decoding,
the seed's preprocessing, sharded sampling and the DataLoader.

Batches are (uint8 [N, H, W, 3], int64 [N]): 8-bit I/O is the default transfer, and the device
normalises (cnns.data.augment.normalise), as the seed's --eight-bit-io does.

Decoding uses torchvision.io (libjpeg-turbo) on the whole file, then torchvision transforms v2 on
the uint8 tensor. PIL with JPEG draft mode (DCT-domain downscaling) was measured against it, one
core, synthetic photo-like JPEGs (q90), ms per image for the training / evaluation transform at
224 px: 500x375 (typical ImageNet) torchvision 0.95 / 0.96, PIL draft 1.28 / 1.81; 800x600
2.15 / 2.33 vs 2.48 / 2.47; 1600x1200 7.96 / 8.35 vs 6.92 / 6.80. Draft mode only pays off for
large photos, which are rare in ImageNet, so torchvision is used.

Randomness: each training sample is augmented under torch's CPU RNG seeded from (seed, epoch,
sample index), so the augmentation of an epoch is the same whatever the worker count or the
rank, and a run resumed mid-epoch repeats it exactly; the shuffle is a function of (seed, epoch).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

from cnns.data.batches import ShardPlan, mix_seed
from cnns.data.imagefolder import ImageFolderDataset, decode_rgb, find_split_folder, list_classes
from cnns.data.tfrecord import IMAGENET_CLASSES, TFRecordDataset, find_shards
from cnns.errors import CnnsError, ConfigError, DataError

# The seed's training crop (sample_distorted_bounding_box without boxes): area and aspect ranges.
CROP_AREA = (0.05, 1.0)
CROP_ASPECT = (3 / 4, 4 / 3)


# ----------------------------------------------------------------------------------------------
# Preprocessing
# ----------------------------------------------------------------------------------------------


def evaluation_resize(image_size: int) -> int:
    """The short side before the centre crop: 256 for 224, scaled with the image size (seed's rule)."""
    return int(image_size * 256 / 224)


class ChannelsLastRandomResizedCrop(v2.RandomResizedCrop):
    """v2.RandomResizedCrop (same crop sampling, same pixels) that resizes in channels-last memory.

    A decoded JPEG is HWC in memory and torchvision's uint8 antialiased resize works channels-last;
    the stock transform hands it a cropped view, which torchvision first copies to CHW, and the
    kernel converts back and forth. Making the crop channels-last contiguous instead keeps the
    output HWC in memory too, so the final HWC tensor needs no copy: ~0.13 ms less per 224 px
    training image (of ~0.9 ms, decoding included), measured on one core."""

    def transform(self, inpt: torch.Tensor, params: dict) -> torch.Tensor:
        top, left, height, width = (params[key] for key in ("top", "left", "height", "width"))
        crop = inpt[..., top:top + height, left:left + width]
        crop = crop.unsqueeze(0).contiguous(memory_format=torch.channels_last)
        return F.resize(crop, self.size, interpolation=self.interpolation, antialias=self.antialias)[0]


def training_transform(image_size: int) -> v2.Compose:
    """Random resized crop (area 5-100 %, aspect 3/4-4/3) and a horizontal flip, uint8 [3, H, W] in
    and [3, image_size, image_size] out. Draws from torch's global RNG."""
    return v2.Compose([
        ChannelsLastRandomResizedCrop(image_size, scale=CROP_AREA, ratio=CROP_ASPECT, antialias=True),
        v2.RandomHorizontalFlip(),
    ])


def evaluation_transform(image_size: int) -> v2.Compose:
    """Resize the short side to image_size * 256/224, then crop the centre image_size square."""
    return v2.Compose([
        v2.Resize(evaluation_resize(image_size), antialias=True),
        v2.CenterCrop(image_size),
    ])


class ImageNetTransform:
    """Encoded image bytes -> uint8 [image_size, image_size, 3] (HWC, so batches collate to NHWC).

    Called by the datasets as transform(data, source), source naming the file for errors. A plain
    picklable class, so spawned DataLoader workers can receive it."""

    def __init__(self, train: bool, image_size: int, skip_corrupt: bool = False) -> None:
        self.train = train
        self.image_size = image_size
        self.augment = training_transform(image_size) if train else evaluation_transform(image_size)
        self.skip_corrupt = skip_corrupt  # --skip-corrupt-images: an undecodable image becomes None

    def __call__(self, data: bytes, source: str) -> torch.Tensor | str:
        try:
            decoded = decode_rgb(data, source)
        except DataError:
            if self.skip_corrupt:
                return source  # in place of the image: dropped and named by collate_skipping_corrupt
            raise
        image = self.augment(decoded)
        return image.permute(1, 2, 0).contiguous()  # a no-op when the image is HWC in memory


SKIPPED_NAMES_KEPT = 3  # named in the run's last lines; the rest are counted


def collate_skipping_corrupt(samples: list) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """--skip-corrupt-images: the batch without the images that could not be decoded (the transform
    gave their names instead), and those names (they travel with the batch, so worker processes can
    report them)."""
    kept = [(image, label) for image, label in samples if not isinstance(image, str)]
    skipped = [image for image, _ in samples if isinstance(image, str)]
    if not kept:
        return torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.int64), skipped
    images, labels = torch.utils.data.default_collate(kept)
    return images, labels, skipped


# ----------------------------------------------------------------------------------------------
# Layout detection and datasets
# ----------------------------------------------------------------------------------------------


def detect_imagenet(folder: str | os.PathLike) -> str | None:
    """"tfrecord" if `folder` (or its imagenet-data/) holds train- or validation- shards, "folder" if
    it has train/, validation/ or val/ with class sub-folders, else None."""
    folder = Path(folder)
    if not folder.is_dir():
        return None
    for split in ("train", "validation"):
        try:
            find_shards(folder, split)
            return "tfrecord"
        except DataError:
            pass
    for split in ("train", "validation"):
        split_folder = find_split_folder(folder, split)
        if split_folder is not None and list_classes(split_folder):
            return "folder"
    return None


def folder_tree_classes(folder: str | os.PathLike) -> tuple[list[str], list[str] | None] | None:
    """(training classes, validation classes or None) of an ImageNet-style folder tree, from its folder
    names alone; None when `folder` holds no folder tree (TFRecords, CIFAR, nothing)."""
    if detect_imagenet(folder) != "folder":
        return None
    train, validation = (find_split_folder(folder, split) for split in ("train", "validation"))
    validation_classes = list_classes(validation) if validation is not None else None
    return (list_classes(train) if train is not None else validation_classes or []), validation_classes


def check_same_classes(folder: str | os.PathLike) -> None:
    """DataError naming the difference when a folder tree's validation classes are not its training ones
    (the class index is the position in the sorted training classes: a difference shifts every label)."""
    found = folder_tree_classes(folder)
    if found is None or found[1] is None or found[0] == found[1]:
        return
    train, validation = (set(names) for names in found)
    parts = [f"{_first_few(only)} only in {where}"
             for only, where in ((validation - train, "validation"), (train - validation, "training")) if only]
    raise DataError(f"{folder}: the validation folder's classes differ from the training folder's ({'; '.join(parts)})")


def _first_few(names: set[str], shown: int = 3) -> str:
    ordered = sorted(names)
    return ", ".join(ordered[:shown]) + (f" and {len(ordered) - shown} more" if len(ordered) > shown else "")


def imagenet_dataset(folder: str | os.PathLike, train: bool, transform=None) -> tuple[Dataset, int]:
    """(dataset, number of classes) for the split, whichever layout `folder` holds."""
    layout = detect_imagenet(folder)
    split = "train" if train else "validation"
    if layout == "tfrecord":
        return TFRecordDataset(folder, split, transform), IMAGENET_CLASSES
    if layout == "folder":
        dataset = ImageFolderDataset(folder, split, transform)
        return dataset, len(dataset.classes)
    raise DataError(
        f"{folder}: no ImageNet found: expected TFRecord shards (train-00000-of-01024, "
        "validation-00000-of-00128, ...) or image folders train/<class>/ and validation/<class>/ (or val/)"
    )


def training_subset(dataset: Dataset, percentage: int) -> np.ndarray:
    """Indices of the first `percentage` % of the training set (--dataset-percentage-to-use).

    TFRecord shards are class-mixed, so the first records are a fair sample (the seed takes the
    first shards). A folder tree is sorted by class, so there the first p % of each class is taken
    instead: the plain first p % would drop whole classes."""
    if not 1 <= percentage <= 100:
        raise ConfigError(f"--dataset-percentage-to-use must be between 1 and 100, got {percentage}")
    size = len(dataset)
    if percentage == 100:
        return np.arange(size)
    targets = getattr(dataset, "targets", None)
    if targets is None:
        return np.arange(max(1, size * percentage // 100))
    targets = np.asarray(targets)
    keep = []
    for label in np.unique(targets):
        members = np.flatnonzero(targets == label)
        keep.append(members[:max(1, len(members) * percentage // 100)])
    return np.sort(np.concatenate(keep))


# ----------------------------------------------------------------------------------------------
# Samplers
# ----------------------------------------------------------------------------------------------


def _check_shard(shard: tuple[int, int]) -> tuple[int, int]:
    rank, world = shard
    if world < 1 or not 0 <= rank < world:
        raise ConfigError(f"shard rank {rank} is outside 0..{world - 1}")
    return rank, world


class EvaluationSampler(Sampler[int]):
    """Rank r of w takes the contiguous block [r*N//w, (r+1)*N//w) of the N samples in order: every
    sample exactly once across the ranks, no padding, no duplicates (torch's DistributedSampler
    pads with repeats, which would count some images twice). Contiguous blocks keep TFRecord reads
    sequential. Ranks' counts differ by at most one, so one rank may have one batch fewer."""

    def __init__(self, size: int, shard: tuple[int, int] = (0, 1)) -> None:
        rank, world = _check_shard(shard)
        self.begin, self.end = rank * size // world, (rank + 1) * size // world
        self.start = 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Same order every epoch; `start` skips that many of this rank's samples (resuming)."""
        del epoch
        self.start = start

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.begin + self.start, self.end))

    @property
    def samples_per_epoch(self) -> int:
        return self.end - self.begin

    def __len__(self) -> int:
        return max(0, self.samples_per_epoch - self.start)


class TrainingSampler(Sampler[tuple[int, int]]):
    """A fresh shuffle of `indices` each epoch, a function of (seed, epoch) only, dealt out to the
    ranks by cnns.data.batches.ShardPlan: rank r takes positions r, r+w, r+2w, ... of the shuffled
    order, and its k-th batch is the k-th run of batch_size of them. Only whole groups of
    w * batch_size positions are used, and with global_batch_size only whole global batches, so
    every rank has the same number of samples, a multiple of batch_size (a different remainder is
    left out each epoch). With global_batch_size = w x accumulation x batch_size, the samples of
    update u over all ranks are positions [u * global, (u + 1) * global) of the epoch's order, as
    for one process with w times the accumulation.

    Yields (dataset index, epoch): SeededSamples seeds each sample's augmentation from them."""

    def __init__(self, indices: Sequence[int], shard: tuple[int, int] = (0, 1), seed: int = 0, *,
                 batch_size: int = 1, global_batch_size: int | None = None) -> None:
        rank, world = _check_shard(shard)
        self.indices = np.asarray(indices, dtype=np.int64)
        self.plan = ShardPlan(len(self.indices), batch_size, rank, world, True, global_batch_size)
        self.rank, self.world = rank, world
        self.seed = seed
        self.epoch = 0
        self.start = 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Choose the epoch's order; `start` skips that many of this rank's samples (resuming)."""
        self.epoch, self.start = epoch, start

    def __iter__(self) -> Iterator[tuple[int, int]]:
        generator = torch.Generator().manual_seed(mix_seed(self.seed, self.epoch))
        order = torch.randperm(len(self.indices), generator=generator).numpy()
        positions = self.plan.positions
        mine = self.indices[order[positions.start:positions.stop:positions.step]]
        return ((int(index), self.epoch) for index in mine[self.start:])

    @property
    def samples_per_epoch(self) -> int:
        return self.plan.samples

    def __len__(self) -> int:
        return max(0, self.samples_per_epoch - self.start)


class SeededSamples(Dataset):
    """dataset[index] run under torch's CPU RNG seeded from (seed, epoch, index), for keys
    (index, epoch) from TrainingSampler; the RNG state is restored afterwards, so the caller's
    stream (the main process when workers=0) is left untouched. Only the CPU generator is
    reseeded: a forked worker must not touch CUDA."""

    def __init__(self, dataset: Dataset, seed: int) -> None:
        self.dataset = dataset
        self.seed = seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]):
        index, epoch = key
        saved = torch.get_rng_state()
        torch.default_generator.manual_seed(mix_seed(self.seed, epoch, index))
        try:
            return self.dataset[index]
        finally:
            torch.set_rng_state(saved)


# ----------------------------------------------------------------------------------------------
# Loaders
# ----------------------------------------------------------------------------------------------


def build_imagenet_loader(
    folder: str | os.PathLike,
    train: bool,
    batch_size: int,
    image_size: int,
    workers: int,
    seed: int,
    shard: tuple[int, int] = (0, 1),
    drop_last: bool = False,
    pin_memory: bool = False,
    percentage: int = 100,
    global_batch_size: int | None = None,
    skip_corrupt: bool = False,
) -> tuple[DataLoader, int, int]:
    """(loader, num_samples, num_classes) for one split of the ImageNet in `folder`.

    The loader yields (uint8 [N, image_size, image_size, 3], int64 [N]) batches. Call
    ``loader.sampler.set_epoch(epoch, start=samples_to_skip)`` before each epoch (training
    reshuffles; evaluation ignores the epoch). num_samples is the size of the split over all
    ranks, after `percentage` (which applies to training only). With drop_last False, evaluation
    yields every image exactly once across the ranks. Training batches follow TrainingSampler:
    whole groups of shard-count x batch_size samples, and with global_batch_size (training only)
    whole global batches per epoch.
    """
    if batch_size < 1:
        raise ConfigError(f"batch size must be positive, got {batch_size}")
    dataset, num_classes = imagenet_dataset(folder, train, ImageNetTransform(train, image_size, skip_corrupt))
    if train:
        indices = training_subset(dataset, percentage)
        sampler: Sampler = TrainingSampler(indices, shard, seed, batch_size=batch_size,
                                           global_batch_size=global_batch_size)
        dataset = SeededSamples(dataset, seed)
        num_samples = len(indices)
    else:
        sampler = EvaluationSampler(len(dataset), shard)
        num_samples = len(dataset)
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=workers,
        pin_memory=pin_memory,
        drop_last=drop_last,
        # Workers stay up between epochs: restarting them would stall the start of every epoch.
        persistent_workers=workers > 0,
        collate_fn=collate_skipping_corrupt if skip_corrupt else None,
        # Its own generator for the workers' base seeds, which would otherwise be drawn from (and
        # advance) the caller's global RNG; augmentation itself is seeded per sample.
        generator=torch.Generator().manual_seed(mix_seed(seed, shard[0])),
    )
    return loader, num_samples, num_classes


def worker_error_as_raised(error: CnnsError) -> CnnsError:
    """The error as the worker raised it. torch re-raises an exception from a DataLoader worker as the
    same type, but with "Caught DataError in DataLoader worker process N." and the worker's whole
    traceback as its message (torch.utils.data._utils.ExceptionWrapper.reraise); the original message
    is the end of that traceback, after "cnns.errors.DataError: ". Other errors are returned as they are."""
    text = str(error)
    if not (text.startswith("Caught ") and "\nOriginal Traceback" in text):
        return error
    kind = type(error)
    prefixes = (f"{kind.__module__}.{kind.__qualname__}: ", f"{kind.__qualname__}: ")
    lines = text.rstrip("\n").splitlines()
    for index in range(len(lines) - 1, 0, -1):
        for prefix in prefixes:
            if lines[index].startswith(prefix):
                return kind("\n".join([lines[index][len(prefix):], *lines[index + 1:]]))
    return kind(lines[-1])


def _private_copy(batch: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache holds ordinary copies: a batch from a worker lives in its own shared-memory mapping
    (kept by the thousand, they would count against the kernel's limit on mappings) and a pinned
    batch in page-locked memory, which gigabytes of cache should not hold down."""
    images, labels = batch
    return images.clone(), labels.clone()


def physical_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX system: assume 8 GB
        return 8 << 30


# At most this fraction of the machine's memory holds cached evaluation images (full ImageNet
# validation at 224 px is 7.5 GB of uint8 pixels).
CACHE_MEMORY_FRACTION = 0.25


class ImageNetBatches:
    """The batch-source protocol of cnns.data.sources over build_imagenet_loader: len() batches
    per epoch, epoch(e, start_batch) yields (uint8 NHWC, int64) batches, num_samples, num_classes.
    Training uses whole batches on every rank (every rank then runs the same number of steps), and
    with global_batch_size whole global batches (TrainingSampler); evaluation keeps the last partial
    batch, so every image is seen exactly once across ranks.

    The dataset cache (the seed's default; --no-dataset-cache turns it off): evaluation batches are
    the same at every pass (resize and centre crop are deterministic), so the first complete pass
    keeps them in memory as uint8 and later passes (one per validated checkpoint) decode nothing.
    Training batches are never cached: their crops change every epoch, so they must be decoded
    again; the encoded files themselves are left to the operating system's page cache. The cache
    is used only when the evaluation images fit in CACHE_MEMORY_FRACTION of the machine's memory.
    """

    def __init__(self, folder: str | os.PathLike, train: bool, batch_size: int, image_size: int = 224,
                 workers: int = 4, seed: int = 0, shard: tuple[int, int] = (0, 1), percentage: int = 100,
                 pin_memory: bool = False, cache: bool = False, global_batch_size: int | None = None,
                 skip_corrupt: bool = False) -> None:
        self.loader, self.num_samples, self.num_classes = build_imagenet_loader(
            folder, train, batch_size, image_size, workers, seed, shard,
            drop_last=train, pin_memory=pin_memory, percentage=percentage,
            global_batch_size=global_batch_size if train else None, skip_corrupt=skip_corrupt)
        self.skip_corrupt = skip_corrupt
        # --skip-corrupt-images: images dropped so far (a pass over cached batches adds none), and the
        # first few of them by name.
        self.skipped_images = 0
        self.skipped_names: list[str] = []
        self.batch_size = batch_size
        if train and len(self.loader) == 0:
            whole = global_batch_size or batch_size * shard[1]
            raise DataError(f"the training set in {folder} has {self.num_samples} images, fewer than one global "
                            f"batch of {whole} ({shard[1]} ranks x {whole // shard[1]})")
        cache_bytes = self.loader.sampler.samples_per_epoch * image_size * image_size * 3
        self.caching = cache and not train and cache_bytes <= CACHE_MEMORY_FRACTION * physical_memory_bytes()
        self._cached: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def __len__(self) -> int:
        """Batches in a whole epoch on this rank (also while an epoch resumed mid-way is running)."""
        samples = self.loader.sampler.samples_per_epoch
        if self.loader.drop_last:
            return samples // self.batch_size
        return -(-samples // self.batch_size)

    def epoch(self, epoch: int, start_batch: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if start_batch < 0:
            raise ValueError(f"start_batch must not be negative, got {start_batch}")
        if self._cached is not None:
            yield from self._cached[start_batch:]
            return
        keep = [] if self.caching and start_batch == 0 else None
        self.loader.sampler.set_epoch(epoch, start=start_batch * self.batch_size)
        try:
            batches = iter(self.loader)
            while True:
                try:
                    batch = next(batches)
                except StopIteration:
                    break
                except CnnsError as error:  # a bad file met in a worker process: one line, as in this one
                    raise worker_error_as_raised(error) from None
                if self.skip_corrupt:
                    *batch, skipped = batch
                    self.skipped_images += len(skipped)
                    self.skipped_names += [name for name in skipped if name not in self.skipped_names][
                        :max(0, SKIPPED_NAMES_KEPT - len(self.skipped_names))]
                    if len(batch[1]) == 0:
                        continue  # every image of this batch was corrupt
                if keep is not None:
                    keep.append(_private_copy(batch))
                yield batch
        finally:
            self.loader.sampler.set_epoch(epoch, start=0)
        if keep is not None:  # only a pass that ran to the end is complete
            self._cached = keep
