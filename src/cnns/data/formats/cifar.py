"""CIFAR-10 and CIFAR-100 in their binary ("-bin") format, as the official archives unpack them
(`cnns.data.cifar_records` reads and writes the records): held whole in memory, batches made in the main process."""

from __future__ import annotations

from pathlib import Path

from cnns.data.cifar_records import NUM_CLASSES
from cnns.data.formats.base import DataFormat, Dataset, FormatSources, SourceRequest, TrainingBatch
from cnns.errors import DataError

CIFAR_10 = Dataset("cifar-10", num_classes=NUM_CLASSES["cifar-10"], cifar_sized=True, train_images=50000, eval_images=10000,
                   path_words=("cifar",))
CIFAR_100 = Dataset("cifar-100", num_classes=NUM_CLASSES["cifar-100"], cifar_sized=True, train_images=50000, eval_images=10000,
                    path_words=("cifar100", "cifar-100"))

# The class-name list each archive ships, and the subfolder it unpacks to.
_NAMES_FILES = {"cifar-10": ("batches.meta.txt", "cifar-10-batches-bin"),
                "cifar-100": ("fine_label_names.txt", "cifar-100-binary")}


class CifarBinary(DataFormat):
    """One CIFAR dataset's binary records; `records` names the record layout (`cnns.data.cifar_records`)."""

    def __init__(self, dataset: Dataset, records: str | None = None):
        self.dataset = dataset
        self.records = records or dataset.name
        self.name = dataset.name

    def recognise(self, folder: Path) -> bool:
        from cnns.data.cifar_records import holds_cifar

        return holds_cifar(folder, self.records)

    def missing(self, folder: Path) -> str:
        return f"no {self.name} binary files found in {folder}"

    def class_names(self, folder: Path | None) -> tuple[list[str], str] | None:
        """The archive's own list (CIFAR-10's ``batches.meta.txt``, CIFAR-100's ``fine_label_names.txt``) in the
        folder or its archive subfolder."""
        if folder is None:
            return None
        filename, subfolder = _NAMES_FILES[self.records]
        for place in (folder, folder / subfolder):
            path = place / filename
            if path.is_file():
                try:
                    text = path.read_text(encoding="utf-8", errors="replace")
                except OSError:
                    return None
                # The archives end the list with blank lines (and some copies with trailing spaces).
                return [line.strip() for line in text.splitlines() if line.strip()], str(path)
        return None

    def check(self, folder: Path, splits: list[str], batch: TrainingBatch, *, decode: bool,
              size_limit: int | None) -> None:
        """Every file of the splits is there, a regular file within --max-file-size of a whole number of records,
        with class labels in range, in the CIFAR reader's words; and the training set holds one batch. The labels
        are read through a memory map, one byte a record, rather than loading the images the run loads anyway."""
        import numpy as np

        from cnns.data.cifar_records import PIXELS_PER_IMAGE, cifar_files, record_count, record_size

        record = record_size(self.records)
        class_byte = record - PIXELS_PER_IMAGE - 1  # the last label byte: CIFAR-100's fine label
        for split in splits:
            images = 0
            for path in cifar_files(folder, self.records, train=split == "train"):
                count = record_count(path, record, size_limit)
                largest = int(np.memmap(path, dtype=np.uint8, mode="r", shape=(count, record))[:, class_byte].max())
                if largest >= NUM_CLASSES[self.records]:
                    raise DataError(f"CIFAR file has class label {largest}, outside "
                                    f"0..{NUM_CLASSES[self.records] - 1}: {path}")
                images += count
            if split == "train":
                batch.check_fits(batch.kept(images), images, folder)

    def sources(self, data, folder: Path, request: SourceRequest) -> FormatSources:
        from cnns.data.augment import cifar_augment
        from cnns.data.batches import TensorBatches
        from cnns.data.cifar_records import load_cifar

        train = evaluation = None
        if request.need_train:
            images, labels = load_cifar(folder, self.records, train=True, size_limit=data.max_file_size)
            if data.dataset_percentage_to_use < 100:
                keep = max(1, len(labels) * data.dataset_percentage_to_use // 100)
                images, labels = images[:keep], labels[:keep]
            whole = request.global_batch_size or request.micro_batch_size * request.shard[1]
            if len(labels) < whole:
                raise DataError(f"the training set in {folder} has {len(labels)} images, fewer than one batch "
                                f"of {whole}")
            train = TensorBatches(images, labels, request.micro_batch_size, shuffle=True, drop_last=True,
                                  seed=request.seed, augment=cifar_augment(4), shard=request.shard,
                                  global_batch_size=request.global_batch_size)
        if request.need_eval:
            images, labels = load_cifar(folder, self.records, train=False, size_limit=data.max_file_size)
            evaluation = TensorBatches(images, labels, request.eval_batch_size, shuffle=False, drop_last=False,
                                       seed=request.seed, shard=request.shard)
        return FormatSources(train, evaluation)


CIFAR_10_BINARY = CifarBinary(CIFAR_10)
CIFAR_100_BINARY = CifarBinary(CIFAR_100)
