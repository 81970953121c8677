"""What Hugging Face's two on-disk layouts of an image dataset share (`huggingface_parquet`: the Hub's Parquet shards;
`huggingface_arrow`: a `save_to_disk` folder): the dataset's own features (the ``huggingface`` key of the Parquet
schema's metadata, or dataset_info.json, as `datasets` writes them) name the image column (an ``Image`` feature, a
struct {bytes, path}) and the label column (a ``ClassLabel``, with its class names); the split names the Hub's
conventions use; and the reader the loader is handed (`TableRecords`), which hands each image's encoded bytes to the
native decoder as the other layouts do. Both are read with pyarrow, never with `datasets` (a test dependency only).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cnns.bounded_reads import FILE_SIZE_OPTION, UnreadableFile, describe_size, file_size_limit, open_regular_file
from cnns.data.formats.base import TrainingBatch
from cnns.data.formats.imagenet import ImageNetFiles
from cnns.errors import DataError

SPLITS = ("train", "validation")
# The Hub's split names (`datasets.data_files`' patterns): the validation split is the first of these present,
# a test split standing in where there is none (CIFAR-10's uoft-cs/cifar10 has train and test only).
SPLIT_NAMES = {"train": ("train", "training"),
               "validation": ("validation", "valid", "val", "dev", "test", "testing", "eval", "evaluation")}
FILE_SIZE_UNLIMITED = 1 << 62  # a data file is never read whole: each image is bounded by --max-file-size
METADATA_BYTES = 16 << 20  # dataset_info.json, state.json, dataset_dict.json


@dataclass(frozen=True)
class Columns:
    """Where a table's images and labels are, and the class names its ClassLabel carries (None: not declared)."""

    image: str
    label: str
    names: tuple[str, ...] | None


def split_named(name: str) -> str | None:
    """The split a Hub split name is ("train", "validation"), from the tokens of a file or folder name; None."""
    tokens = re.split(r"[-_.]", name.lower())
    for split, names in SPLIT_NAMES.items():
        if tokens and tokens[0] in names:
            return split
    return None


def choose_splits(named: dict[str, list[Path]]) -> dict[str, list[Path]]:
    """{"train": files, "validation": files} from {Hub split name: files}: validation the first of
    SPLIT_NAMES["validation"] present (a test split only where no validation split is)."""
    chosen = {}
    for split, names in SPLIT_NAMES.items():
        for name in names:
            if named.get(name):
                chosen[split] = named[name]
                break
    return chosen


def columns_of(features: dict | None, field_names: list[str], where: str) -> Columns:
    """The image and label columns: the Image and ClassLabel features (`image` and `label` where there are
    several), else columns of those names (a table written without `datasets`' metadata); DataError naming what
    is missing."""
    features = features if isinstance(features, dict) else {}
    typed = {kind: [name for name, feature in features.items()
                    if isinstance(feature, dict) and feature.get("_type") == kind] for kind in ("Image", "ClassLabel")}

    def pick(kind: str, default: str) -> str | None:
        found = typed[kind]
        if default in found or (not found and default in field_names):
            return default
        return found[0] if len(found) == 1 else None

    image, label = pick("Image", "image"), pick("ClassLabel", "label")
    if image is None or label is None:
        what = "Image feature or 'image' column" if image is None else "ClassLabel feature or 'label' column"
        raise DataError(f"{where}: no {what} among its columns ({', '.join(field_names)})")
    names = features.get(label, {}).get("names") if isinstance(features.get(label), dict) else None
    names = tuple(str(name) for name in names) if isinstance(names, list) and names else None
    return Columns(image, label, names)


def features_of(schema) -> dict | None:
    """The dataset's features as `datasets` stores them in the schema's metadata ({"info": {"features": ...}})."""
    raw = (schema.metadata or {}).get(b"huggingface")
    if raw is None:
        return None
    try:
        return json.loads(raw).get("info", {}).get("features")
    except (ValueError, AttributeError):
        return None


def read_json(path: Path) -> dict | list | None:
    """A small JSON file `datasets` writes (bounded, regular files only); None where there is none."""
    if not os.path.lexists(path):
        return None
    try:
        with open_regular_file(path, METADATA_BYTES) as file:
            return json.loads(file.read(METADATA_BYTES))
    except ValueError as error:
        raise DataError(f"{path}: not a JSON file ({error})") from None


def check_regular(path: Path) -> None:
    """A data file is a regular file (never a FIFO or a device: `cnns.bounded_reads`); UnreadableFile naming it."""
    open_regular_file(path, FILE_SIZE_UNLIMITED).close()


@dataclass(frozen=True)
class TableIndex:
    """One split's rows over its files: each row's file, the piece it lies in (a Parquet row group, an Arrow
    record batch), its place in that piece, and its label."""

    files: tuple[str, ...]
    columns: Columns
    file_ids: np.ndarray  # int32
    pieces: np.ndarray  # int32, the piece's number in its file
    rows: np.ndarray  # int64, the row's place in its piece
    file_rows: np.ndarray  # int64, the row's place in its file (for messages)
    labels: np.ndarray  # int64
    piece_ids: np.ndarray  # int64, the piece's number over the whole split (what the training order shuffles)
    piece_count: int


def check_labels(index: TableIndex, num_classes: int) -> None:
    """Every label a class of the `num_classes` (HF marks an unlabelled row -1: a test split without labels)."""
    if not len(index.labels):
        return
    bad = np.flatnonzero((index.labels < 0) | (index.labels >= num_classes))
    if len(bad):
        at = int(bad[0])
        value = int(index.labels[at])
        why = ("no class (an unlabelled split, as a Hub test split often is)" if value < 0
               else f"outside 0..{num_classes - 1}")
        raise DataError(f"{index.files[index.file_ids[at]]}: row {int(index.file_rows[at])} has label {value}: {why}")


