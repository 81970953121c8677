"""CIFAR-10 and CIFAR-100 in their binary ("-bin") format: detect, load whole into memory, write.

The binary format is a flat sequence of fixed-size records, one per image:

* CIFAR-10: 1 label byte, then 3072 pixel bytes (record 3073 bytes).
* CIFAR-100: 1 coarse label byte, 1 fine label byte, then 3072 pixel bytes (record 3074 bytes);
  the class we train on is the fine label.

The 3072 pixel bytes are three row-major 32x32 planes, red then green then blue. We return the
images as one contiguous uint8 tensor [N, 32, 32, 3] (NHWC): a permute of it is exactly the
channels_last layout the models run in, and whole-batch augmentation indexes it cheaply.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from cnns.bounded_reads import check_regular_file, open_regular_file
from cnns.errors import DataError
from cnns.safe_writes import write_atomically  # readers, and processes writing the same file at once, never see a partial file

IMAGE_SIZE = 32
CHANNELS = 3
PIXELS_PER_IMAGE = IMAGE_SIZE * IMAGE_SIZE * CHANNELS  # 3072

NUM_CLASSES = {"cifar-10": 10, "cifar-100": 100}

CIFAR10_FILES = {
    "train": tuple(f"data_batch_{i}.bin" for i in range(1, 6)),
    "test": ("test_batch.bin",),
}
CIFAR100_FILES = {
    "train": ("train.bin",),
    "test": ("test.bin",),
}

# Per dataset: its file names, the subfolder its official archive unpacks to, the number of label
# bytes that precede the pixels in a record, and which of those bytes is the class.
_FILES = {"cifar-10": CIFAR10_FILES, "cifar-100": CIFAR100_FILES}
_SUBFOLDERS = {"cifar-10": "cifar-10-batches-bin", "cifar-100": "cifar-100-binary"}
_LABEL_BYTES = {"cifar-10": 1, "cifar-100": 2}
_CLASS_BYTE = {"cifar-10": 0, "cifar-100": 1}
_DISPLAY = {"cifar-10": "CIFAR-10", "cifar-100": "CIFAR-100"}


def record_size(dataset: str) -> int:
    """Bytes per image record: 3073 for CIFAR-10, 3074 for CIFAR-100."""
    _check_dataset_name(dataset)
    return _LABEL_BYTES[dataset] + PIXELS_PER_IMAGE


def detect_cifar(folder: str | Path) -> str | None:
    """Which CIFAR dataset `folder` holds: "cifar-10", "cifar-100" or None.

    A dataset counts as present when any of its files lies in `folder` or in the subfolder its
    archive unpacks to; a partial copy is then reported by load_cifar naming the missing file,
    which is clearer than "no dataset found". CIFAR-10 wins if both are present.
    """
    return next((dataset for dataset in ("cifar-10", "cifar-100") if holds_cifar(folder, dataset)), None)


def holds_cifar(folder: str | Path, dataset: str) -> bool:
    """Whether any of `dataset`'s files lies in `folder` or in the subfolder its archive unpacks to."""
    folder = Path(folder)
    return any(_holds_any_file(place, dataset) for place in (folder, folder / _SUBFOLDERS[dataset]))


def cifar_files(folder: str | Path, dataset: str, train: bool) -> list[Path]:
    """The paths of the split's files, found in `folder` or its archive subfolder; DataError if any is missing."""
    _check_dataset_name(dataset)
    folder = Path(folder)
    if not folder.is_dir():
        raise DataError(f"{_DISPLAY[dataset]} folder missing: {folder}")
    place = _dataset_place(folder, dataset)
    paths = [place / name for name in _FILES[dataset]["train" if train else "test"]]
    # Only what is not there at all: a FIFO, a device or a folder under a file's name is named by the reader.
    missing = [path for path in paths if not os.path.lexists(path)]
    if missing:
        also = "" if place != folder else f" (also looked in {folder / _SUBFOLDERS[dataset]})"
        names = ", ".join(str(path) for path in missing)
        raise DataError(f"{_DISPLAY[dataset]} file missing: {names}{also}")
    return paths


