"""From a DataConfig to batch sources for training and evaluation.

Every source yields (uint8 NHWC images, int64 labels) batches through the same small protocol:
``len(source)`` batches per epoch, ``source.epoch(e, start_batch)`` and ``source.num_samples``. The
device side (`cnns.engine.feed`) moves them to the device and normalises them there, which is
Graphcore's application's 8-bit I/O: a quarter of the bytes of float32 cross to the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Protocol

import torch

from cnns.config import NUM_CLASSES, DataConfig
from cnns.errors import DataError

# Graphcore's application's dataset sizes, used to define an "epoch" of generated or synthetic data.
NOMINAL_TRAIN_IMAGES = {"imagenet": 1281167, "cifar-10": 50000, "cifar-100": 50000, "builtin": 5000}
NOMINAL_EVAL_IMAGES = {"imagenet": 50000, "cifar-10": 10000, "cifar-100": 10000, "builtin": 1000}


class BatchSource(Protocol):
    num_samples: int

    def __len__(self) -> int: ...

    def epoch(self, epoch: int, start_batch: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]: ...


class SyntheticBatches:
    """One random batch made once on the device and yielded forever: no host input pipeline at all.

    An epoch has as many batches as a real source of `num_samples` samples would have on this shard
    (cnns.data.batches.ShardPlan), so the run's epochs count the same as with real data."""

    def __init__(self, batch_size: int, image_size: int, num_classes: int, num_samples: int,
                 device: torch.device, seed: int, *, shard: tuple[int, int] = (0, 1),
                 global_batch_size: int | None = None):
        from cnns.data.batches import ShardPlan

        plan = ShardPlan(num_samples, batch_size, shard[0], shard[1], True, global_batch_size)
        generator = torch.Generator().manual_seed(seed)
        images = torch.randint(0, 256, (batch_size, image_size, image_size, 3), dtype=torch.uint8, generator=generator)
        labels = torch.randint(0, num_classes, (batch_size,), generator=generator)
        self.batch = (images.to(device), labels.to(device))
        self.batch[0]._cnns_resident = True  # tells the device feed to normalise it once, not every step
        self.batches_per_epoch = max(1, len(plan))
        self.num_samples = num_samples

    def __len__(self) -> int:
        return self.batches_per_epoch

    def epoch(self, epoch: int, start_batch: int = 0):
        for _ in range(start_batch, self.batches_per_epoch):
            yield self.batch


@dataclass
class DataSources:
    dataset: str
    num_classes: int  # the model's outputs (cfg.num_classes): every label lies below it
    train: BatchSource
    eval: BatchSource | None
    decoding: str | None = None  # how ImageNet's files are decoded, a line for the run's header


def resolve_dataset(cfg: DataConfig) -> tuple[str, Path | None]:
    """The dataset name and the folder its files are in, checked against the folder's contents."""
    if cfg.source != "files":
        return cfg.dataset, None
    from cnns.data.cifar import detect_cifar

    folder = Path(cfg.data_dir)
    if cfg.dataset == "builtin":
        from cnns.data.builtin import ensure_builtin_dataset

        return "builtin", ensure_builtin_dataset(folder)
    if not folder.is_dir():
        raise DataError(f"data folder not found: {folder}")
    if cfg.dataset in (None, "cifar-10", "cifar-100"):
        found = detect_cifar(folder)
        if found is not None and cfg.dataset in (None, found):
            return found, folder
        if cfg.dataset is not None:
            raise DataError(f"no {cfg.dataset} binary files found in {folder}")
    if cfg.dataset in (None, "imagenet"):
        from cnns.data.imagenet import detect_imagenet

        if detect_imagenet(folder) is not None:
            return "imagenet", folder
        if cfg.dataset == "imagenet":
            raise DataError(f"no ImageNet TFRecords (train-*-of-*) or JPEG folders (train/<class>/) found in {folder}")
    raise DataError(f"cannot infer the dataset in {folder}; name it with --dataset")


def classes_in_data(cfg: DataConfig) -> tuple[int, Path] | None:
    """(the number of classes the data's labels can take, its folder); None for generated data. A folder
    tree's validation classes must be its training ones (DataError naming the difference)."""
    dataset, folder = resolve_dataset(cfg)
    if folder is None:
        return None
    if dataset == "imagenet":
        from cnns.data.imagenet import check_same_classes, folder_tree_classes

        check_same_classes(folder)
        found = folder_tree_classes(folder)
        if found is not None:
            return len(found[0]), folder
    return NUM_CLASSES[dataset], folder  # CIFAR's 10 or 100, TFRecords' ImageNet labels