class TableRecords:
    """One split's rows: the loader's reader (`cnns.data.image_loader`'s ImageRecords). Holds the index, not open
    files: each process opens what it reads (`read_piece`), so it crosses to DataLoader workers as it is."""

    def __init__(self, index: TableIndex, where: str, num_classes: int, size_limit: int | None, reader) -> None:
        self.index = index
        self.num_classes = num_classes
        self.where = where
        self.size_limit = size_limit  # the largest image read (--max-file-size)
        self.reader = reader  # the layout's module-level read_image(file, piece, column, row) -> bytes or None
        self.labels = index.labels
        check_labels(index, num_classes)

    def __len__(self) -> int:
        return len(self.index.labels)

    def source(self, index: int) -> str:
        return f"{self.index.files[self.index.file_ids[index]]}: row {int(self.index.file_rows[index])}"

    def read(self, index: int) -> tuple[bytes, int, str]:
        found = self.index
        data = self.reader(found.files[found.file_ids[index]], int(found.pieces[index]), found.columns.image,
                           int(found.rows[index]))
        if data is None:
            raise DataError(f"{self.source(index)}: no image bytes (an image kept by path only: cnns reads the "
                            "bytes the dataset holds)")
        limit = file_size_limit(self.size_limit)
        if len(data) > limit:
            raise UnreadableFile(self.source(index), f"an image of {describe_size(len(data))}, more than the "
                                 f"{describe_size(limit)} {FILE_SIZE_OPTION} allows")
        return data, int(found.labels[index]), self.source(index)

    def training_order(self, indices: np.ndarray, seed: int, epoch: int) -> np.ndarray:
        """A uniform shuffle drawn from (seed, epoch), where any row is as quick to reach as any other."""
        from cnns.data.batches import shuffled

        return shuffled(indices, seed, epoch)


class HuggingFaceFiles(ImageNetFiles):
    """What the two layouts' formats share: the split's index (`index`), the class count and names from the
    features, the checks."""

    names_files = False

    def index(self, folder: Path, split: str) -> TableIndex:
        raise NotImplementedError

    def splits_present(self, folder: Path) -> list[str]:
        raise NotImplementedError

    def classes(self, folder: Path) -> int:
        """The ClassLabel's names where the features declare them, else the largest label + 1."""
        indexes = [self.index(folder, split) for split in self.splits_present(folder)]
        declared = next((index.columns.names for index in indexes if index.columns.names), None)
        if declared:
            return len(declared)
        largest = max((int(index.labels.max()) for index in indexes if len(index.labels)), default=-1)
        return largest + 1 if largest >= 0 else self.dataset.num_classes

    def class_names(self, folder: Path | None) -> tuple[list[str], str] | None:
        if folder is None or not self.recognise(folder):
            return None
        try:
            for split in self.splits_present(folder):
                index = self.index(folder, split)
                if index.columns.names:
                    return list(index.columns.names), f"the ClassLabel feature of {index.files[0]}"
        except DataError:
            return None
        return None

    def check(self, folder: Path, splits: list[str], batch: TrainingBatch, *, decode: bool,
              size_limit: int | None) -> None:
        """Every file of each split opened and its labels read (what the loader indexes anyway, cached), every
        label a class, the training split holding `batch`, and with `decode` the first image decoded."""
        for split in splits:
            records = self.records(folder, split, size_limit)
            if len(records) == 0:
                raise DataError(f"{folder}: the {split} split has no rows ({records.index.files[0]} ...)")
            if split == "train":
                batch.check_fits(batch.kept(len(records)), len(records), folder)
            if decode:
                data, _, source = records.read(0)
                self.check_first_image(data, source)


def same_columns(first: Columns, other: Columns, where: str) -> None:
    if (first.image, first.label) != (other.image, other.label):
        raise DataError(f"{where}: its image and label columns ({other.image}, {other.label}) are not the "
                        f"split's first file's ({first.image}, {first.label})")


def build_index(files: list[str], columns: Columns, pieces_per_file: list[list[np.ndarray]]) -> TableIndex:
    """The index of `files` from each file's pieces' labels, in file and piece order."""
    file_ids, pieces, rows, file_rows, labels, piece_ids = [], [], [], [], [], []
    piece_number = 0
    for file_id, file_pieces in enumerate(pieces_per_file):
        offset = 0
        for piece, piece_labels in enumerate(file_pieces):
            count = len(piece_labels)
            file_ids.append(np.full(count, file_id, dtype=np.int32))
            pieces.append(np.full(count, piece, dtype=np.int32))
            rows.append(np.arange(count, dtype=np.int64))
            file_rows.append(np.arange(offset, offset + count, dtype=np.int64))
            labels.append(np.asarray(piece_labels, dtype=np.int64))
            piece_ids.append(np.full(count, piece_number, dtype=np.int64))
            offset += count
            piece_number += 1

    def joined(parts: list[np.ndarray], dtype) -> np.ndarray:
        return np.concatenate(parts) if parts else np.empty(0, dtype=dtype)

    return TableIndex(tuple(files), columns, joined(file_ids, np.int32), joined(pieces, np.int32),
                      joined(rows, np.int64), joined(file_rows, np.int64), joined(labels, np.int64),
                      joined(piece_ids, np.int64), piece_number)


def identities(files: list[Path]) -> tuple[tuple[str, int, int], ...]:
    """Each file's path, size and time, checked to be a regular file: a cache key that a rewritten file misses."""
    found = []
    for path in files:
        check_regular(path)
        status = os.stat(path)
        found.append((str(path), status.st_size, status.st_mtime_ns))
    return tuple(found)