def load_cifar(folder: str | Path, dataset: str, train: bool,
               size_limit: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Load one split whole: images uint8 [N, 32, 32, 3] contiguous (NHWC), labels int64 [N].

    Every file is validated before use: a regular file no larger than `size_limit` (--max-file-size),
    non-empty, a whole number of records, class labels in range. Errors are DataError naming the file.
    """
    paths = cifar_files(folder, dataset, train)
    record = record_size(dataset)
    counts = [record_count(path, record, size_limit) for path in paths]
    # Read every file straight into one preallocated buffer: no per-file arrays to concatenate,
    # so the peak memory is the records plus the final NHWC copy.
    records = np.empty((sum(counts), record), dtype=np.uint8)
    start = 0
    for path, count in zip(paths, counts):
        _read_records(path, records[start : start + count], size_limit)
        _check_labels(path, records[start : start + count, _CLASS_BYTE[dataset]], NUM_CLASSES[dataset])
        start += count
    return _split_records(records, dataset)


def write_cifar10(
    folder: str | Path,
    train: tuple[torch.Tensor, torch.Tensor],
    test: tuple[torch.Tensor, torch.Tensor],
    num_train_files: int = 5,
) -> None:
    """Write (images uint8 [N, 32, 32, 3], labels) pairs as CIFAR-10 binary files in `folder`.

    The training images are split as evenly as possible over data_batch_1.bin ..
    data_batch_{num_train_files}.bin. load_cifar reads exactly the five standard files, so other
    values give a layout it rejects (useful in tests); each file must receive at least one image.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name, content in cifar10_file_contents(train, test, num_train_files).items():
        write_atomically(folder / name, content)


def cifar10_file_contents(train: tuple[torch.Tensor, torch.Tensor], test: tuple[torch.Tensor, torch.Tensor],
                          num_train_files: int = 5) -> dict[str, bytes]:
    """The bytes of each file `write_cifar10` writes, by name."""
    if num_train_files < 1:
        raise ValueError(f"num_train_files must be at least 1, got {num_train_files}")
    train_records = _make_records(*train, num_classes=10, coarse_labels=False)
    test_records = _make_records(*test, num_classes=10, coarse_labels=False)
    if len(train_records) < num_train_files:
        raise ValueError(f"{len(train_records)} training images cannot fill {num_train_files} files")
    contents = {f"data_batch_{index}.bin": chunk.tobytes()
                for index, chunk in enumerate(np.array_split(train_records, num_train_files), start=1)}
    return {**contents, CIFAR10_FILES["test"][0]: test_records.tobytes()}


def write_cifar100(
    folder: str | Path,
    train: tuple[torch.Tensor, torch.Tensor],
    test: tuple[torch.Tensor, torch.Tensor],
) -> None:
    """Write (images uint8 [N, 32, 32, 3], fine labels) pairs as CIFAR-100 train.bin / test.bin.

    The coarse label byte is written as fine // 5: the real superclass mapping is not needed by
    anything here, only a valid byte in the right place.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name, (images, labels) in (("train.bin", train), ("test.bin", test)):
        records = _make_records(images, labels, num_classes=100, coarse_labels=True)
        write_atomically(folder / name, records.tobytes())


def _check_dataset_name(dataset: str) -> None:
    if dataset not in NUM_CLASSES:
        raise DataError(f"unknown CIFAR dataset {dataset!r}; expected one of {sorted(NUM_CLASSES)}")


def _holds_any_file(place: Path, dataset: str) -> bool:
    names = _FILES[dataset]["train"] + _FILES[dataset]["test"]
    return any((place / name).is_file() for name in names)


def _dataset_place(folder: Path, dataset: str) -> Path:
    """`folder` itself if it holds any of the dataset's files, else the archive subfolder if that
    exists (the layout after unpacking the official tarball), else `folder`."""
    subfolder = folder / _SUBFOLDERS[dataset]
    if not _holds_any_file(folder, dataset) and subfolder.is_dir():
        return subfolder
    return folder


def record_count(path: Path, record: int, size_limit: int | None = None) -> int:
    """The records of a CIFAR file, from its size (stat only); DataError unless it is a regular file of a whole
    number of records, no larger than `size_limit`."""
    size = check_regular_file(path, size_limit)
    if size == 0:
        raise DataError(f"CIFAR file is empty: {path}")
    if size % record:
        raise DataError(
            f"CIFAR file truncated or not in the binary format: {path} has {size} bytes, "
            f"not a multiple of the {record}-byte record"
        )
    return size // record


def _read_records(path: Path, destination: np.ndarray, size_limit: int) -> None:
    with open_regular_file(path, size_limit) as file:
        read = file.readinto(memoryview(destination).cast("B"))
    if read != destination.nbytes:  # the file changed size between stat and read
        raise DataError(f"CIFAR file could not be read whole: {path} ({read} of {destination.nbytes} bytes)")


def _check_labels(path: Path, labels: np.ndarray, num_classes: int) -> None:
    largest = int(labels.max())
    if largest >= num_classes:
        raise DataError(f"CIFAR file has class label {largest}, outside 0..{num_classes - 1}: {path}")


def _split_records(records: np.ndarray, dataset: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Records [N, record] -> (NHWC uint8 images, int64 labels)."""
    count = len(records)
    as_tensor = torch.from_numpy(records)
    labels = as_tensor[:, _CLASS_BYTE[dataset]].to(torch.int64)
    planes = as_tensor[:, _LABEL_BYTES[dataset] :].view(count, CHANNELS, IMAGE_SIZE, IMAGE_SIZE)
    images = planes.permute(0, 2, 3, 1).contiguous()
    return images, labels


def _make_records(images, labels, *, num_classes: int, coarse_labels: bool) -> np.ndarray:
    """(NHWC uint8 images, labels) -> records [N, record] in the binary layout."""
    images = torch.as_tensor(images).cpu()
    labels = torch.as_tensor(labels).cpu().reshape(-1)
    expected = (IMAGE_SIZE, IMAGE_SIZE, CHANNELS)
    if images.dtype != torch.uint8 or images.dim() != 4 or tuple(images.shape[1:]) != expected:
        raise ValueError(f"images must be uint8 [N, 32, 32, 3], got {images.dtype} {list(images.shape)}")
    if len(labels) != len(images):
        raise ValueError(f"{len(images)} images but {len(labels)} labels")
    if len(labels) and not (0 <= int(labels.min()) and int(labels.max()) < num_classes):
        raise ValueError(f"labels must lie in 0..{num_classes - 1}")
    label_bytes = 2 if coarse_labels else 1
    records = np.empty((len(images), label_bytes + PIXELS_PER_IMAGE), dtype=np.uint8)
    fine = labels.numpy().astype(np.uint8)
    if coarse_labels:
        records[:, 0] = fine // 5
    records[:, label_bytes - 1] = fine
    records[:, label_bytes:] = images.permute(0, 3, 1, 2).reshape(len(images), PIXELS_PER_IMAGE).numpy()
    return records
