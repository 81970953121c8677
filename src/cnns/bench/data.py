"""The input pipeline alone: `cnns bench-data` and `train.py --dataset-benchmark`.

Both run the pipeline training uses (`cnns.data.sources.build_sources`) with no model and report images/s and
images/s per worker core (what says how many cores a GPU's step needs). `cnns bench-data` can time
torchvision's usual loader beside it, alternating round by round, and write a synthetic ImageNet-like JPEG tree
to measure on (--make-jpeg-tree).

On ImageNet files it then prints the account of one image's time (`ImageAccount`): the stages a worker runs
(read, header + crop draw, decode, crop + resize, flip: the worker's own decoding with a `DecodeClock`; with the
native decoder the last three, and for a training crop the header + crop draw too, by its own clocks inside its
one call, with the whole-image decoder the flip is part of the resize) timed in this process and one thread inside one timed step per image, so that
what lies between them is a row of its own; then two costs from the real loader's delivered rate: *into the
batch* (0 workers, per image, less the in-process step) and *across to the main process* (1 worker less 0
workers). Every round measures all of them, in an order reversed every other round, and each row uses the
medians over --rounds, so the machine's drift moves both terms of a difference alike (a difference can still
come out below zero on a shared machine, and is printed as measured). Under `taskset -c N` the main process
shares the worker's core, which makes it one core's account. Beside it: the decode-only cap (the whole image
decoded by TorchCodec and nothing else) and, on a folder tree, torchvision's loader with one worker.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from itertools import count
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Sequence

import torch
from torch.utils.benchmark import Timer
from torch.utils.benchmark.utils.common import set_torch_threads

from cnns.bench.rates import in_turn
from cnns.config import DataConfig, RunConfig
from cnns.data.formats import DATASETS, DataFormat, dataset_facts, find_format, records_in
from cnns.data.decoding import DecodeClock
from cnns.devices import resolve_device
from cnns.errors import ConfigError, DataError
from cnns.parallel.world import usable_cores
from cnns.safe_writes import write_atomically

if TYPE_CHECKING:
    from cnns.data.image_loader import ImageNetTransform
    from cnns.data.image_loader import ImageRecords as ImageDataset

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

    @property
    def per_worker_core(self) -> float:
        """images/s over the worker processes (with none, the main process is the one core)."""
        return self.images_per_second / max(1, self.workers)


# --- Timing


def time_pipeline(epoch_batches: Callable[[int], Iterable], measured: int, warmup: int) -> tuple[int, float, float]:
    """(images, seconds, start-up seconds) of batches drawn epoch after epoch, as a long run draws them:
    `warmup` batches first, not timed (they pay for starting the workers), then `measured` timed. A batch decoded
    on a GPU is waited for: the timing ends when its pixels exist, not when its kernels are queued."""
    def endless() -> Iterator:
        for epoch in count():
            yield from epoch_batches(epoch)

    def wait(batch: tuple) -> None:
        if batch[0].device.type == "cuda":
            torch.cuda.synchronize(batch[0].device)

    batches, images, batch = endless(), 0, None
    try:
        start = time.perf_counter()
        for _ in range(warmup):
            wait(next(batches))
        ready = time.perf_counter()
        for _ in range(measured):
            batch = next(batches)
            images += len(batch[1])
        if batch is not None:
            wait(batch)
        return images, time.perf_counter() - ready, ready - start
    finally:  # the loader's workers, still prefetching, would take CPU from the next measurement
        batches.close()  # drops the last reference to the DataLoader, whose iterator then stops its workers
        gc.collect()  # in case a reference cycle still holds it


# --- The two pipelines


def data_config(data_dir: str, dataset: str | None, workers: int, image_size: int, cache: bool = True,
                decode_device: str = "auto") -> DataConfig:
    """The DataConfig training would build for these options (files, no mixing)."""
    return DataConfig(dataset=dataset, data_dir=data_dir, source="files", num_classes=dataset_facts(dataset).num_classes,
                      image_size=image_size, pipeline_num_parallel=workers, normalise_input=False, hostside_norm=False,
                      dataset_percentage_to_use=100, dataset_cache=cache, mixup_alpha=0.0, cutmix_lambda=1.0,
                      cutmix_version=1, decode_device=decode_device)


def data_format(data_dir: str, dataset: str | None) -> DataFormat:
    return find_format(dataset, data_dir)[0]


def cnns_batches(cfg: DataConfig, batch_size: int, train: bool, seed: int, device: torch.device) -> Callable:
    """An epoch's batches from the pipeline training uses, for a run on `device` (on a GPU the images may be
    decoded there, as --decode-device chooses)."""
    from cnns.data.sources import build_sources

    sources = build_sources(cfg, micro_batch_size=batch_size, eval_batch_size=batch_size, seed=seed,
                            device=device, need_train=train, need_eval=not train)
    return (sources.train if train else sources.eval).epoch


def baseline_transform(train: bool, image_size: int):
    """The usual torchvision recipe on PIL images (the reference ImageNet training scripts), handing over
    uint8 (PILToTensor, not ToTensor's float32) as cnns does, so neither side pays for a conversion the
    other skips."""
    from torchvision import transforms as T

    from cnns.data.image_loader import evaluation_resize

    if train:
        return T.Compose([T.RandomResizedCrop(image_size, scale=BASELINE_CROP_AREA), T.RandomHorizontalFlip(),
                          T.PILToTensor()])
    return T.Compose([T.Resize(evaluation_resize(image_size)), T.CenterCrop(image_size), T.PILToTensor()])


def baseline_batches(data_dir: str, batch_size: int, train: bool, workers: int, image_size: int, seed: int) -> Callable:
    """An epoch's batches from torchvision.datasets.ImageFolder + PIL transforms in a DataLoader."""
    from torch.utils.data import DataLoader
    from torchvision.datasets import ImageFolder

    from cnns.data.imagefolder import find_split_folder

    folder = find_split_folder(data_dir, "train" if train else "validation")
    if folder is None:
        raise DataError(f"{data_dir}: no {'train' if train else 'validation'} folder for the torchvision baseline")
    dataset = ImageFolder(str(folder), transform=baseline_transform(train, image_size))
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=train, num_workers=workers, drop_last=train,
                        persistent_workers=workers > 0, generator=torch.Generator().manual_seed(seed))
    return lambda epoch: loader


