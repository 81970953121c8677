"""An image dataset as the Hugging Face Hub keeps it: Parquet shards (``data/train-00000-of-00004.parquet``,
``data/validation-*.parquet``, or ``<split>/*.parquet``), an ``image`` struct column {bytes, path} and a ``label``
ClassLabel, the class names in the dataset's features (the ``huggingface`` key of the Parquet schema's metadata).
``huggingface-cli download <dataset> --repo-type dataset --local-dir DIR`` leaves it so.

Read with pyarrow, row group by row group: the index is the label column alone, read once; a worker reads the image
column of the row group a sample lies in and keeps the last few (PIECE_CACHE_BYTES a process). So the training
order keeps a stretch of batches within a few row groups: the row groups in an order drawn from (seed, epoch), taken
WINDOW_GROUPS at a time, the rows of each such window in a uniformly random order (`window_order`). One worker then
reads every row group once an epoch; W workers, which take the batches in turn, each read the windows their batches
fall in, at most W times the rows they use (docs/datasets.md has the account). A streaming shuffle buffer (webdataset's
order, `datasets`' IterableDataset.shuffle) would mix as much but keep rows in the buffer for long after their row
group has left a worker's cache: 17 rows read per row used, on ImageNet's shape, against 1.0 with the windows.
Replicas and workers deal the order out as for every layout (`cnns.data.batches.ShardPlan`).
"""

from __future__ import annotations

import glob
import os
import re
from collections import OrderedDict
from functools import lru_cache
from pathlib import Path

import numpy as np

from cnns.data.formats.huggingface import (SPLIT_NAMES, SPLITS, Columns, HuggingFaceFiles, TableIndex, TableRecords, build_index,
                                           choose_splits, columns_of, features_of, identities, same_columns,
                                           split_named)
from cnns.errors import DataError

SUFFIX = ".parquet"
# Where `huggingface-cli download` of a dataset puts its Parquet files: the folder, data/, a split or config
# folder, or <config or data>/<split>/ (the Hub's converted layout, default/train/0000.parquet); hidden folders,
# such as its .cache/, are not looked in, nor a folder of datasets' folders.
PATTERNS = ("*.parquet", "*/*.parquet",
            *(f"*/{name}/*.parquet" for names in SPLIT_NAMES.values() for name in names))
# Row groups whose rows are shuffled together: a batch mixes rows of 8 row groups drawn from anywhere in the set
# (800 rows of datasets' 100-row groups, as many as datasets' own 1,000-row shuffle buffer mixes), and a worker's
# cache holds a window (8 x ~11 MB of ImageNet JPEGs) and the next.
WINDOW_GROUPS = 8
PIECE_CACHE_BYTES = 256 << 20  # the image columns of the row groups a worker read last, kept for its next samples


def parquet_files(folder: Path) -> dict[str, list[Path]]:
    """{"train": files, "validation": files} in `folder`, from names only: a split word leading a file's name
    (train-00000-of-00004.parquet) or naming its folder (train/0000.parquet). Files that name no split are a
    single unsplit set, read as both splits, where no file names one."""
    if not folder.is_dir():
        return {}
    found = sorted({Path(folder, name) for pattern in PATTERNS for name in glob.glob(pattern, root_dir=folder)})
    named: dict[str, list[Path]] = {}
    unnamed: list[Path] = []
    for path in found:
        if split_named(path.name) is not None:  # train-00000-of-00004.parquet
            word = re.split(r"[-_.]", path.name.lower())[0]
        elif path.parent != folder and split_named(path.parent.name) is not None:  # train/0000.parquet
            word = path.parent.name.lower()
        else:
            unnamed.append(path)
            continue
        named.setdefault(word, []).append(path)
    chosen = choose_splits(named)
    if not chosen and unnamed:
        chosen = {split: unnamed for split in SPLITS}
    return chosen


def open_parquet(path: str):
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except Exception as error:  # pyarrow's ArrowInvalid / OSError for a file that is not Parquet or is cut short
        raise DataError(f"{path}: not a readable Parquet file ({str(error).splitlines()[0]})") from None


def index_split(files: list[Path]) -> TableIndex:
    return _cached_index(identities(files))


