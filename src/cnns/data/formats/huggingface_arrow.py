"""An image dataset as `datasets`' ``save_to_disk`` leaves it: a DatasetDict folder (``dataset_dict.json`` and a
folder per split) or one Dataset's folder, each holding ``data-00000-of-00001.arrow`` files (Arrow IPC streams, as
`state.json`'s ``_data_files`` lists them) beside ``dataset_info.json``, whose features name the image column (an
Image struct {bytes, path}) and the ClassLabel with its class names.

Read with pyarrow, memory-mapped, record batch by record batch: the index is the label column alone; any row is as
quick to reach as the next (the pages the map touches), so the training order is a uniform shuffle drawn from
(seed, epoch), as for a folder tree; replicas and workers deal it out as for every layout.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

from cnns.data.formats.huggingface import (SPLITS, Columns, HuggingFaceFiles, TableIndex, TableRecords, build_index,
                                           choose_splits, columns_of, features_of, identities, read_json,
                                           same_columns, split_named)
from cnns.errors import DataError

DICT_FILE, STATE_FILE, INFO_FILE = "dataset_dict.json", "state.json", "dataset_info.json"


def saved_splits(folder: Path) -> dict[str, Path]:
    """{"train": split folder, "validation": split folder} of a save_to_disk folder, from its JSON files: a
    DatasetDict's splits (dataset_dict.json), or one Dataset (state.json) as its recorded split, or both splits
    where it records none."""
    if not folder.is_dir():
        return {}
    if (folder / DICT_FILE).is_file():
        listed = read_json(folder / DICT_FILE)
        names = listed.get("splits") if isinstance(listed, dict) else None
        if not isinstance(names, list):
            raise DataError(f"{folder / DICT_FILE}: no \"splits\" list")
        return {split: place for split, place in choose_splits(
            {str(name).lower(): folder / str(name) for name in names if (folder / str(name) / STATE_FILE).is_file()}
        ).items()}
    if (folder / STATE_FILE).is_file() and (folder / INFO_FILE).is_file():
        state = read_json(folder / STATE_FILE)
        recorded = split_named(str(state.get("_split") or "")) if isinstance(state, dict) else None
        return {recorded: folder} if recorded else {split: folder for split in SPLITS}
    return {}


def arrow_files(split_folder: Path) -> list[Path]:
    """The split's Arrow files, as its state.json lists them."""
    state = read_json(split_folder / STATE_FILE)
    listed = state.get("_data_files") if isinstance(state, dict) else None
    if not isinstance(listed, list) or not listed:
        raise DataError(f"{split_folder / STATE_FILE}: no \"_data_files\" list of Arrow files")
    files = []
    for entry in listed:
        name = entry.get("filename") if isinstance(entry, dict) else None
        if not isinstance(name, str) or "/" in name or name.startswith("."):
            raise DataError(f"{split_folder / STATE_FILE}: a \"_data_files\" entry that is no file name: {entry!r}")
        files.append(split_folder / name)
    return files


def open_batches(path: str) -> list:
    """The Arrow stream's record batches, memory-mapped (no image is read until a row is)."""
    import pyarrow as pa

    try:
        return list(pa.ipc.open_stream(pa.memory_map(path)))
    except (OSError, pa.ArrowInvalid) as error:
        raise DataError(f"{path}: not a readable Arrow stream ({str(error).splitlines()[0]})") from None


def index_split(split_folder: Path) -> TableIndex:
    return _cached_index(identities(arrow_files(split_folder)), str(split_folder))


@lru_cache(maxsize=4)  # a run's two splits: the class count, the checks and the loader index each once
def _cached_index(files: tuple[tuple[str, int, int], ...], split_folder: str) -> TableIndex:
    info = read_json(Path(split_folder) / INFO_FILE)
    declared = info.get("features") if isinstance(info, dict) else None
    columns: Columns | None = None
    pieces = []
    for path, *_ in files:
        batches = open_batches(path)
        if not batches:
            pieces.append([])
            continue
        schema = batches[0].schema
        found = columns_of(features_of(schema) or declared, schema.names, path)
        if columns is None:
            columns = found
        same_columns(columns, found, path)
        if not str(schema.field(found.label).type).startswith(("int", "uint")):
            raise DataError(f"{path}: its label column {found.label!r} holds {schema.field(found.label).type}, "
                            "not class numbers")
        pieces.append([batch.column(found.label).fill_null(-1).to_numpy() for batch in batches])
    if columns is None:
        columns = columns_of(declared, [], split_folder)
    return build_index([path for path, *_ in files], columns, pieces)


class _Mapped:
    """The record batches of the Arrow files this process reads, memory-mapped once each."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.files: dict[str, list] = {}

    def batch(self, path: str, number: int):
        if self.pid != os.getpid():  # a forked worker maps the files itself
            self.__init__()
        batches = self.files.get(path)
        if batches is None:
            batches = self.files[path] = open_batches(path)
        return batches[number]


_MAPPED = _Mapped()


def read_image(path: str, batch: int, column: str, row: int) -> bytes | None:
    images = _MAPPED.batch(path, batch).column(column)
    if str(images.type).startswith("struct"):
        images = images.field("bytes")
    return images[row].as_py()


class SavedToDisk(HuggingFaceFiles):
    name = "huggingface-arrow"
    reads = "the Arrow row's image bytes"
    files = "a Hugging Face save_to_disk folder (dataset_dict.json, train/state.json)"

    def recognise(self, folder: Path) -> bool:
        try:
            return bool(saved_splits(folder))
        except DataError:
            return True  # its JSON files are save_to_disk's: the checks name what is wrong with them

    def split_folder(self, folder: Path, split: str) -> Path:
        found = saved_splits(folder).get(split)
        if found is None:
            raise DataError(f"{folder}: no {split} split in the saved dataset"
                            f"{' (a test split stands in where there is no validation split)' if split == 'validation' else ''}")
        return found

    def splits_present(self, folder: Path) -> list[str]:
        return [split for split in SPLITS if split in saved_splits(folder)]

    def index(self, folder: Path, split: str) -> TableIndex:
        return index_split(self.split_folder(folder, split))

    def records(self, folder: Path, split: str, size_limit: int | None = None) -> TableRecords:
        return TableRecords(self.index(folder, split), str(folder), self.classes(folder), size_limit, read_image)


HF_ARROW = SavedToDisk()