# --- Runs


def measure(plan: BenchDataRequest, pipeline: str, workers: int) -> Measurement:
    if pipeline == "cnns":
        cfg = data_config(plan.data_dir, plan.dataset, workers, plan.image_size, plan.cache, plan.decode_device)
        batches = cnns_batches(cfg, plan.batch_size, plan.train, plan.seed, torch.device(plan.device))
    else:
        batches = baseline_batches(plan.data_dir, plan.batch_size, plan.train, workers, plan.image_size, plan.seed)
    images, seconds, startup = time_pipeline(batches, plan.batches, plan.warmup_batches)
    return Measurement(pipeline, plan.found, "train" if plan.train else "eval", workers, plan.batch_size,
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


def in_rounds(steps: dict[Any, Callable[[], Any]], rounds: int, report: Callable[[str], None]) -> dict[Any, list]:
    """What each step measured in each of `rounds` rounds: every round runs them all, in an order reversed every
    other round (`in_turn`), so that the ratios and differences between them are taken close together."""
    found: dict[Any, list] = {key: [] for key in steps}
    for round_index in range(rounds):
        for key in in_turn(list(steps), round_index):
            found[key].append(steps[key]())
            report(progress_line(found[key][-1]))
    return found


def loader(plan: BenchDataRequest, pipeline: str, workers: int) -> Callable[[], Measurement]:
    return lambda: measure(plan, pipeline, workers)


def run_plan(plan: BenchDataRequest, report: Callable[[str], None] = print) -> list[Comparison]:
    """Every worker count and both pipelines, `rounds` times (`in_rounds`)."""
    pipelines = ["cnns"] + (["torchvision"] if plan.compare_baseline else [])
    found = in_rounds({(workers, name): loader(plan, name, workers) for workers in plan.workers for name in pipelines},
                      plan.rounds, report)
    return [compare_rounds(found[workers, "cnns"], found.get((workers, "torchvision"))) for workers in plan.workers]


def scaling_lines(comparisons: list[Comparison]) -> list[str]:
    """cnns with N workers against one worker, for each N > 1 measured beside 1."""
    one = next((c.cnns for c in comparisons if c.cnns.workers == 1), None)
    if one is None or one.images_per_second <= 0:
        return []
    return [f"cnns with {c.cnns.workers} workers: {c.cnns.images_per_second / one.images_per_second:.2f}x one worker"
            for c in comparisons if c.cnns.workers > 1]


def middle(values: list, key: Callable = lambda m: m.images_per_second):
    """The median (the lower of the middle two; by images/s for measurements)."""
    return sorted(values, key=key)[(len(values) - 1) // 2]


def progress_line(found) -> str:
    """One printed line per measurement, as it is made."""
    if isinstance(found, StageTimes):
        rate = 1e9 * found.images / found.step
        return f"  in one process, stage by stage: {rate:8.1f} images/s ({found.images} images)"
    if isinstance(found, float):  # seconds per image, decoding whole images
        return f"  decode-only (whole image): {1 / found:8.1f} images/s"
    return (f"  {found.pipeline:<11} workers {found.workers}: {found.images_per_second:8.1f} images/s ({found.images} "
            f"images in {found.seconds:.2f} s, start-up {found.startup_seconds:.2f} s)")


def compare_rounds(ours: list[Measurement], theirs: list[Measurement] | None) -> Comparison:
    if not theirs:
        return Comparison(middle(ours), None, None)
    ratios = [a.images_per_second / b.images_per_second for a, b in zip(ours, theirs) if b.images_per_second > 0]
    return Comparison(middle(ours), middle(theirs), statistics.median(ratios) if ratios else None)


def results_table(comparisons: list[Comparison]) -> str:
    """A markdown table: one row per pipeline and worker count, with the ratio to torchvision."""
    lines = ["| pipeline | data | transforms | workers | batch | image size | images/s | per worker core "
             "| vs torchvision |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for comparison in comparisons:
        rows = [(comparison.cnns, f"{comparison.ratio:.2f}x" if comparison.ratio else "-")]
        if comparison.baseline is not None:
            rows.append((comparison.baseline, "1.00x"))
        for m, ratio in rows:
            lines.append(f"| {m.pipeline} | {m.layout} | {m.transforms} | {m.workers} | {m.batch_size} "
                         f"| {m.image_size} | {m.images_per_second:.1f} | {m.per_worker_core:.1f} | {ratio} |")
    return "\n".join(lines)


# --- The account of one image

STAGES = ("read", "header", "decode", "resize", "flip")
STAGE_LABELS = {"header": "header + crop draw", "decode": "decode", "resize": "crop + resize", "flip": "flip"}
WARMUP_IMAGES = 8  # timed for nothing first: imports, first allocations


@dataclass
class StageTimes(DecodeClock):
    """Nanoseconds summed over `images` images in one process and one thread: the read, the decoder's stages
    (`DecodeClock`: header + crop draw, decode, crop + resize, flip; `whole` images decoded whole by the
    fallback decoder, the rest their region natively), and the whole per-image step timed around them (so
    `step` is at least the stages' sum; the rest is `between`)."""

    images: int = 0
    read: int = 0
    step: int = 0

    @property
    def stages(self) -> int:
        return sum(getattr(self, stage) for stage in STAGES)

    @property
    def between(self) -> int:
        return self.step - self.stages

    def seconds_per_image(self, nanoseconds: int) -> float:
        return nanoseconds / max(1, self.images) / 1e9


def account_indices(size: int, count: int) -> list[int]:
    """`count` indices spread evenly over the split (a folder tree is sorted by class: every class is seen)."""
    count = max(1, min(size, count))
    return [index * size // count for index in range(count)]


def time_stages(dataset: ImageDataset, indices: Sequence[int], transform: ImageNetTransform) -> StageTimes:
    """StageTimes over `indices` (epoch 0's crops), one image at a time into a batch slot as a worker does, by
    the worker's own decoding (`ImageNetTransform.into`, its stages on a `DecodeClock`)."""
    # A numpy row, as the worker's batch loop gives the decoder (ImageBatchDataset._decode_into_rows).
    slot = torch.empty((transform.image_size, transform.image_size, 3), dtype=torch.uint8).numpy()
    times = StageTimes()

    def step(index: int, clock: StageTimes | None) -> int:
        """The image's read nanoseconds; its decoder's stages go to `clock`."""
        start = time.perf_counter_ns()
        data, _, source = dataset.read(index)
        read = time.perf_counter_ns() - start
        transform.into(data, source, (index, 0) if transform.train else index, slot, clock)
        return read

    with set_torch_threads(1):  # as in a DataLoader worker
        for index in indices[:WARMUP_IMAGES]:
            step(index, None)
        for index in indices:
            start = time.perf_counter_ns()
            times.read += step(index, times)
            times.step += time.perf_counter_ns() - start
            times.images += 1
    return times


DECODE_ONLY_DECODER = "TorchCodec, libjpeg-turbo"


def time_whole_decoding(dataset: ImageDataset, indices: Sequence[int]) -> float:
    """Seconds per image: the whole image decoded to RGB and nothing else, from bytes already in memory, on one
    thread (as in a worker), by TorchCodec's decoder (libjpeg-turbo for JPEG); torch.utils.benchmark.Timer."""
    from torchcodec.decoders import decode_image

    encoded = [torch.frombuffer(bytearray(dataset.read(index)[0]), dtype=torch.uint8) for index in indices]
    timer = Timer("for data in encoded: decode_image(data, mode='RGB')", num_threads=1,
                  globals={"encoded": encoded, "decode_image": decode_image})
    return timer.timeit(1).mean / len(encoded)


@dataclass
class ImageAccount:
    """Where one image's time goes (the module's docstring says how each row is measured)."""

    layout: str
    transforms: str
    image_size: int
    decoder: str
    stages: StageTimes
    no_workers: Measurement  # the loader with 0 workers: batches made in this process
    one_worker: Measurement  # the loader with 1 worker
    decode_only_seconds: float  # per image: the whole image decoded, nothing else
    decode_only_decoder: str
    baseline: Measurement | None  # torchvision's loader with 1 worker
    cores: int  # the CPUs this process may run on (taskset)
    reads: str = ""  # what one image's read is (`DataFormat.reads`)

    @property
    def in_process_seconds(self) -> float:
        return self.stages.seconds_per_image(self.stages.step)

    @property
    def delivered_seconds(self) -> float:
        return 1 / self.one_worker.images_per_second

    def stage_seconds(self) -> dict[str, float]:
        """Seconds per image of each row that adds up to the delivered time, in the worker's order."""
        per_image, no_workers = self.stages.seconds_per_image, 1 / self.no_workers.images_per_second
        return {**{stage: per_image(getattr(self.stages, stage)) for stage in STAGES},
                "between": per_image(self.stages.between), "into the batch": no_workers - self.in_process_seconds,
                "across": self.delivered_seconds - no_workers}


def measure_account(plan: BenchDataRequest, images: int, baseline: Measurement | None) -> ImageAccount:
    """The account on the plan's files, every measurement of it in each round (`in_rounds`). `baseline` is
    torchvision's loader with 1 worker when the comparison measured it; on a folder tree it is measured in the
    account's rounds otherwise."""
    from cnns.data.image_loader import ImageNetTransform

    dataset = records_in(plan.data_dir, "train" if plan.train else "validation")
    indices = account_indices(len(dataset), images)
    transform = ImageNetTransform(plan.train, plan.image_size, plan.seed)
    steps = {"stages": lambda: time_stages(dataset, indices, transform),
             "decode-only": lambda: time_whole_decoding(dataset, indices),
             "cnns 0": loader(plan, "cnns", 0), "cnns 1": loader(plan, "cnns", 1)}
    if baseline is None and plan.image_folder:
        steps["torchvision 1"] = loader(plan, "torchvision", 1)
    found = in_rounds(steps, plan.rounds, print)
    if "torchvision 1" in found:
        baseline = middle(found["torchvision 1"])
    return ImageAccount(plan.found, "train" if plan.train else "eval", plan.image_size, transform.decoder.name,
                        middle(found["stages"], key=lambda times: times.step), middle(found["cnns 0"]),
                        middle(found["cnns 1"]), middle(found["decode-only"], key=float), DECODE_ONLY_DECODER,
                        baseline, usable_cores(), plan.reads)


def decode_label(stages: StageTimes) -> str:
    if stages.whole == 0:
        return "decode (the crop's region, native)"
    if stages.whole == stages.images:
        return "decode (the whole image, TorchCodec)"
    return f"decode (region, native; {stages.whole} of {stages.images} images whole, TorchCodec)"


def account_table(account: ImageAccount) -> str:
    """The account as a markdown table: the rows that add up to the delivered time with their shares of
    it, then the totals, the decode-only cap and torchvision's loader with their rates on one core."""
    delivered = account.delivered_seconds
    labels = {"read": f"read ({account.reads})" if account.reads else "read", **STAGE_LABELS, "decode": decode_label(account.stages),
              "between": "between the stages (the loop, the calls)",
              "into the batch": "into the batch (0 workers - in one process)",
              "across": "across to the main process (1 worker - 0 workers)"}
    if account.stages.whole == account.stages.images:
        labels["flip"] = "flip (inside crop + resize: the whole-image decoder)"
    lines = ["| one image | ms | share | images/s per core |", "|---|---:|---:|---:|"]
    for key, seconds in account.stage_seconds().items():
        if key == "flip" and account.transforms == "eval":
            lines.append(f"| {labels[key]} | - | - | |")
            continue
        share = f"{100 * seconds / delivered:.1f} %" if delivered > 0 else ""
        lines.append(f"| {labels[key]} | {1e3 * seconds:.3f} | {share} | |")
    totals = [("in one process (read to flip)", account.in_process_seconds),
              ("the loader, 0 workers (batches made in this process)", 1 / account.no_workers.images_per_second),
              ("**the loader, 1 worker: delivered**", delivered),
              (f"decode-only cap: the whole image, nothing else ({account.decode_only_decoder})",
               account.decode_only_seconds)]
    if account.baseline is not None:
        totals.append(("torchvision ImageFolder + PIL loader, 1 worker", 1 / account.baseline.images_per_second))
    for label, seconds in totals:
        lines.append(f"| {label} | {1e3 * seconds:.3f} | | {1 / seconds:.0f} |")
    return "\n".join(lines)


def account_summary(account: ImageAccount) -> str:
    """One line: the per-core rate, against the decode-only cap and torchvision's loader."""
    rate = account.one_worker.images_per_second
    parts = [f"cnns {rate:.0f} images/s per worker core",
             f"{rate * account.decode_only_seconds:.2f}x the decode-only cap"]
    if account.baseline is not None:
        parts.append(f"{rate / account.baseline.images_per_second:.2f}x torchvision's loader")
    where = "one core" if account.cores == 1 else f"{account.cores} cores: the main process on its own core"
    return "; ".join(parts) + f" ({where}). Decoder: {account.decoder}"


# --- cnns bench-data


@dataclass
class BenchDataRequest:
    """What `cnns bench-data` was asked (the command line's values; `cnns.cli.measure` has their help)."""

    data_dir: str | None = None
    dataset: str | None = None
    make_jpeg_tree: str | None = None
    images: int = 2000
    classes: int = 10
    layout: str = "folder"
    workers: list[int] = field(default_factory=lambda: [1])
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
    device: str = "cpu"
    decode_device: str = "auto"
    account: bool = True
    account_images: int = 400
    found: str = ""  # the data's format, once found (tfrecord, folder, cifar-10, ...: `cnns.data.formats`)
    decoded_in_workers: bool = False  # its images decoded by worker processes (else batches made in memory)
    reads: str = ""  # what one image's read is, in the account
    image_folder: bool = False  # torchvision's ImageFolder reads it (the baseline)

    @property
    def train(self) -> bool:
        return self.transforms == "train"


def plan_from_request(args: BenchDataRequest) -> BenchDataRequest:
    """The request with its data found and checked."""
    if args.make_jpeg_tree:
        from cnns.data.jpegtree import make_jpeg_tree

        made = make_jpeg_tree(args.make_jpeg_tree, args.images, classes=args.classes, seed=args.seed,
                              layout=args.layout)
        print(f"Synthetic ImageNet ({args.layout}) in {args.make_jpeg_tree}: {made['train']} training and "
              f"{made['validation']} validation images")
    data_dir = args.make_jpeg_tree or args.data_dir or (DATASETS[args.dataset].default_data_dir if args.dataset else None)
    if not data_dir:
        raise ConfigError("bench-data needs --data-dir (or DATA_DIR) or --make-jpeg-tree DIR")
    device = resolve_device(args.device)
    found = data_format(data_dir, args.dataset)
    if args.compare_baseline and not found.image_folder:
        raise ConfigError(f"--compare-baseline needs a JPEG folder tree (torchvision's ImageFolder); {data_dir} "
                          f"holds {found.name}")
    # CIFAR-sized images are 32x32, and their batches are made in the main process (0 workers).
    image_size, workers = ((32, [0]) if found.dataset.cifar_sized else (args.image_size, list(args.workers)))
    return replace(args, data_dir=str(data_dir), found=found.name, decoded_in_workers=found.decoded_in_workers,
                   reads=found.reads, image_folder=found.image_folder, workers=workers, image_size=image_size,
                   device=str(device))


def comparison_record(comparison: Comparison) -> dict[str, Any]:
    def record(m: Measurement | None) -> dict[str, Any] | None:
        return None if m is None else {**asdict(m), "images_per_second": m.images_per_second}

    return {"cnns": record(comparison.cnns), "torchvision": record(comparison.baseline), "ratio": comparison.ratio}


def account_record(account: ImageAccount) -> dict[str, Any]:
    return {"decoder": account.decoder, "layout": account.layout, "transforms": account.transforms,
            "images": account.stages.images, "cores": account.cores,
            "seconds_per_image": account.stage_seconds(), "in_process_seconds": account.in_process_seconds,
            "stage_nanoseconds": asdict(account.stages), "delivered_seconds": account.delivered_seconds,
            "decode_only_seconds": account.decode_only_seconds, "decode_only_decoder": account.decode_only_decoder,
            "no_workers_images_per_second": account.no_workers.images_per_second,
            "one_worker_images_per_second": account.one_worker.images_per_second,
            "baseline_images_per_second": account.baseline.images_per_second if account.baseline else None}


def one_worker_baseline(comparisons: list[Comparison]) -> Measurement | None:
    """torchvision's loader with one worker, when the comparison measured it."""
    return next((c.baseline for c in comparisons if c.cnns.workers == 1), None)


def bench_data_command(args: BenchDataRequest) -> int:
    from cnns.data.decoding import ImageDecoder, choose_decode_device, decoding_header

    plan = plan_from_request(args)
    if not plan.decoded_in_workers:
        print(f"{plan.found}: batches are made in the main process from the dataset held in memory (no workers)")
    cores = usable_cores()
    print(f"Input pipeline on {plan.data_dir} ({plan.found}, {'train' if plan.train else 'eval'} transforms, "
          f"batch {plan.batch_size}, image size {plan.image_size}, {plan.batches} timed batches after "
          f"{plan.warmup_batches} warm-up, {cores} of {os.cpu_count()} CPUs):")
    on_the_device = False
    if plan.decoded_in_workers:
        choice = choose_decode_device(plan.decode_device, torch.device(plan.device))
        on_the_device = choice.device != "cpu"
        print(decoding_header(choice, ImageDecoder(), torch.device(plan.device)))
    comparisons = run_plan(plan)
    print(results_table(comparisons))
    for line in scaling_lines(comparisons):
        print(line)
    records: dict[str, Any] = {"comparisons": [comparison_record(c) for c in comparisons]}
    if on_the_device and args.account:
        where = "by DALI" if choice.device == "dali" else "on the GPU"
        print(f"No account of one image: it times the workers' decoding, and these images are decoded {where}")
    elif args.account and plan.decoded_in_workers:
        print(f"The account of one image ({args.account_images} images timed stage by stage in this "
              f"process, the loader with 0 and 1 worker, {plan.rounds} rounds):")
        account = measure_account(plan, args.account_images, one_worker_baseline(comparisons))
        print(account_table(account))
        print(account_summary(account))
        records["account"] = account_record(account)
    if args.json:
        write_atomically(args.json, json.dumps(records, indent=2))
    return 0


# --- train.py --dataset-benchmark


def benchmark_batches_for(cfg: RunConfig, batches_per_epoch: int) -> int:
    """--iterations N: N updates' worth of micro-batches; otherwise --epochs worth of them."""
    if cfg.train.iterations:
        return cfg.train.iterations * cfg.train.gradient_accumulation_count
    return max(1, round(float(cfg.train.epochs or 1) * batches_per_epoch))


def dataset_benchmark(cfg: RunConfig, report: Callable[[str], None] = print) -> None:
    """Graphcore's --dataset-benchmark: the training input pipeline alone, as the run would build it
    (generated data included), for the run's length."""
    from cnns.data.sources import build_sources

    sources = build_sources(cfg.data, micro_batch_size=cfg.train.micro_batch_size,
                            eval_batch_size=cfg.train.micro_batch_size, seed=cfg.train.seed or 0,
                            device=resolve_device(cfg.device), need_eval=False)
    total = benchmark_batches_for(cfg, len(sources.train))
    warmup = min(total - 1, max(1, total // 10))
    images, seconds, startup = time_pipeline(sources.train.epoch, total - warmup, warmup)
    rate = images / seconds if seconds > 0 else 0.0
    uses_workers = sources.decoded_in_workers and cfg.data.pipeline_num_parallel > 0
    per_core = rate / cfg.data.pipeline_num_parallel if uses_workers else rate
    workers = f"{cfg.data.pipeline_num_parallel} worker{'s' if cfg.data.pipeline_num_parallel > 1 else ''}"
    where = (f"{workers}: {per_core:.2f} images/sec per worker core" if uses_workers
             else "batches made in the main process")
    if sources.decoding:
        report(sources.decoding)
    report(f"Dataset benchmark: {rate:.2f} images/sec ({images} images in {seconds:.3f} s after {warmup} warm-up "
           f"batches taking {startup:.3f} s; {where}, micro-batch {cfg.train.micro_batch_size})")
