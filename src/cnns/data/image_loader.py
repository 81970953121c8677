"""ImageNet loading shared by every layout: Graphcore's application's preprocessing, sharded sampling, and a
DataLoader whose workers fill whole batches. Which layout a folder holds is the formats' business
(`cnns.data.formats`): the loader is handed the split's reader (`ImageRecords`) and never asks.

Batches are (uint8 [N, H, W, 3], int64 [N]): 8-bit I/O is the default transfer, and the device
normalises (cnns.data.augment.normalise), as Graphcore's application does with --eight-bit-io.

A worker is given the keys of a whole batch (`ImageBatchDataset`): it allocates the batch in shared
memory, and for each image reads the encoded bytes, draws the crop from the header's size and has the
run's decoder (`cnns.data.decoding`) write the crop's pixels straight into the batch's row. The main
process receives only the shared-memory handle: no per-sample tensors, no collate copy, no pickled
pixels. With decoding on the GPU the workers send the encoded JPEGs and their crops instead, and the
main process decodes the batch there (`cnns.data.decoding.DeviceBatch`).

Randomness: each training sample's crop and flip are drawn by a numpy generator seeded from (seed,
epoch, sample index), so the augmentation of an epoch is the same whatever the worker count or the
rank, and a run resumed mid-epoch repeats it exactly; the shuffle is a function of (seed, epoch).
"""

from __future__ import annotations

import math
import os
from typing import Iterable, Iterator, Protocol, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, get_worker_info

from cnns.data.batches import ShardPlan, mix_seed, shuffled
from cnns.data.batchpool import BatchPool, new_shared_tensor
from cnns.data.decoding import Crop, DecodeClock, DeviceBatch, ImageDecoder, device_jpeg_size
from cnns.data.imagefolder import stored_orientation
from cnns.errors import CnnsError, ConfigError, DataError, HandedBack, handed_back

# Graphcore's application's training crop (sample_distorted_bounding_box without boxes), as torchvision's
# RandomResizedCrop draws it: area and aspect ranges, and the tries before the centre-crop fallback.
CROP_AREA = (0.05, 1.0)
CROP_ASPECT = (3 / 4, 4 / 3)
CROP_TRIES = 10
# Labels the crop's random stream apart from the other streams of (seed, epoch, index).
_CROP_STREAM = 0xC409
_MASK64 = (1 << 64) - 1
# training_crop's constants as the native decoder draws with them (cnns.kernels.jpeg.CropDraw after the
# sample's seed, epoch and index); the logarithms are training_crop's own (the same libm).
_NATIVE_CROP_DRAW = (CROP_AREA[0], CROP_AREA[1], math.log(CROP_ASPECT[0]), math.log(CROP_ASPECT[1]),
                     CROP_ASPECT[0], CROP_ASPECT[1], CROP_TRIES, _CROP_STREAM)


# ----------------------------------------------------------------------------------------------
# Preprocessing
# ----------------------------------------------------------------------------------------------


# Graphcore's evaluation crop: the centre 224 of the short side resized to 256 (timm's crop_pct 0.875), bilinear.
EVAL_CROP_PCT = 0.875
EVAL_INTERPOLATION = "bilinear"


def evaluation_resize(image_size: int, crop_pct: float = EVAL_CROP_PCT) -> int:
    """The short side before the centre crop: image_size / crop_pct rounded down (timm's eval transform); 256 for
    224 at Graphcore's 0.875, which is its image_size x 256/224."""
    return math.floor(image_size / crop_pct)


