"""The input pipeline alone: `cnns bench-data` and `train.py --dataset-benchmark`.

Both run the real pipeline (cnns.data.sources.build_sources, the one training uses) with no model
and report images/s. `cnns bench-data` can also time, in the same invocation, the standard
torchvision pipeline on a JPEG tree (ImageFolder + PIL RandomResizedCrop/flip/ToTensor in a
DataLoader with as many workers) and print the ratio, and it can write a synthetic JPEG tree to
measure on (--make-jpeg-tree). What each pipeline hands over differs by design: cnns yields uint8
NHWC batches that the device normalises (8-bit I/O); torchvision yields float32 NCHW batches.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from itertools import count
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch

from cnns.config import BUILTIN_DATA_DIR, NUM_CLASSES, DataConfig, RunConfig
from cnns.errors import ConfigError, DataError

BASELINE_CROP_AREA = (0.05, 1.0)


@dataclass
class Measurement:
    pipeline: str  # "cnns" or "torchvision"
    layout: str  # "tfrecord", "folder", "cifar-10", ...
    transforms: str  # "train" or "eval"
    workers: int
    batch_size: int
    image_size: int
    images: int  # timed images (after the warm-up batches)
    seconds: float
    startup_seconds: float  # to the end of the warm-up batches (worker start-up, first reads)

    @property
    def images_per_second(self) -> float:
        return self.images / self.seconds if self.seconds > 0 else 0.0


# ----------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------


def endless(epoch_batches: Callable[[int], Iterable]) -> Iterator:
    """Batches of epoch 0, 1, 2, ... back to back, as a long training run sees them."""
    for epoch in count():
        yield from epoch_batches(epoch)


def stop(batches: Iterator) -> None:
    """Close the batch generators, dropping the last reference to their DataLoader, whose iterator
    then shuts its workers down: still prefetching, they would take CPU from the next measurement."""
    batches.close()
    gc.collect()  # in case a reference cycle still holds the loader


def time_batches(batches: Iterator, measured: int, warmup: int) -> tuple[int, float, float]:
    """(images, seconds, start-up seconds): `warmup` batches are drawn first and not timed (they pay
    for starting the workers), then `measured` batches are timed."""
    start = time.perf_counter()
    for _ in range(warmup):
        next(batches)
    ready = time.perf_counter()
    images = 0
    for _ in range(measured):
        images += len(next(batches)[1])
    return images, time.perf_counter() - ready, ready - start


# ----------------------------------------------------------------------------------------------
# The two pipelines
# ----------------------------------------------------------------------------------------------


def data_config(data_dir: str, dataset: str | None, workers: int, image_size: int, cache: bool = True) -> DataConfig:
    """The DataConfig training would build for these options (files, no mixing)."""
    return DataConfig(dataset=dataset, data_dir=data_dir, source="files", num_classes=NUM_CLASSES.get(dataset, 10),
                      image_size=image_size, workers=workers, normalise_imagenet=False, host_normalisation=False,
                      percentage=100, cache=cache, mixup_alpha=0.0, cutmix_lambda=1.0, cutmix_version=1)


def data_layout(data_dir: str, dataset: str | None) -> str:
    from cnns.data.imagenet import detect_imagenet
    from cnns.data.sources import resolve_dataset

    found, folder = resolve_dataset(data_config(data_dir, dataset, 0, 224))
    return detect_imagenet(folder) if found == "imagenet" else found


def cnns_batches(cfg: DataConfig, batch_size: int, train: bool, seed: int) -> Iterator:
    """Endless batches from the pipeline training uses."""
    from cnns.data.sources import build_sources

    sources = build_sources(cfg, micro_batch_size=batch_size, eval_batch_size=batch_size, seed=seed,
                            device=torch.device("cpu"), need_train=train, need_eval=not train)
    source = sources.train if train else sources.eval
    return endless(source.epoch)


def baseline_transform(train: bool, image_size: int):
    """The usual torchvision recipe on PIL images (the reference ImageNet training scripts)."""
    from torchvision import transforms as T

    from cnns.data.imagenet import evaluation_resize

    if train:
        return T.Compose([T.RandomResizedCrop(image_size, scale=BASELINE_CROP_AREA), T.RandomHorizontalFlip(),
                          T.ToTensor()])
    return T.Compose([T.Resize(evaluation_resize(image_size)), T.CenterCrop(image_size), T.ToTensor()])


def baseline_batches(data_dir: str, batch_size: int, train: bool, workers: int, image_size: int, seed: int) -> Iterator:
    """Endless batches from torchvision.datasets.ImageFolder + PIL transforms in a DataLoader."""
    from torch.utils.data import DataLoader
    from torchvision.datasets import ImageFolder

    from cnns.data.imagefolder import find_split_folder

    folder = find_split_folder(data_dir, "train" if train else "validation")
    if folder is None:
        raise DataError(f"{data_dir}: no {'train' if train else 'validation'} folder for the torchvision baseline")
    dataset = ImageFolder(str(folder), transform=baseline_transform(train, image_size))
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=train, num_workers=workers, drop_last=train,
                        persistent_workers=workers > 0, generator=torch.Generator().manual_seed(seed))
    return endless(lambda epoch: loader)


# ----------------------------------------------------------------------------------------------
# Runs
# ----------------------------------------------------------------------------------------------


@dataclass
class BenchPlan:
    data_dir: str
    dataset: str | None
    layout: str
    workers: list[int]
    image_size: int
    batch_size: int
    batches: int
    warmup: int
    train: bool
    baseline: bool
    rounds: int
    cache: bool
    seed: int


def measure(plan: BenchPlan, pipeline: str, workers: int) -> Measurement:
    if pipeline == "cnns":
        cfg = data_config(plan.data_dir, plan.dataset, workers, plan.image_size, plan.cache)
        batches = cnns_batches(cfg, plan.batch_size, plan.train, plan.seed)
    else:
        batches = baseline_batches(plan.data_dir, plan.batch_size, plan.train, workers, plan.image_size, plan.seed)
    try:
        images, seconds, startup = time_batches(batches, plan.batches, plan.warmup)
    finally:
        stop(batches)
    return Measurement(pipeline, plan.layout, "train" if plan.train else "eval", workers, plan.batch_size,
                       plan.image_size, images, seconds, startup)


@dataclass
class Comparison:
    """One worker count: the median measurement of each pipeline over the rounds, and the median
    of the per-round ratios cnns / torchvision. The ratio is taken within each round, from two
    measurements made one after the other, so that a change of the machine's load between rounds
    (other jobs on a shared machine) moves both of its terms alike."""

    cnns: Measurement
    baseline: Measurement | None
    ratio: float | None


def run_plan(plan: BenchPlan, report: Callable[[str], None] = print) -> list[Comparison]:
    """Every worker count: both pipelines, `rounds` times, their order alternating between rounds."""
    pipelines = ["cnns"] + (["torchvision"] if plan.baseline else [])
    comparisons = []
    for workers in plan.workers:
        rounds: dict[str, list[Measurement]] = {name: [] for name in pipelines}
        for round_index in range(plan.rounds):
            for name in pipelines if round_index % 2 == 0 else pipelines[::-1]:
                result = measure(plan, name, workers)
                rounds[name].append(result)
                report(f"  {name:<11} workers {workers}: {result.images_per_second:8.1f} images/s "
                       f"({result.images} images in {result.seconds:.2f} s, start-up {result.startup_seconds:.2f} s)")
        comparisons.append(compare_rounds(rounds["cnns"], rounds.get("torchvision")))
    return comparisons


def compare_rounds(ours: list[Measurement], theirs: list[Measurement] | None) -> Comparison:
    def middle(measurements: list[Measurement]) -> Measurement:
        return sorted(measurements, key=lambda m: m.images_per_second)[(len(measurements) - 1) // 2]

    if not theirs:
        return Comparison(middle(ours), None, None)
    ratios = [a.images_per_second / b.images_per_second for a, b in zip(ours, theirs) if b.images_per_second > 0]
    return Comparison(middle(ours), middle(theirs), statistics.median(ratios) if ratios else None)


def results_table(comparisons: list[Comparison]) -> str:
    """A markdown table: one row per pipeline and worker count, with the ratio to torchvision."""
    lines = ["| pipeline | data | transforms | workers | batch | image size | images/s | vs torchvision |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for comparison in comparisons:
        rows = [(comparison.cnns, f"{comparison.ratio:.2f}x" if comparison.ratio else "-")]
        if comparison.baseline is not None:
            rows.append((comparison.baseline, "1.00x"))
        for m, ratio in rows:
            lines.append(f"| {m.pipeline} | {m.layout} | {m.transforms} | {m.workers} | {m.batch_size} "
                         f"| {m.image_size} | {m.images_per_second:.1f} | {ratio} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# cnns bench-data
# ----------------------------------------------------------------------------------------------


@dataclass
class BenchDataRequest:
    """What `cnns bench-data` was asked (the command line's values; `cnns.cli.tools` has their help)."""

    data_dir: str | None = None
    dataset: str | None = None
    make_jpeg_tree: str | None = None
    images: int = 2000
    classes: int = 10
    layout: str = "folder"
    workers: list[int] = field(default_factory=lambda: [2])
    image_size: int = 224
    batch_size: int = 32
    batches: int = 60
    warmup_batches: int = 8
    transforms: str = "train"
    compare_baseline: bool = False
    rounds: int = 1
    cache: bool = False
    seed: int = 0
    json: str | None = None


def plan_from_request(args: BenchDataRequest) -> BenchPlan:
    if args.make_jpeg_tree:
        from cnns.data.jpegtree import make_jpeg_tree

        made = make_jpeg_tree(args.make_jpeg_tree, args.images, classes=args.classes, seed=args.seed,
                              layout=args.layout)
        print(f"Synthetic ImageNet ({args.layout}) in {args.make_jpeg_tree}: {made['train']} training and "
              f"{made['validation']} validation images")
    data_dir = args.make_jpeg_tree or args.data_dir or (BUILTIN_DATA_DIR if args.dataset == "builtin" else None)
    if not data_dir:
        raise ConfigError("bench-data needs --data-dir (or DATA_DIR) or --make-jpeg-tree DIR")
    for name in ("batch_size", "batches", "image_size", "rounds"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup_batches < 0 or min(args.workers) < 0:
        raise ConfigError("--warmup-batches and --workers must not be negative")
    layout = data_layout(data_dir, args.dataset)
    if args.compare_baseline and layout != "folder":
        raise ConfigError(f"--compare-baseline needs a JPEG folder tree (torchvision's ImageFolder); {data_dir} "
                          f"holds {layout}")
    imagenet = layout in ("tfrecord", "folder")
    # CIFAR images are 32x32, and their batches are made in the main process (0 workers).
    image_size, workers = (args.image_size, list(args.workers)) if imagenet else (32, [0])
    return BenchPlan(data_dir=str(data_dir), dataset=args.dataset, layout=layout, workers=workers,
                     image_size=image_size, batch_size=args.batch_size, batches=args.batches,
                     warmup=args.warmup_batches, train=args.transforms == "train", baseline=args.compare_baseline,
                     rounds=args.rounds, cache=args.cache, seed=args.seed)


def comparison_record(comparison: Comparison) -> dict[str, Any]:
    def record(m: Measurement | None) -> dict[str, Any] | None:
        return None if m is None else {**asdict(m), "images_per_second": m.images_per_second}

    return {"cnns": record(comparison.cnns), "torchvision": record(comparison.baseline), "ratio": comparison.ratio}


def bench_data_command(args: BenchDataRequest) -> int:
    plan = plan_from_request(args)
    if plan.layout not in ("tfrecord", "folder"):
        print(f"{plan.layout}: batches are made in the main process from the dataset held in memory (no workers)")
    print(f"Input pipeline on {plan.data_dir} ({plan.layout}, {'train' if plan.train else 'eval'} transforms, "
          f"batch {plan.batch_size}, image size {plan.image_size}, {plan.batches} timed batches after "
          f"{plan.warmup} warm-up, {os.cpu_count()} CPUs):")
    comparisons = run_plan(plan)
    print(results_table(comparisons))
    if args.json:
        Path(args.json).write_text(json.dumps([comparison_record(c) for c in comparisons], indent=2))
    return 0


# ----------------------------------------------------------------------------------------------
# train.py --dataset-benchmark
# ----------------------------------------------------------------------------------------------


def benchmark_batches_for(cfg: RunConfig, batches_per_epoch: int) -> int:
    """--iterations N: N updates' worth of micro-batches; otherwise --epochs worth of them."""
    if cfg.train.iterations:
        return cfg.train.iterations * cfg.train.grad_accum
    return max(1, round(float(cfg.train.epochs or 1) * batches_per_epoch))


def dataset_benchmark(cfg: RunConfig, report: Callable[[str], None] = print) -> dict[str, Any]:
    """The seed's --dataset-benchmark: the training input pipeline alone, as the run would build it
    (generated data included), for the run's length; returns the numbers it prints."""
    from cnns.data.sources import build_sources

    sources = build_sources(cfg.data, micro_batch_size=cfg.train.micro_batch_size,
                            eval_batch_size=cfg.train.micro_batch_size, seed=cfg.train.seed or 0,
                            device=torch.device("cpu"), need_eval=False)
    total = benchmark_batches_for(cfg, len(sources.train))
    warmup = min(total - 1, max(1, total // 10))
    batches = endless(sources.train.epoch)
    try:
        images, seconds, startup = time_batches(batches, total - warmup, warmup)
    finally:
        stop(batches)
    rate = images / seconds if seconds > 0 else 0.0
    uses_workers = sources.dataset == "imagenet" and cfg.data.source == "files"
    where = f"{cfg.data.workers} workers" if uses_workers else "batches made in the main process"
    report(f"Dataset benchmark: {rate:.2f} images/sec ({images} images in {seconds:.3f} s after {warmup} warm-up "
           f"batches taking {startup:.3f} s; {where}, micro-batch {cfg.train.micro_batch_size})")
    return {"images_per_second": rate, "images": images, "seconds": seconds, "startup_seconds": startup,
            "workers": cfg.data.workers}