@lru_cache(maxsize=4)  # a run's two splits: the class count, the checks and the loader index each once
def _cached_index(files: tuple[tuple[str, int, int], ...]) -> TableIndex:
    columns: Columns | None = None
    pieces = []
    for path, *_ in files:
        parquet = open_parquet(path)
        schema = parquet.schema_arrow
        found = columns_of(features_of(schema), schema.names, path)
        if columns is None:
            columns = found
        same_columns(columns, found, path)
        labels_type = schema.field(found.label).type
        if not str(labels_type).startswith(("int", "uint")):
            raise DataError(f"{path}: its label column {found.label!r} holds {labels_type}, not class numbers")
        try:
            pieces.append([parquet.read_row_group(group, columns=[found.label], use_threads=False).column(0)
                           .fill_null(-1).to_numpy()
                           for group in range(parquet.metadata.num_row_groups)])
        except OSError as error:
            raise DataError(f"{path}: not a readable Parquet file ({str(error).splitlines()[0]})") from None
    return build_index([path for path, *_ in files], columns, pieces)


# --- In each process that reads images


class _PieceCache:
    """The image columns of the row groups this process read last, up to PIECE_CACHE_BYTES."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.pieces: OrderedDict[tuple[str, int], object] = OrderedDict()  # pyarrow BinaryArrays
        self.files: dict[str, object] = {}
        self.bytes = 0

    def images(self, path: str, group: int, column: str):
        if self.pid != os.getpid():  # a forked worker: its parent's open files are not its own
            self.__init__()
        key = (path, group)
        found = self.pieces.get(key)
        if found is not None:
            self.pieces.move_to_end(key)
            return found
        parquet = self.files.get(path) or self.files.setdefault(path, open_parquet(path))
        nested = str(parquet.schema_arrow.field(column).type).startswith("struct")
        try:
            # One thread: a worker is one core's, and pyarrow's own pool competes with the other workers and the
            # model for the same cores (docs/performance.md, "Input pipeline by layout", has the measured cost).
            table = parquet.read_row_group(group, columns=[f"{column}.bytes" if nested else column], use_threads=False)
        except OSError as error:
            raise DataError(f"{path}: row group {group} cannot be read ({str(error).splitlines()[0]})") from None
        array = table.column(0).combine_chunks()
        found = array.field("bytes") if nested else array  # rows become bytes only when read (`read_image`)
        self.pieces[key] = found
        self.bytes += found.nbytes
        while self.bytes > PIECE_CACHE_BYTES and len(self.pieces) > 1:
            _, dropped = self.pieces.popitem(last=False)
            self.bytes -= dropped.nbytes
        return found


_CACHE = _PieceCache()


def read_image(path: str, group: int, column: str, row: int) -> bytes | None:
    return _CACHE.images(path, group, column)[row].as_py()


class ParquetRecords(TableRecords):
    def training_order(self, indices: np.ndarray, seed: int, epoch: int) -> np.ndarray:
        return window_order(indices, self.index.piece_ids, self.index.piece_count, WINDOW_GROUPS, seed, epoch)


def window_order(indices: np.ndarray, piece_ids: np.ndarray, pieces: int, window: int, seed: int,
                 epoch: int) -> np.ndarray:
    """`indices` in an order drawn from (seed, epoch): the pieces (row groups; `piece_ids` each row's) shuffled and
    taken `window` at a time, the rows of each window in a uniformly random order."""
    from cnns.data.batches import mix_seed

    rng = np.random.Generator(np.random.PCG64(mix_seed(seed, epoch)))
    place = np.empty(pieces, dtype=np.int64)
    place[rng.permutation(pieces)] = np.arange(pieces)
    return indices[np.lexsort((rng.random(len(indices)), place[piece_ids[indices]] // window))]


class HubParquet(HuggingFaceFiles):
    name = "huggingface-parquet"
    reads = "the Parquet row's image bytes"
    files = "Hugging Face Parquet shards (data/train-*.parquet)"

    def recognise(self, folder: Path) -> bool:
        return bool(parquet_files(folder))

    def files_of(self, folder: Path, split: str) -> list[Path]:
        found = parquet_files(folder).get(split)
        if not found:
            raise DataError(f"{folder}: no {split} Parquet files (data/{split}-00000-of-00001.parquet, or "
                            f"{split}/*.parquet{'; a test split stands in where there is no validation split' if split == 'validation' else ''})")
        return found

    def splits_present(self, folder: Path) -> list[str]:
        return [split for split in SPLITS if parquet_files(folder).get(split)]

    def index(self, folder: Path, split: str) -> TableIndex:
        return index_split(self.files_of(folder, split))

    def records(self, folder: Path, split: str, size_limit: int | None = None) -> ParquetRecords:
        return ParquetRecords(self.index(folder, split), str(folder), self.classes(folder), size_limit, read_image)


HF_PARQUET = HubParquet()
