"""The checks every command makes before it writes anything or starts a process, and the notices that say
what a run's parallel options mean here. A command that fails one leaves no run folder behind."""

from __future__ import annotations

import os
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from cnns.config import RunConfig
from cnns.devices import default_device_name
from cnns.errors import ConfigError, DataError


def check_supported(cfg: RunConfig, trains: bool = True) -> None:
    """Combinations that cannot run, found before any worker starts: one clear line each. Worker processes this one
    would start must fit in the machine's memory (estimated for a command that `trains` or only evaluates)."""
    from cnns.parallel.launch import check_machine_holds_workers

    p = cfg.parallel
    if p.shards > 1 or (p.pipeline and p.splits and p.recomputation):  # stages, or recomputation points
        check_pipeline_splits(cfg)
    if p.shards > 1 and cfg.train.compile:
        raise ConfigError("--compile with pipeline stages (--shards > 1) is not supported yet; "
                          "leave out --compile: pipeline stages run eagerly")
    if p.bn_span > 1 and p.replicas == 1:
        raise ConfigError(f"--BN-span {p.bn_span} spans replicas: give --replicas (a multiple of it)")
    check_machine_holds_workers(cfg, trains)


def check_pipeline_splits(cfg: RunConfig) -> None:
    """--pipeline-splits name the cuts of --shards stages (`cnns.models.splits.stage_cuts`, the rule the stages
    apply), or `auto` for more than one stage."""
    from cnns.models import ModelError, build_model
    from cnns.models.splits import stage_cuts

    splits, shards = list(cfg.parallel.splits or ()), cfg.parallel.shards
    if splits == ["auto"]:
        if shards < 2:
            raise ConfigError("--pipeline-splits auto chooses where to cut stages: it needs --shards 2 or more")
        return
    try:
        stage_cuts(cfg.model, build_model(cfg.model), splits, shards)
    except ModelError as error:
        raise ConfigError(str(error)) from None


def wants_split_names(cfg: RunConfig) -> bool:
    """train.py --pipeline-splits with no names, or --shards without them: print the names it takes."""
    p = cfg.parallel
    return p.splits == () or (p.shards > 1 and not p.splits)


def print_split_points(cfg: RunConfig) -> int:
    from cnns.models import build_model, describe_split_points, split_points

    points = split_points(cfg.model, build_model(cfg.model))
    print(f"--pipeline-splits needs {max(1, cfg.parallel.shards - 1)} of these split names for "
          f"{cfg.model.arch}-{cfg.model.size} (aliases in brackets):")
    print(describe_split_points(points))
    return 0


def check_data_before_writing(cfg: RunConfig, *, train: bool = True, evaluation: bool | None = None) -> None:
    """Every data error that can be found cheaply, before a run folder is created, so that a bad command
    leaves nothing behind: missing data, more classes than the model has outputs, and for the splits the
    command reads (`train`; `evaluation`, by default when the run validates) that their files are there and
    readable, that one (global) batch fits in the training set and that the first image decodes.

    Cheap means a start-up on the whole of ImageNet stays quick: the first record of each TFRecord shard,
    class folders listed only until one batch's worth of images is found, one image decoded per split.
    A bad record or image further in is still found when training meets it."""
    from cnns.data.sources import classes_in_data, resolve_dataset

    found = classes_in_data(cfg.data)
    if found is not None and found[0] > cfg.model.num_classes:
        raise ConfigError(f"the data in {found[1]} has {found[0]} classes, more than the model's "
                          f"{cfg.model.num_classes} outputs (--num-classes {cfg.model.num_classes})")
    dataset, folder = resolve_dataset(cfg.data)
    if folder is None:  # generated or synthetic data
        return
    evaluation = cfg.train.validation if evaluation is None else evaluation
    splits = [split for split, wanted in (("train", train), ("validation", evaluation)) if wanted]
    batch = TrainingBatch.of(cfg)
    if dataset == "imagenet":
        check_imagenet_files(folder, splits, batch, decode=not cfg.data.skip_corrupt, size_limit=cfg.data.max_file_size)
    else:
        check_cifar_files(folder, "cifar-10" if dataset == "builtin" else dataset, splits, batch,
                          size_limit=cfg.data.max_file_size)