def training_crop(height: int, width: int, rng: np.random.Generator) -> Crop:
    """torchvision's RandomResizedCrop(scale=CROP_AREA, ratio=CROP_ASPECT).get_params, drawn from `rng`:
    up to CROP_TRIES draws of an area (uniform) and an aspect (log-uniform) whose rounded box fits, placed
    uniformly; else the centre crop of the whole image clamped to the aspect range. Then a horizontal
    flip with probability 1/2."""
    area = height * width
    log_aspect = (math.log(CROP_ASPECT[0]), math.log(CROP_ASPECT[1]))
    for _ in range(CROP_TRIES):
        target_area = area * rng.uniform(*CROP_AREA)
        aspect = math.exp(rng.uniform(*log_aspect))
        box_width = int(round(math.sqrt(target_area * aspect)))
        box_height = int(round(math.sqrt(target_area / aspect)))
        if 0 < box_width <= width and 0 < box_height <= height:
            top = int(rng.integers(0, height - box_height + 1))
            left = int(rng.integers(0, width - box_width + 1))
            return Crop((top, left, box_height, box_width), flip=bool(rng.random() < 0.5))
    ratio = width / height
    if ratio < CROP_ASPECT[0]:
        box_width, box_height = width, int(round(width / CROP_ASPECT[0]))
    elif ratio > CROP_ASPECT[1]:
        box_height, box_width = height, int(round(height * CROP_ASPECT[1]))
    else:
        box_height, box_width = height, width
    top, left = (height - box_height) // 2, (width - box_width) // 2
    return Crop((top, left, box_height, box_width), flip=bool(rng.random() < 0.5))


def evaluation_crop(height: int, width: int, image_size: int, crop_pct: float = EVAL_CROP_PCT,
                    interpolation: str = EVAL_INTERPOLATION) -> Crop:
    """The box, in source pixels, that "resize the short side to evaluation_resize(image_size, crop_pct), then crop
    the centre image_size square" keeps (torchvision's Resize and CenterCrop rounding, as timm's eval transform
    takes them): fractional where the resize is not by a whole factor; resized with `interpolation`."""
    short = evaluation_resize(image_size, crop_pct)
    if width <= height:
        resized_width, resized_height = short, int(short * height / width)
    else:
        resized_height, resized_width = short, int(short * width / height)
    top = int(round((resized_height - image_size) / 2.0))
    left = int(round((resized_width - image_size) / 2.0))
    scale_y, scale_x = height / resized_height, width / resized_width
    return Crop((top * scale_y, left * scale_x, image_size * scale_y, image_size * scale_x), whole_first=True,
                interpolation=interpolation)


def evaluation_transform(image_size: int, crop_pct: float = EVAL_CROP_PCT):
    """Resize the short side to evaluation_resize(image_size, crop_pct) (bilinear), then crop the centre image_size
    square: torchvision's statement of the bilinear evaluation preprocessing on a decoded uint8 [3, H, W] image."""
    from torchvision.transforms import v2

    return v2.Compose([
        v2.Resize(evaluation_resize(image_size, crop_pct), antialias=True),
        v2.CenterCrop(image_size),
    ])


