"""Small public image sets written as CIFAR-10 binaries, so that cnns trains on them as on CIFAR-10 (`cnns convert`).

Two sources anyone can get without a download script: the IDX files of MNIST and Fashion-MNIST (Debian's
`dataset-fashion-mnist` package installs Zalando's four files in /usr/share/datasets/fashion-mnist; the same four
files are on Zalando's GitHub page) and scikit-learn's bundled 8x8 handwritten digits. Both are 10-class grey images
no larger than 32 px, so one rule makes them CIFAR images: each is enlarged by the largest whole factor that fits
32 px (nearest neighbour: 8 px x 4, 28 px x 1), centred on a black 32 x 32 field and repeated into the three
colour planes. The class names go to `batches.meta.txt`, where CIFAR-10's archive keeps them, so `cnns predict`
names the classes.

The IDX format (LeCun's MNIST page): a big-endian header of two zero bytes, a type byte (0x08: unsigned bytes), the
number of dimensions, one uint32 per dimension, then the values in row-major order; the files are usually gzipped.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cnns.bounded_reads import file_size_limit, read_bounded
from cnns.errors import DataError

CIFAR_SIZE = 32
FASHION_MNIST_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
                         "Ankle boot")
DIGIT_CLASSES = tuple(str(digit) for digit in range(10))
# Where Debian's dataset-fashion-mnist package puts Zalando's files.
DEBIAN_FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")
# The file stems of an MNIST-style IDX set, by split: images, then labels.
IDX_FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
             "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}
# scikit-learn's digits hold 1,797 images: the last 360 (a fifth) are the test split, the first 1,437 train.
DIGITS_TEST_IMAGES = 360

_UNSIGNED_BYTE = 0x08


@dataclass(frozen=True)
class GreySet:
    """One split of a small grey image set: images uint8 [N, H, W], labels int [N] in 0..9, and where it came from."""

    images: np.ndarray
    labels: np.ndarray
    source: str


def parse_idx(data: bytes, name: str) -> np.ndarray:
    """The array an IDX file holds (module docstring), checked: its header, its type (unsigned bytes) and that the
    values fill the dimensions exactly. A DataError naming the file otherwise."""
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise DataError(f"{name} is not an IDX file (MNIST's format): it does not start with two zero bytes")
    if data[2] != _UNSIGNED_BYTE:
        raise DataError(f"{name} holds IDX values of type 0x{data[2]:02x}; cnns reads unsigned bytes (0x08)")
    dimensions = data[3]
    header = 4 + 4 * dimensions
    if dimensions == 0 or len(data) < header:
        raise DataError(f"{name} is cut short in its IDX header")
    shape = tuple(int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(dimensions))
    expected = header + int(np.prod(shape, dtype=np.int64))
    if len(data) != expected:
        raise DataError(f"{name} has {len(data)} bytes; its IDX header {shape} needs {expected}")
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(shape)


def read_idx(path: Path, size_limit: int | None = None) -> np.ndarray:
    """An IDX file (gzipped or not) read within --max-file-size, compressed and uncompressed alike."""
    limit = file_size_limit(size_limit)
    data = read_bounded(path, limit)
    if data[:2] == b"\x1f\x8b":  # gzip's magic number
        inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
        try:
            data = inflater.decompress(data, limit + 1)
        except zlib.error as error:
            raise DataError(f"{path} is a damaged gzip file: {error}") from None
        if len(data) > limit or not inflater.eof:
            raise DataError(f"{path} is cut short, or unpacks to more than --max-file-size")
    return parse_idx(data, str(path))


def idx_file(folder: Path, stem: str) -> Path:
    """`stem` or `stem.gz` in `folder` (Zalando and LeCun ship them gzipped; many copies are unpacked)."""
    for candidate in (folder / f"{stem}.gz", folder / stem):
        if candidate.is_file():
            return candidate
    raise DataError(f"{folder} has no {stem}.gz or {stem}: expected the four IDX files of MNIST or Fashion-MNIST "
                    f"(Debian: apt-get install dataset-fashion-mnist puts them in {DEBIAN_FASHION_MNIST})")


def idx_split(folder: Path, split: str, size_limit: int | None = None) -> GreySet:
    """One split of an MNIST-style IDX set: its image and label files, of the same length, labels in 0..9."""
    images_path, labels_path = (idx_file(folder, stem) for stem in IDX_FILES[split])
    images, labels = read_idx(images_path, size_limit), read_idx(labels_path, size_limit)
    if images.ndim != 3 or labels.ndim != 1:
        raise DataError(f"{images_path} and {labels_path} should hold images [N, H, W] and labels [N]; they hold "
                        f"{list(images.shape)} and {list(labels.shape)}")
    if len(images) != len(labels):
        raise DataError(f"{images_path} holds {len(images)} images but {labels_path} {len(labels)} labels")
    check_labels(labels, str(labels_path))
    return GreySet(images, labels.astype(np.int64), str(images_path))


def digits_splits() -> tuple[GreySet, GreySet]:
    """scikit-learn's 8x8 digits (values 0-16) as bytes 0-255, the first 1,437 to train and the last 360 to test."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise DataError("the digits come with scikit-learn: pip install scikit-learn (make installs it)") from None
    digits = load_digits()
    images = np.clip(np.rint(digits.images * (255 / 16)), 0, 255).astype(np.uint8)
    labels = digits.target.astype(np.int64)
    cut = len(images) - DIGITS_TEST_IMAGES
    source = "scikit-learn's load_digits()"
    return GreySet(images[:cut], labels[:cut], source), GreySet(images[cut:], labels[cut:], source)


def check_labels(labels: np.ndarray, name: str) -> None:
    if len(labels) and (labels.min() < 0 or labels.max() > 9):
        raise DataError(f"{name} holds class {int(labels.max())}; CIFAR-10's format holds classes 0..9")


def as_cifar_images(grey: np.ndarray) -> np.ndarray:
    """Grey images [N, H, W] (H, W <= 32) as CIFAR images [N, 32, 32, 3]: enlarged by the largest whole factor that
    fits (nearest neighbour), centred on black, the grey value in each colour plane."""
    count, height, width = grey.shape
    if max(height, width) > CIFAR_SIZE or min(height, width) < 1:
        raise DataError(f"images of {height} x {width} px do not fit CIFAR's {CIFAR_SIZE} x {CIFAR_SIZE}")
    factor = CIFAR_SIZE // max(height, width)
    enlarged = grey.repeat(factor, axis=1).repeat(factor, axis=2)
    top, left = (CIFAR_SIZE - height * factor) // 2, (CIFAR_SIZE - width * factor) // 2
    out = np.zeros((count, CIFAR_SIZE, CIFAR_SIZE, 3), dtype=np.uint8)
    out[:, top:top + height * factor, left:left + width * factor, :] = enlarged[..., None]
    return out


def cifar10_files(train: GreySet, test: GreySet, class_names: tuple[str, ...]) -> dict[str, bytes]:
    """The bytes of every file of the CIFAR-10 folder these splits make: data_batch_1..5.bin, test_batch.bin and
    batches.meta.txt."""
    import torch

    from cnns.data.cifar_records import cifar10_file_contents

    for split in (train, test):
        check_labels(split.labels, split.source)
    pairs = [(torch.from_numpy(as_cifar_images(split.images)), torch.from_numpy(split.labels))
             for split in (train, test)]
    files = cifar10_file_contents(pairs[0], pairs[1])
    return {**files, "batches.meta.txt": ("\n".join(class_names) + "\n").encode()}