def build_sources(cfg: DataConfig, *, micro_batch_size: int, eval_batch_size: int, seed: int,
                  device: torch.device, shard: tuple[int, int] = (0, 1), need_eval: bool = True,
                  need_train: bool = True, global_batch_size: int | None = None) -> DataSources:
    """The run's training and evaluation sources for shard (replica rank, replicas).

    global_batch_size (micro-batch x accumulation x replicas, a multiple of micro_batch_size x
    replicas) makes every training epoch a whole number of global batches, the same samples for
    any split of the global batch into replicas x accumulation (cnns.data.batches.ShardPlan);
    None keeps whole micro-batch groups only. Evaluation ignores it: every image exactly once
    over all the ranks, with any batch size."""
    dataset, folder = resolve_dataset(cfg)
    num_classes = cfg.num_classes  # generated labels: the model's classes
    if cfg.source == "synthetic":
        train = SyntheticBatches(micro_batch_size, cfg.image_size, num_classes, NOMINAL_TRAIN_IMAGES[dataset],
                                 device, seed, shard=shard, global_batch_size=global_batch_size)
        evaluation = SyntheticBatches(eval_batch_size, cfg.image_size, num_classes, NOMINAL_EVAL_IMAGES[dataset],
                                      device, seed + 1, shard=shard)
        return DataSources(dataset, num_classes, train, evaluation)
    if cfg.source == "generated":
        from cnns.data.batches import GeneratedBatches

        train = GeneratedBatches(micro_batch_size, cfg.image_size, num_classes,
                                 num_samples=NOMINAL_TRAIN_IMAGES[dataset], seed=seed, shard=shard,
                                 global_batch_size=global_batch_size)
        evaluation = GeneratedBatches(eval_batch_size, cfg.image_size, num_classes,
                                      num_samples=NOMINAL_EVAL_IMAGES[dataset], seed=seed + 1, drop_last=False,
                                      shard=shard)
        return DataSources(dataset, num_classes, train, evaluation)
    if dataset == "imagenet":
        return _imagenet_sources(cfg, folder, micro_batch_size, eval_batch_size, seed, shard, need_eval, need_train,
                                 global_batch_size, device)
    return _cifar_sources(cfg, dataset, folder, micro_batch_size, eval_batch_size, seed, shard, need_eval, need_train,
                          global_batch_size)


def _cifar_sources(cfg, dataset, folder, micro_batch_size, eval_batch_size, seed, shard, need_eval, need_train,
                   global_batch_size):
    from cnns.data.augment import cifar_augment
    from cnns.data.batches import TensorBatches
    from cnns.data.cifar import load_cifar

    file_format = "cifar-10" if dataset == "builtin" else dataset
    train = evaluation = None
    if need_train:
        images, labels = load_cifar(folder, file_format, train=True, size_limit=cfg.max_file_size)
        if cfg.dataset_percentage_to_use < 100:
            keep = max(1, len(labels) * cfg.dataset_percentage_to_use // 100)
            images, labels = images[:keep], labels[:keep]
        whole = global_batch_size or micro_batch_size * shard[1]
        if len(labels) < whole:
            raise DataError(f"the training set in {folder} has {len(labels)} images, fewer than one batch "
                            f"of {whole}")
        train = TensorBatches(images, labels, micro_batch_size, shuffle=True, drop_last=True, seed=seed,
                              augment=cifar_augment(4), shard=shard, global_batch_size=global_batch_size)
    if need_eval:
        images, labels = load_cifar(folder, file_format, train=False, size_limit=cfg.max_file_size)
        evaluation = TensorBatches(images, labels, eval_batch_size, shuffle=False, drop_last=False, seed=seed,
                                   shard=shard)
    return DataSources(dataset, cfg.num_classes, train, evaluation)


def _imagenet_sources(cfg, folder, micro_batch_size, eval_batch_size, seed, shard, need_eval, need_train,
                      global_batch_size, device: torch.device):
    """Pinned host memory only for a run on a GPU: pinning costs host memory and time for nothing on a CPU.
    The decoder and where it runs (--decode-device) are chosen once, for both splits."""
    from cnns.data.decoding import ImageDecoder, choose_decode_device, decoding_header
    from cnns.data.imagenet import ImageNetBatches

    choice = choose_decode_device(cfg.decode_device, device)
    decoder = ImageDecoder()
    common = dict(image_size=cfg.image_size, workers=cfg.pipeline_num_parallel, seed=seed, shard=shard,
                  skip_corrupt=cfg.skip_corrupt_images, size_limit=cfg.max_file_size, pin_memory=device.type == "cuda",
                  decoder=decoder, device_decoding=device if choice.device == "cuda" else None)
    train = evaluation = None
    if need_train:
        train = ImageNetBatches(folder, train=True, batch_size=micro_batch_size,
                                percentage=cfg.dataset_percentage_to_use,
                                global_batch_size=global_batch_size, **common)
    if need_eval:
        evaluation = ImageNetBatches(folder, train=False, batch_size=eval_batch_size, cache=cfg.dataset_cache, **common)
    return DataSources("imagenet", cfg.num_classes, train, evaluation, decoding_header(choice, decoder, device))
