"""The data checks every command makes before it writes anything, so that a bad command leaves nothing behind:
the data is there, in its format, readable, with classes the model has outputs for and one batch of it.

`check_data_before_writing` is the one entry (`cnns.commands.checks` gives it to the commands); each format's
reading is its reader's (`cifar`, `tfrecord`, `imagefolder`), imported when a run's data is of that format.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from cnns.config import RunConfig
from cnns.errors import ConfigError, DataError


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
        check_imagenet_files(folder, splits, batch, decode=not cfg.data.skip_corrupt_images,
                             size_limit=cfg.data.max_file_size)
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
        if t.gradient_accumulation_count > 1:
            parts.append(f"accumulation {t.gradient_accumulation_count}")
        if replicas > 1:
            parts.append(f"replicas {replicas}")
        description = (f"one batch of {t.global_batch_size}" if len(parts) == 1 else
                       f"one global batch of {t.global_batch_size} ({' x '.join(parts)})")
        return cls(t.global_batch_size, description, cfg.data.dataset_percentage_to_use)

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
    from cnns.bounded import read_bounded
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


def check_tfrecord_split(folder: Path, split: str, batch: TrainingBatch | None,
                         size_limit: int | None = None) -> tuple[bytes, str]:
    """Every shard of the split is a regular file that begins with a whole TFRecord, no longer than `size_limit`
    (--max-file-size), holding an ImageNet tf.train.Example, and the training split holds one batch (shards are
    indexed, headers only, until it does). Returns the first image's bytes and where they come from."""
    from cnns.data.tfrecord import find_shards, first_example, index_records

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


def _images_needed(batch: TrainingBatch) -> int:
    """The fewest images of which the kept share (`TrainingBatch.kept`) holds one batch."""
    if batch.percentage >= 100 or batch.size <= 1:
        return batch.size
    return -(-(batch.size * 100) // batch.percentage)


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