def _splitmix64(value: int) -> int:
    """SplitMix64's finaliser: a 64-bit integer well mixed into another (the usual way to seed from counters)."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


_SAMPLE_GENERATOR = np.random.Generator(np.random.PCG64(0))


def sample_generator(seed: int, epoch: int, index: int) -> np.random.Generator:
    """numpy's PCG64 generator set to a state that is a function of (seed, epoch, index) alone: the
    sample's own random stream, whichever process or worker draws it. One generator per process is
    reused and its state replaced, which costs a tenth of building one (SeedSequence's hashing)."""
    mixed = _splitmix64(_splitmix64(_splitmix64(_CROP_STREAM ^ (seed & _MASK64)) ^ (epoch & _MASK64))
                        ^ (index & _MASK64))
    low, increment = _splitmix64(mixed), _splitmix64(mixed ^ _MASK64)
    _SAMPLE_GENERATOR.bit_generator.state = {
        "bit_generator": "PCG64", "state": {"state": mixed << 64 | low, "inc": increment << 1 | 1},
        "has_uint32": 0, "uinteger": 0}
    return _SAMPLE_GENERATOR


SampleKey = tuple[int, int] | int  # training: (dataset index, epoch); evaluation: the dataset index


class ImageNetTransform:
    """Encoded image bytes -> uint8 [image_size, image_size, 3] written into a batch row: the training
    crop (random resized crop and flip, drawn from the sample's own generator) or the evaluation crop,
    decoded by `decoder`; the evaluation crop keeps `crop_pct` of the resized short side and resizes with
    `interpolation` (the run's --eval-crop-pct and --eval-interpolation). A plain picklable class, so DataLoader
    workers can receive it."""

    def __init__(self, train: bool, image_size: int, seed: int = 0, decoder: ImageDecoder | None = None,
                 crop_pct: float = EVAL_CROP_PCT, interpolation: str = EVAL_INTERPOLATION) -> None:
        self.train = train
        self.image_size = image_size
        self.seed = seed
        self.decoder = decoder or ImageDecoder()
        self.crop_pct, self.interpolation = crop_pct, interpolation

    @classmethod
    def evaluation(cls, data, decoder: ImageDecoder | None = None) -> "ImageNetTransform":
        """The evaluation transform of the run's data configuration (`cnns.data.data_config.DataConfig`): the one
        validation, weight averaging and predict prepare images with."""
        return cls(False, data.image_size, 0, decoder, data.eval_crop_pct, data.eval_interpolation)

    @property
    def on_host_only(self) -> bool:
        """Whether its crops are resized by a resampler only the host has (PIL's bicubic): then no file goes to
        nvJPEG or DALI, and the workers decode every image."""
        return not self.train and self.interpolation != "bilinear"

    def crop(self, height: int, width: int, key: SampleKey) -> Crop:
        """The crop of this sample for an image of (height, width): a function of (seed, epoch, index)."""
        if not self.train:
            return evaluation_crop(height, width, self.image_size, self.crop_pct, self.interpolation)
        index, epoch = key
        return training_crop(height, width, sample_generator(self.seed, epoch, index))

    def into(self, data: bytes, source: str, key: SampleKey, out: torch.Tensor | np.ndarray,
             clock: DecodeClock | None = None) -> None:
        """Write the sample's crop into `out` (uint8 [image_size, image_size, 3], a CPU tensor or numpy array
        such as a row of a batch's numpy view); DataError naming
        `source` when the bytes cannot be decoded; with `clock`, each stage's time added to it. A training
        crop is drawn by the native decoder itself where it decodes the file (the same crop as `crop`'s)."""
        if self.train:
            index, epoch = key
            self.decoder.decode_training_into(
                data, source, (self.seed & _MASK64, epoch & _MASK64, index & _MASK64, *_NATIVE_CROP_DRAW),
                lambda height, width: self.crop(height, width, key), out, clock)
            return
        self.decoder.decode_into(data, source, lambda height, width: self.crop(height, width, key), out, clock)

    def __call__(self, data: bytes, source: str, key: SampleKey = (0, 0)) -> torch.Tensor:
        """The sample's crop as a new uint8 [image_size, image_size, 3] tensor."""
        out = torch.empty((self.image_size, self.image_size, 3), dtype=torch.uint8)
        self.into(data, source, key if self.train else 0, out)
        return out


SKIPPED_NAMES_KEPT = 3  # named in the run's last lines; the rest are counted


def new_batch_tensor(shape: tuple[int, ...], dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """An uninitialised tensor for a batch: in a DataLoader worker, in shared memory from the start."""
    if get_worker_info() is None:
        return torch.empty(shape, dtype=dtype)
    return new_shared_tensor(shape, dtype)


# ----------------------------------------------------------------------------------------------
# What the loader reads
# ----------------------------------------------------------------------------------------------


class ImageRecords(Protocol):
    """One split's encoded images, as a format's module reads them (`DataFormat.records`): the loader needs
    only these, so a new layout is a new reader, and nothing here knows any layout. A reader is pickled to
    the DataLoader's workers: it holds an index, not open files."""

    num_classes: int  # the classes its labels can take
    where: str  # the split's files, for messages

    def __len__(self) -> int: ...

    def read(self, index: int) -> tuple[bytes, int, str]:
        """(encoded image, 0-based class, where it is for messages); DataError for what cannot be read."""

    def source(self, index: int) -> str:
        """Where sample `index` is, for messages (without reading it)."""

    def training_order(self, indices: np.ndarray, seed: int, epoch: int) -> np.ndarray:
        """`indices` in epoch `epoch`'s order: a function of (seed, epoch) alone (`shuffled` for most)."""


def training_subset(dataset: ImageRecords, percentage: int) -> np.ndarray:
    """Indices of the first `percentage` % of the training set (--dataset-percentage-to-use).

    TFRecord shards are class-mixed, so the first records are a fair sample (Graphcore's application takes
    the first shards). A folder tree is sorted by class, so there the first p % of each class is taken
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
    """A fresh order of `indices` each epoch (`order`, the reader's; `shuffled` by default), a function of (seed,
    epoch) only, dealt out to the
    ranks by cnns.data.batches.ShardPlan: the shuffled order is cut into runs of batch_size, dealt
    out in turn (rank r's k-th batch is run k * w + r). Only whole groups of
    w * batch_size positions are used, and with global_batch_size only whole global batches, so
    every rank has the same number of samples, a multiple of batch_size (a different remainder is
    left out each epoch). With global_batch_size = w x accumulation x batch_size, the samples of
    update u over all ranks are positions [u * global, (u + 1) * global) of the epoch's order, as
    for one process with w times the accumulation.

    Yields (dataset index, epoch): ImageNetTransform seeds each sample's crop from them."""

    def __init__(self, indices: Sequence[int], shard: tuple[int, int] = (0, 1), seed: int = 0, *,
                 batch_size: int = 1, global_batch_size: int | None = None, order=shuffled) -> None:
        rank, world = _check_shard(shard)
        self.order = order
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
        mine = self.order(self.indices, self.seed, self.epoch)[self.plan.positions]
        return ((int(index), self.epoch) for index in mine[self.start:])

    @property
    def samples_per_epoch(self) -> int:
        return self.plan.samples

    def __len__(self) -> int:
        return max(0, self.samples_per_epoch - self.start)


class BatchKeys(Sampler[list]):
    """The keys of each batch, in order: runs of batch_size keys of a sample sampler (the last run
    shorter, unless drop_last). set_epoch passes through; its `start` counts samples."""

    def __init__(self, samples: TrainingSampler | EvaluationSampler, batch_size: int, drop_last: bool) -> None:
        self.samples = samples
        self.batch_size = batch_size
        self.drop_last = drop_last

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.samples.set_epoch(epoch, start)

    @property
    def samples_per_epoch(self) -> int:
        return self.samples.samples_per_epoch

    def batches_per_epoch(self) -> int:
        return self._batches(self.samples_per_epoch)

    def _batches(self, samples: int) -> int:
        return samples // self.batch_size if self.drop_last else -(-samples // self.batch_size)

    def __iter__(self) -> Iterator[list]:
        batch: list = []
        for key in self.samples:
            batch.append(key)
            if len(batch) == self.batch_size:
                yield batch
                batch = []
        if batch and not self.drop_last:
            yield batch

    def __len__(self) -> int:
        return self._batches(len(self.samples))


class ImageBatchDataset(Dataset):
    """dataset[keys] is a whole batch: the samples of `keys` (from BatchKeys) read from `records` and
    decoded straight into one uint8 [N, S, S, 3] tensor, made in shared memory in a worker.

    Returns (images, labels, names of the images that could not be decoded, which skip_corrupt leaves
    out: the batch shrinks, the pool's number of the batch's buffer or -1). With `pool` the workers write
    their batches into its reusable buffers, and a batch in one of them comes back as (None, the labels as a
    list, names, its number): the main process has the buffer (`BatchPool.receive`), so only that crosses.
    With `device_decoding` it returns a DeviceBatch instead, for the main process to decode on that device."""

    def __init__(self, records: ImageRecords, transform: ImageNetTransform, skip_corrupt: bool = False,
                 device_decoding: torch.device | None = None, pool: BatchPool | None = None) -> None:
        self.records = records
        self.transform = transform
        self.skip_corrupt = skip_corrupt
        self.device_decoding = device_decoding
        self.pool = pool

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, keys: list[SampleKey]) -> tuple | DeviceBatch | HandedBack:
        try:
            return self._batch(keys)
        except CnnsError as error:  # a bad file: in a worker, handed back whole (cnns.errors.HandedBack)
            if get_worker_info() is None:
                raise
            return HandedBack(error)

    def _batch(self, keys: list[SampleKey]) -> tuple | DeviceBatch:
        if self.device_decoding is not None:
            return self._for_device(keys)
        size = self.transform.image_size
        if self.pool is not None:
            images, number = self.pool.batch(len(keys))
        else:
            images, number = new_batch_tensor((len(keys), size, size, 3)), -1
        samples = (self._read(key) for key in keys)  # read as each is decoded
        _, labels, skipped = self._decode_into_rows(samples, images)
        if number >= 0:
            return None, labels, skipped, number
        return images[:len(labels)], torch.tensor(labels, dtype=torch.int64), skipped, number

    def _read(self, key: SampleKey) -> tuple[SampleKey, bytes | None, int, str]:
        """(key, encoded bytes, label, source) of one sample. A file that cannot be read (not a regular file,
        larger than --max-file-size, a bad record) is a DataError, or with --skip-corrupt-images comes back
        without bytes, to be left out and named as an image that does not decode is."""
        index = _index(key)
        try:
            return (key, *self.records.read(index))
        except DataError:
            if not self.skip_corrupt:
                raise
            return key, None, -1, self.records.source(index)

    def _decode_into_rows(self, samples: Iterable[tuple[SampleKey, bytes | None, int, str]],
                          images: torch.Tensor) -> tuple[list[int], list[int], list[str]]:
        """Decode each sample (key, data, label, source) into the next free row of `images`. Returns (the
        positions in `samples` that were decoded, their labels, the sources --skip-corrupt-images left out:
        those that do not decode and those that could not be read, which come without data)."""
        decoded: list[int] = []
        labels: list[int] = []
        skipped: list[str] = []
        rows = images.numpy()  # a row of the numpy view costs a tenth of a tensor's row, and the same memory
        for position, (key, data, label, source) in enumerate(samples):
            if data is None:
                skipped.append(source)
                continue
            try:
                self.transform.into(data, source, key, rows[len(labels)])
            except DataError:
                if not self.skip_corrupt:
                    raise
                skipped.append(source)
                continue
            decoded.append(position)
            labels.append(label)
        return decoded, labels, skipped

    def _for_device(self, keys: list[SampleKey]) -> DeviceBatch:
        """The JPEGs nvJPEG takes go as encoded bytes with their crops; the workers decode the rest."""
        size = self.transform.image_size
        device_samples, host_samples, labels = [], [], []
        for key in keys:
            _, data, label, source = self._read(key)
            try:
                shape = device_jpeg_size(data, source) if data is not None and not self.transform.on_host_only else None
            except DataError:  # a header declaring too many pixels: decode_into names it again
                shape = None
            row = len(labels)
            labels.append(label)
            if shape is None:
                host_samples.append((row, (key, data, label, source)))
            else:
                device_samples.append((row, stored_orientation(data), source, self.transform.crop(*shape, key), shape))
        host_images = new_batch_tensor((len(host_samples), size, size, 3))
        decoded, _, skipped = self._decode_into_rows([sample for _, sample in host_samples], host_images)
        host_rows = [host_samples[position][0] for position in decoded]
        dropped = {row for row, _ in host_samples} - set(host_rows)
        # Rows renumbered without the dropped ones.
        renumbered = {row: new for new, row in enumerate(r for r in range(len(labels)) if r not in dropped)}
        offsets = np.cumsum([0] + [len(data) for _, data, *_ in device_samples]).tolist()
        encoded = new_batch_tensor((offsets[-1],))
        buffer = encoded.numpy()
        for (_, data, *_), begin, end in zip(device_samples, offsets, offsets[1:]):
            buffer[begin:end] = np.frombuffer(data, dtype=np.uint8)
        kept_labels = new_batch_tensor((len(renumbered),), torch.int64)
        kept_labels.copy_(torch.tensor([label for row, label in enumerate(labels) if row not in dropped],
                                       dtype=torch.int64))
        return DeviceBatch(
            labels=kept_labels, encoded=encoded, offsets=offsets,
            device_rows=[renumbered[row] for row, *_ in device_samples],
            crops=[crop for *_, crop, _ in device_samples], sizes=[shape for *_, shape in device_samples],
            sources=[source for _, _, source, *_ in device_samples],
            host_images=host_images[:len(host_rows)], host_rows=[renumbered[row] for row in host_rows],
            image_size=size, skipped=skipped)


def _index(key: SampleKey) -> int:
    return key[0] if isinstance(key, tuple) else key


# ----------------------------------------------------------------------------------------------
# Loaders
# ----------------------------------------------------------------------------------------------


# A worker's reusable batches: the DataLoader's two batches in flight per worker, the one the consumer is
# using and one it has just let go of (freed when the next arrives).
BATCH_BUFFERS_PER_WORKER = 4


def shared_memory_bytes(workers: int, batch_size: int, image_size: int) -> int:
    """What one loader's reusable batch buffers (`BatchPool`) take in shared memory (/dev/shm) once its workers
    have written them: the pages are the kernel's to find at the first write, so a /dev/shm too small ends in a
    worker's bus error, not at the start (`cnns.commands.checks.check_shared_memory` looks before the run)."""
    return workers * BATCH_BUFFERS_PER_WORKER * batch_size * image_size * image_size * 3


def build_imagenet_loader(
    records: ImageRecords,
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
    decoder: ImageDecoder | None = None,
    device_decoding: torch.device | None = None,
    reuse_buffers: bool = False,
    eval_crop_pct: float = EVAL_CROP_PCT,
    eval_interpolation: str = EVAL_INTERPOLATION,
) -> tuple[DataLoader, int, int]:
    """(loader, num_samples, num_classes) for one split's `records` (`train` its training split).

    The loader yields (uint8 [N, image_size, image_size, 3], int64 [N], names of the images left out
    (skip_corrupt), the batch's buffer in the loader's BatchPool or -1) (with device_decoding, DeviceBatch). Call
    ``loader.sampler.set_epoch(epoch, start=samples_to_skip)`` before each epoch (training
    reshuffles; evaluation ignores the epoch). num_samples is the size of the split over all
    ranks, after `percentage` (which applies to training only). With drop_last False, evaluation
    yields every image exactly once across the ranks. Training batches follow TrainingSampler:
    whole groups of shard-count x batch_size samples, and with global_batch_size (training only)
    whole global batches per epoch. What `records` cannot read (an image larger than --max-file-size, a damaged
    record) is a DataError, or with skip_corrupt left out and named.

    Each worker makes whole batches (ImageBatchDataset): the DataLoader's own batching is off
    (batch_size=None) and its sampler gives the keys of one batch at a time. With `reuse_buffers` (and
    workers, no pinning, no device decoding) they write into the dataset's BatchPool, and such a batch comes
    as (None, labels list, names, number) for `BatchPool.receive` (`ImageNetBatches` does that).
    """
    if batch_size < 1:
        raise ConfigError(f"batch size must be positive, got {batch_size}")
    if train:
        indices = training_subset(records, percentage)
        samples: TrainingSampler | EvaluationSampler = TrainingSampler(
            indices, shard, seed, batch_size=batch_size, global_batch_size=global_batch_size,
            order=records.training_order)
        num_samples = len(indices)
    else:
        samples = EvaluationSampler(len(records), shard)
        num_samples = len(records)
    transform = ImageNetTransform(train, image_size, seed, decoder, eval_crop_pct, eval_interpolation)
    # Reusable batch buffers where the workers' batches are the ones the consumer gets: pinning copies them
    # to page-locked memory anyway, and device decoding sends encoded bytes.
    pool = (BatchPool(workers, BATCH_BUFFERS_PER_WORKER, (batch_size, image_size, image_size, 3))
            if reuse_buffers and workers > 0 and not pin_memory and device_decoding is None else None)
    loader = DataLoader(
        ImageBatchDataset(records, transform, skip_corrupt, device_decoding, pool),
        batch_size=None,
        sampler=BatchKeys(samples, batch_size, drop_last),
        num_workers=workers,
        pin_memory=pin_memory,
        # Workers stay up between epochs: restarting them would stall the start of every epoch.
        persistent_workers=workers > 0,
        # Its own generator for the workers' base seeds, which would otherwise be drawn from (and
        # advance) the caller's global RNG; augmentation itself is seeded per sample.
        generator=torch.Generator().manual_seed(mix_seed(seed, shard[0])),
    )
    return loader, num_samples, records.num_classes


def _private_copy(images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache holds ordinary host copies: a batch from a worker lives in its own shared-memory
    mapping (kept by the thousand, they would count against the kernel's limit on mappings), a pinned
    batch in page-locked memory, which gigabytes of cache should not hold down, and a batch decoded on
    the GPU in the GPU's memory, which the model needs."""
    return images.to("cpu", copy=True), labels.to("cpu", copy=True)


def physical_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX system: assume 8 GB
        return 8 << 30


# At most this fraction of the machine's memory holds cached evaluation images (full ImageNet
# validation at 224 px is 7.5 GB of uint8 pixels).
CACHE_MEMORY_FRACTION = 0.25


class EpochBatches:
    """What every ImageNet batch source does around its decoder (`ImageNetBatches` here, `cnns.data.dali`'s
    `DaliBatches`): an epoch from a start batch, the evaluation cache, --skip-corrupt-images' count of the images
    left out. A source sets `keys` (its BatchKeys), `batch_size`, calls `_start_epochs`, and yields
    (images, labels, names of the images left out) from `_batches`, its keys' current epoch."""

    keys: BatchKeys
    batch_size: int

    def _start_epochs(self, train: bool, cache: bool, image_size: int) -> None:
        # --skip-corrupt-images: images dropped so far (a pass over cached batches adds none), and the
        # first few of them by name.
        self.skipped_images = 0
        self.skipped_names: list[str] = []
        cache_bytes = self.keys.samples_per_epoch * image_size * image_size * 3
        self.caching = cache and not train and cache_bytes <= CACHE_MEMORY_FRACTION * physical_memory_bytes()
        self._cached: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def __len__(self) -> int:
        """Batches in a whole epoch on this rank (also while an epoch resumed mid-way is running)."""
        return self.keys.batches_per_epoch()

    def epoch(self, epoch: int, start_batch: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if start_batch < 0:
            raise ValueError(f"start_batch must not be negative, got {start_batch}")
        if self._cached is not None:
            yield from self._cached[start_batch:]
            return
        keep = [] if self.caching and start_batch == 0 else None
        self.keys.set_epoch(epoch, start=start_batch * self.batch_size)
        finished = False
        try:
            for images, labels, skipped in self._batches():
                self._count_skipped(skipped)
                if len(labels) == 0:
                    continue  # every image of this batch was corrupt (--skip-corrupt-images)
                if keep is not None:
                    keep.append(_private_copy(images, labels))
                yield images, labels
                del images, labels  # so that a buffer pool can take the buffer back once the consumer lets go
            finished = True
        finally:
            self.keys.set_epoch(epoch, start=0)
            if not finished:
                self._abandoned()
        if keep is not None:  # only a pass that ran to the end is complete
            self._cached = keep

    def _batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, list[str]]]:
        raise NotImplementedError

    def _abandoned(self) -> None:
        """An epoch left part-way (an error, or the consumer stopped): what the source must undo."""

    def _count_skipped(self, skipped: list[str]) -> None:
        self.skipped_images += len(skipped)
        self.skipped_names += [name for name in skipped if name not in self.skipped_names][
            :max(0, SKIPPED_NAMES_KEPT - len(self.skipped_names))]


class ImageNetBatches(EpochBatches):
    """The batch-source protocol of cnns.data.sources over build_imagenet_loader: len() batches
    per epoch, epoch(e, start_batch) yields (uint8 NHWC, int64) batches, num_samples, num_classes.
    Training uses whole batches on every rank (every rank then runs the same number of steps), and
    with global_batch_size whole global batches (TrainingSampler); evaluation keeps the last partial
    batch, so every image is seen exactly once across ranks.

    The dataset cache (Graphcore's application's default; --no-dataset-cache turns it off): evaluation batches are
    the same at every pass (resize and centre crop are deterministic), so the first complete pass
    keeps them in memory as uint8 and later passes (one per validated checkpoint) decode nothing.
    Training batches are never cached: their crops change every epoch, so they must be decoded
    again; the encoded files themselves are left to the operating system's page cache. The cache
    is used only when the evaluation images fit in CACHE_MEMORY_FRACTION of the machine's memory.
    """

    def __init__(self, records: ImageRecords, train: bool, batch_size: int, image_size: int = 224,
                 workers: int = 4, seed: int = 0, shard: tuple[int, int] = (0, 1), percentage: int = 100,
                 pin_memory: bool = False, cache: bool = False, global_batch_size: int | None = None,
                 skip_corrupt: bool = False, decoder: ImageDecoder | None = None,
                 device_decoding: torch.device | None = None, eval_crop_pct: float = EVAL_CROP_PCT,
                 eval_interpolation: str = EVAL_INTERPOLATION) -> None:
        self.loader, self.num_samples, self.num_classes = build_imagenet_loader(
            records, train, batch_size, image_size, workers, seed, shard,
            drop_last=train, pin_memory=pin_memory, percentage=percentage,
            global_batch_size=global_batch_size if train else None, skip_corrupt=skip_corrupt,
            decoder=decoder, device_decoding=device_decoding, reuse_buffers=True,
            eval_crop_pct=eval_crop_pct, eval_interpolation=eval_interpolation)
        self.keys: BatchKeys = self.loader.sampler
        self.skip_corrupt = skip_corrupt
        self.device_decoding = device_decoding  # the main process decodes each batch there (DeviceBatch)
        self.batch_size = batch_size
        if train and len(self.loader) == 0:
            whole = global_batch_size or batch_size * shard[1]
            raise DataError(f"the training set in {records.where} has {self.num_samples} images, fewer than one global "
                            f"batch of {whole} ({shard[1]} ranks x {whole // shard[1]})")
        self._start_epochs(train, cache, image_size)

    def _batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, list[str]]]:
        batches = iter(self.loader)
        while True:
            try:  # a bad file met in a worker process is raised here as there (one line, as in this one)
                images, labels, skipped = self._finished(handed_back(next(batches)))
            except StopIteration:
                return
            yield images, labels, skipped
            del images, labels  # not held while the next batch is fetched: the pool takes its buffer back

    def _finished(self, batch: tuple | DeviceBatch) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
        """(images, labels, names of the images dropped) from what a worker made; a batch in one of the
        pool's buffers is recorded as lent out until nothing holds it."""
        if isinstance(batch, DeviceBatch):
            return batch.finish(self.device_decoding, self.skip_corrupt)
        images, labels, skipped, number = batch
        pool = self.loader.dataset.pool
        if pool is not None:
            images = pool.receive(images, len(labels), number)
        return images, torch.as_tensor(labels, dtype=torch.int64), skipped