@dataclass(frozen=True)
class TrainingBatch:
    """What one training update takes from the training set: the global batch, after --dataset-percentage-to-use
    has kept its share of the images."""

    size: int
    description: str  # how the size is made up, for the error message
    percentage: int

    @classmethod
    def of(cls, cfg: RunConfig) -> "TrainingBatch":
        t, replicas = cfg.train, cfg.parallel.replicas
        parts = [f"micro-batch {t.micro_batch_size}"]
        if t.grad_accum > 1:
            parts.append(f"accumulation {t.grad_accum}")
        if replicas > 1:
            parts.append(f"replicas {replicas}")
        description = (f"one batch of {t.global_batch_size}" if len(parts) == 1 else
                       f"one global batch of {t.global_batch_size} ({' x '.join(parts)})")
        return cls(t.global_batch_size, description, cfg.data.percentage)

    def kept(self, images: int) -> int:
        """The images of a class (or a whole set) that --dataset-percentage-to-use keeps: at least one of any."""
        return images if self.percentage >= 100 or images == 0 else max(1, images * self.percentage // 100)

    def check_fits(self, kept: int, images: int, where: Path) -> None:
        if kept >= self.size:
            return
        share = "" if self.percentage >= 100 else f" ({kept} with --dataset-percentage-to-use {self.percentage})"
        raise DataError(f"the training set in {where} has {images} images{share}, fewer than {self.description}: "
                        "give a smaller --micro-batch-size")


def check_cifar_files(folder: Path, file_format: str, splits: list[str], batch: TrainingBatch,
                      size_limit: int | None = None) -> None:
    """Every file of the splits is there, a regular file within --max-file-size of a whole number of records, with
    class labels in range, in the CIFAR reader's words; and the training set holds one batch. The labels are read
    through a memory map, one byte a record, rather than loading the images the run loads anyway."""
    import numpy as np

    from cnns.data.cifar import NUM_CLASSES, PIXELS_PER_IMAGE, cifar_files, record_count, record_size

    record = record_size(file_format)
    class_byte = record - PIXELS_PER_IMAGE - 1  # the last label byte: CIFAR-100's fine label
    for split in splits:
        images = 0
        for path in cifar_files(folder, file_format, train=split == "train"):
            count = record_count(path, record, size_limit)
            largest = int(np.memmap(path, dtype=np.uint8, mode="r", shape=(count, record))[:, class_byte].max())
            if largest >= NUM_CLASSES[file_format]:
                raise DataError(f"CIFAR file has class label {largest}, outside 0..{NUM_CLASSES[file_format] - 1}: "
                                f"{path}")
            images += count
        if split == "train":
            batch.check_fits(batch.kept(images), images, folder)


def check_imagenet_files(folder: Path, splits: list[str], batch: TrainingBatch, decode: bool,
                         size_limit: int | None = None) -> None:
    """TFRecord shards or a folder tree of images, whichever the folder holds; with `decode`, the first image of
    each split is read (within `size_limit`, --max-file-size) and decoded. Without it (--skip-corrupt-images) a
    folder tree's first image is not read: training leaves it out if it cannot be read."""
    from cnns.data.bounded import read_bounded
    from cnns.data.imagefolder import decode_rgb
    from cnns.data.imagenet import detect_imagenet

    tfrecords = detect_imagenet(folder) == "tfrecord"
    for split in splits:
        needed = batch if split == "train" else None
        if tfrecords:
            data, source = check_tfrecord_split(folder, split, needed, size_limit)
        else:
            first = check_image_folder_split(folder, split, needed)
            data, source = (read_bounded(first, size_limit) if decode else b""), str(first)
        if decode:
            decode_rgb(data, source)


_RECORD_HEADER = struct.Struct("<QI")  # a TFRecord's length and the masked CRC32C of those 8 bytes
_RECORD_FOOTER_BYTES = 4  # the masked CRC32C of the record's data


def check_tfrecord_split(folder: Path, split: str, batch: TrainingBatch | None,
                         size_limit: int | None = None) -> tuple[bytes, str]:
    """Every shard of the split is a regular file that begins with a whole TFRecord, no longer than `size_limit`
    (--max-file-size), holding an ImageNet tf.train.Example, and the training split holds one batch (shards are
    indexed, headers only, until it does). Returns the first image's bytes and where they come from."""
    from cnns.data.tfrecord import find_shards, index_records

    shards = find_shards(folder, split)
    first = None
    with ThreadPoolExecutor(max_workers=min(16, len(shards))) as pool:  # I/O-bound: one read per shard
        # each image let go once seen: only the first is kept
        for example in pool.map(lambda shard: first_example(shard, size_limit), shards):
            first = first or example
    if first is None:
        raise DataError(f"{folder}: every {split} TFRecord shard is empty ({len(shards)} of them: "
                        f"{shards[0].name} ...)")
    if batch is not None:
        needed, records = _images_needed(batch), 0
        for path in shards:
            records += len(index_records(path))
            if records >= needed:
                break
        else:
            batch.check_fits(batch.kept(records), records, folder)
    return first


def first_example(path: Path, size_limit: int | None = None) -> tuple[bytes, str] | None:
    """(image bytes, where they come from) of a shard's first record, parsed as an ImageNet tf.train.Example;
    None for an empty shard."""
    from cnns.data.tfrecord import parse_imagenet_example

    record = first_record(path, size_limit)
    if record is None:
        return None
    source = f"{path} (record at byte offset 0)"
    return parse_imagenet_example(record, source)[0], source


def _images_needed(batch: TrainingBatch) -> int:
    """The fewest images of which the kept share (`TrainingBatch.kept`) holds one batch."""
    if batch.percentage >= 100 or batch.size <= 1:
        return batch.size
    return -(-(batch.size * 100) // batch.percentage)


def first_record(path: Path, size_limit: int | None = None) -> bytes | None:
    """The data of a TFRecord shard's first record, its framing and both CRCs checked; None for an empty file
    (a shard with no records, which the reader accepts). Only a regular file is opened, and a record longer than
    `size_limit` (--max-file-size) is not read."""
    from cnns.data.bounded import UnreadableFile, open_regular_file
    from cnns.data.tfrecord import SHARD_SIZE_UNLIMITED, masked_crc32c, read_record

    with open_regular_file(path, SHARD_SIZE_UNLIMITED) as file:
        size = os.fstat(file.fileno()).st_size
        try:
            header = file.read(_RECORD_HEADER.size)
        except OSError as error:
            raise UnreadableFile(path, error.strerror or str(error)) from None
    if size == 0:
        return None
    if len(header) < _RECORD_HEADER.size:
        raise DataError(f"{path}: not a TFRecord file ({size} bytes, less than a record's "
                        f"{_RECORD_HEADER.size}-byte header)")
    length, length_crc = _RECORD_HEADER.unpack(header)
    if masked_crc32c(header[:8]) != length_crc:
        raise DataError(f"{path}: not a TFRecord file (the first record's length CRC does not match: "
                        "another format, or corrupt from its first byte)")
    if _RECORD_HEADER.size + length + _RECORD_FOOTER_BYTES > size:
        raise DataError(f"{path}: truncated TFRecord at byte offset 0 (record of {length} bytes runs past the "
                        f"end of the {size}-byte file)")
    return read_record(path, 0, length, size_limit)


def check_image_folder_split(folder: Path, split: str, batch: TrainingBatch | None) -> Path:
    """The split's class folders hold images, and the training split one batch of them (class folders are
    listed until it does). Returns the first image's path."""
    from cnns.data.imagefolder import SPLIT_FOLDERS, find_split_folder, list_classes, list_images

    split_folder = find_split_folder(folder, split)
    if split_folder is None:
        names = " or ".join(f"{name}/" for name in SPLIT_FOLDERS[split])
        raise DataError(f"{folder}: no {names} folder of class sub-folders")
    classes = list_classes(split_folder)
    first: Path | None = None
    images = kept = 0
    needed = batch.size if batch is not None else 1
    for name in classes:
        found = list_images(split_folder / name)
        first = first or (found[0] if found else None)
        images += len(found)
        kept += batch.kept(len(found)) if batch is not None else len(found)
        if kept >= needed:
            break
    if first is None:
        raise DataError(f"{split_folder}: no image files in its {len(classes)} class folders (expected "
                        f"{split_folder}/<class>/<image>.JPEG; a flat folder of images must first be sorted into "
                        "one folder per class)")
    if batch is not None:
        batch.check_fits(kept, images, split_folder)
    return first


def check_run_folder_place(cfg: RunConfig) -> None:
    """Where train.py makes its run folder (--log-dir, or --logs-path) is a folder, or can become one, that this
    process may write in: checked before any process starts or any file is written. (What only trying shows, a
    folder in /proc say, is one line too: `cnns.runs.agree_on_run_folder`.)"""
    if cfg.train.compile_only:  # writes nothing
        return
    if not cfg.log.logs_path:
        check_run_name(cfg.log.name, cfg.log.log_dir, cfg.arguments.get("name_suffix"))
    option, target = ("--logs-path", cfg.log.logs_path) if cfg.log.logs_path else ("--log-dir", cfg.log.log_dir)
    path = Path(target)
    existing = path
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        where = "is a file" if existing == path else f"cannot be made: {existing} is a file"
        raise ConfigError(f"{option} {target} {where}, not a folder")
    check_writable(existing, f"{option} {target}")


def check_run_name(name: str, log_dir: str, suffix: str | None) -> None:
    """The run name (the model options and --name-suffix) is one folder name: the run folder stays a folder of
    --log-dir. A '/' would make sub-folders, and '..' among them a run folder anywhere; a NUL byte no path holds."""
    separators = {"/", "\0"} | ({os.altsep} if os.altsep else set())
    found = sorted(separator for separator in separators if separator in name)
    if not found:
        return
    what = f"--name-suffix {suffix!r}" if suffix and any(s in suffix for s in found) else f"the run name {name!r}"
    shown = " or ".join(repr(s) for s in found)
    raise ConfigError(f"{what} holds {shown}: a run name is one folder name inside --log-dir {log_dir}, not a path")


def check_writable(folder: Path, what: str) -> None:
    """ConfigError unless this process may create files in `folder` (a read-only folder or file system)."""
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"{what}: cannot write in {folder} (read-only, or no permission)")


def parallel_notices(cfg: RunConfig) -> list[str]:
    """What a training run's parallel options mean here, where that is not what a reader expects."""
    p, notices = cfg.parallel, []
    if p.offload_optimiser and not (cfg.device or default_device_name()).startswith("cuda"):
        notices.append("--offload-optimiser has no effect on a CPU: the optimiser state is already in host memory")
    if p.pipeline and p.shards == 1:
        if p.splits and p.recomputation:
            notices.append("--pipeline with --shards 1: one stage; its --pipeline-splits are the recomputation "
                           "points (only the input of each segment between them is kept for the backward pass)")
        else:
            notices.append("--pipeline with --shards 1: one stage, nothing to pipeline; the whole model runs in "
                           "each process (the --pipeline-splits are not used)")
    if p.shards > 1 and cfg.log.ckpt_all_instances:
        notices.append("--ckpt-all-instances with pipeline stages: each process holds a part of the model, so only "
                       "rank 0 writes checkpoints (of the whole model, gathered from the stages)")
    if p.rts and p.replicas == 1:
        notices.append("--rts shards the optimiser state over replicas: with one replica it changes nothing")
    return notices
