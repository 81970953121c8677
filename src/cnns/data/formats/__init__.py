"""The data formats, one module each behind one interface (`base.DataFormat`), and the one place that asks which
a run's data is in.

Adding a format is a module of its own and a line in `FORMATS`: the `--dataset` choices, its model defaults
(CIFAR-sized or not), the class count, the folder's recognition, the checks made before anything is written,
the batch sources, the class names predictions print and what `--dataset-benchmark` times all read it. An
image format hands the loader its reader (`records`): the loader (`cnns.data.image_loader`) and `cnns bench-data`
read images through it and never ask which layout a folder holds.
"""

from __future__ import annotations

import os
from pathlib import Path

from cnns.data.formats.base import (BatchSource, DataFormat, Dataset, FormatSources, SourceRequest,
                                    TrainingBatch)
from cnns.data.formats.builtin import BUILTIN_SHAPES
from cnns.data.formats.cifar import CIFAR_10_BINARY, CIFAR_100_BINARY
from cnns.data.formats.folder_tree import FOLDER_TREE
from cnns.data.formats.huggingface_arrow import HF_ARROW
from cnns.data.formats.huggingface_parquet import HF_PARQUET
from cnns.data.formats.imagenet import IMAGENET
from cnns.data.formats.tfrecord import TFRECORDS
from cnns.data.formats.webdataset import WEBDATASET
from cnns.errors import ConfigError, DataError

# In the order a folder's contents are tried: CIFAR-10 wins over CIFAR-100 in a folder holding both, and
# shards (TFRecords, WebDataset tars, Hugging Face's Parquet and save_to_disk files) over a folder tree.
FORMATS: tuple[DataFormat, ...] = (CIFAR_10_BINARY, CIFAR_100_BINARY, TFRECORDS, WEBDATASET, HF_PARQUET, HF_ARROW,
                                   FOLDER_TREE, BUILTIN_SHAPES)

# What --dataset names, each once, in the order of `FORMATS`.
DATASETS: dict[str, Dataset] = {f.dataset.name: f.dataset for f in FORMATS}

# Where the dataset is not known yet (a folder whose path and contents name none), its defaults are CIFAR-10's.
UNNAMED = DATASETS["cifar-10"]

__all__ = ["BatchSource", "CIFAR_10_BINARY", "DATASETS", "DataFormat", "Dataset", "FOLDER_TREE", "FORMATS", "IMAGENET", "FormatSources", "SourceRequest",
           "TrainingBatch", "check_data", "class_names", "classes_in_folder", "dataset_facts",
           "dataset_named_in_path", "find_format", "format_of_folder", "formats_of", "missing_line", "records_in"]


def dataset_facts(name: str | None) -> Dataset:
    """The facts of the dataset `name` (CIFAR-10's for None: a dataset not known yet has CIFAR's defaults)."""
    return DATASETS[name] if name is not None else UNNAMED


def formats_of(dataset: str | None) -> list[DataFormat]:
    """The formats a folder of `dataset` may hold (every one recognised from its contents when None)."""
    return [f for f in FORMATS if f.dataset.name == dataset or (dataset is None and not f.named_only)]


def dataset_named_in_path(path: str) -> str | None:
    """Graphcore's application's rule: the dataset is named in the folder's path (the longest name found).
    Contents are checked later."""
    best = max(DATASETS.values(), key=lambda dataset: dataset.named_in(str(path)))
    return best.name if best.named_in(str(path)) else None


def format_of_folder(folder: str | os.PathLike | None, dataset: str | None = None) -> DataFormat | None:
    """The format `folder` holds, from its file names only (no data is read): the first of `dataset`'s formats
    (of any dataset for None) that recognises it; None when none does or the folder is not there. A --data-dir
    that is not a folder (a file, a glob, a list) is asked of the formats that take one (`names_files`)."""
    if not folder:
        return None
    is_folder = os.path.isdir(folder)
    return next((f for f in formats_of(dataset) if not f.named_only and (is_folder or f.names_files)
                 and f.recognise(Path(folder))), None)


def find_format(dataset: str | None, data_dir: str | os.PathLike) -> tuple[DataFormat, Path]:
    """(the format of the data in `data_dir`, the folder made ready to read), checked against the folder's
    contents; DataError naming what is missing."""
    folder = Path(data_dir)
    candidates = formats_of(dataset)
    named = next((f for f in candidates if f.named_only), None)
    if named is not None:
        return named, named.prepare(folder)
    found = format_of_folder(folder, dataset)
    if found is None and not folder.is_dir():
        raise DataError(f"data folder not found: {folder}")
    if found is not None:
        return found, found.prepare(folder)
    if dataset is not None:
        raise DataError(missing_line(candidates, folder))
    raise DataError(f"cannot infer the dataset in {folder}; name it with --dataset")


def missing_line(candidates: list[DataFormat], folder: Path) -> str:
    """The one line when `folder` holds none of a named dataset's layouts: each layout's `files`."""
    if len(candidates) == 1:
        return candidates[0].missing(folder)
    kinds = [f.files or f.name for f in candidates]
    return (f"no {candidates[0].dataset.name} files found in {folder}: expected "
            f"{', '.join(kinds[:-1])} or {kinds[-1]}")


def records_in(data_dir: str | os.PathLike, split: str, size_limit: int | None = None):
    """The reader of `split` of the images in `data_dir`, whichever layout holds them (for tools and tests:
    a run's sources come from its format's `sources`)."""
    data_format, folder = find_format(None, data_dir)
    if not data_format.decoded_in_workers:
        raise DataError(f"{folder} holds {data_format.name}, not image files read one by one")
    return data_format.records(folder, split, size_limit)


def classes_in_folder(dataset: str | None, data_dir: str | None) -> int:
    """The classes the data's labels can take, from file names only: a folder tree's class folders, else the
    dataset's count (CIFAR-10 10, CIFAR-100 100, ImageNet 1,000)."""
    found = format_of_folder(data_dir, dataset) if dataset is not None else None
    return found.classes(Path(data_dir)) if found is not None else dataset_facts(dataset).num_classes


def class_names(dataset: str | None, folder: Path | None) -> tuple[list[str], str] | None:
    """(names in class-index order, where they come from) from the run's data folder (None: no longer there),
    the first that one of the dataset's formats finds (a folder that keeps only CIFAR's name list is enough);
    None otherwise (TFRecords carry no class list the reader exposes)."""
    candidates = formats_of(dataset) if dataset is not None else [format_of_folder(folder)]
    return next((names for f in candidates if f is not None and (names := f.class_names(folder)) is not None), None)


def check_data(dataset: str | None, data_dir: str, splits: list[str], batch: TrainingBatch, *, outputs: int,
               decode: bool, size_limit: int | None) -> None:
    """Every data error that can be found cheaply, before a run folder is created: missing data, more classes
    than the model has `outputs`, and the format's own checks of the `splits` a command reads (`DataFormat.check`)."""
    data_format, folder = find_format(dataset, data_dir)
    classes = data_format.classes(folder)
    if classes > outputs:
        raise ConfigError(f"the data in {folder} has {classes} classes, more than the model's {outputs} outputs "
                          f"(--num-classes {outputs})")
    data_format.check(folder, splits, batch, decode=decode, size_limit=size_limit)
