"""What a data format is to the rest of cnns: a dataset's facts and the interface every format's module fills.

A `Dataset` is what `--dataset` names (its class count, whether its images are CIFAR-sized, the epoch of
generated or synthetic data, the words that name it in a folder's path); a `DataFormat` is one way its files
are laid out (CIFAR's binary records, ImageNet's TFRecords or folder tree, the built-in set), which
recognises a folder from its file names, checks it before anything is written, counts and names its classes
and builds its batch sources. `cnns.data.formats` lists the formats and picks a run's; an ImageNet layout hands
the loader its reader (`ImageNetFiles.records`), so no other module asks which layout a folder holds.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Protocol

import torch

from cnns.errors import DataError

if TYPE_CHECKING:
    from cnns.data.data_config import DataConfig


@dataclass(frozen=True)
class Dataset:
    """A dataset `--dataset` names: its facts, the same for every layout of its files."""

    name: str  # as --dataset, arguments.json and messages name it
    num_classes: int  # the model's outputs unless --num-classes (or a folder tree's class folders) says
    cifar_sized: bool  # 32x32 images: CIFAR's model defaults, and no --image-size but 32
    train_images: int  # an epoch of generated or synthetic data: Graphcore's application's sizes
    eval_images: int
    path_words: tuple[str, ...]  # Graphcore's rule: a data folder whose path holds one of these is this dataset
    default_data_dir: str | None = None  # where its files are when --data-dir is not given (the built-in set's)

    def named_in(self, path: str) -> int:
        """The length of the longest of its words in `path` (lower-cased), 0 when none is: the longest match
        decides, so "cifar-100" is CIFAR-100's although "cifar" is CIFAR-10's."""
        lowered = path.lower()
        return max((len(word) for word in self.path_words if word in lowered), default=0)


class BatchSource(Protocol):
    """Every source yields (uint8 NHWC images, int64 labels) batches: `len(source)` batches per epoch,
    `source.epoch(e, start_batch)` and `source.num_samples`."""

    num_samples: int

    def __len__(self) -> int: ...

    def epoch(self, epoch: int, start_batch: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]: ...


@dataclass(frozen=True)
class SourceRequest:
    """What a run asks of its data besides the DataConfig: batch sizes, its seed and shard, which splits."""

    micro_batch_size: int
    eval_batch_size: int
    seed: int
    device: torch.device
    shard: tuple[int, int] = (0, 1)  # (replica rank, replicas)
    need_train: bool = True
    need_eval: bool = True
    # micro-batch x accumulation x replicas: every training epoch a whole number of global batches
    # (cnns.data.batches.ShardPlan); None keeps whole micro-batch groups only
    global_batch_size: int | None = None
    # images/s the run's training step is estimated to take, asked only where --decode-device auto weighs it
    # against the CPU decoder's rate (`cnns.data.decoding.choose_from_rates`); None where no step runs
    step_rate: Callable[[], float] | None = None


@dataclass(frozen=True)
class FormatSources:
    """A format's sources for one run: None for a split not asked for; `decoding` a line for the run's header
    (how the images are decoded, where that is a choice)."""

    train: BatchSource | None
    eval: BatchSource | None
    decoding: str | None = None


@dataclass(frozen=True)
class TrainingBatch:
    """What one training update takes from the training set: the global batch, after --dataset-percentage-to-use
    has kept its share of the images."""

    size: int
    description: str  # how the size is made up, for the error message
    percentage: int

    @classmethod
    def of(cls, micro_batch_size: int, accumulation: int, replicas: int, percentage: int) -> "TrainingBatch":
        parts = [f"micro-batch {micro_batch_size}"]
        if accumulation > 1:
            parts.append(f"accumulation {accumulation}")
        if replicas > 1:
            parts.append(f"replicas {replicas}")
        size = micro_batch_size * accumulation * replicas
        description = (f"one batch of {size}" if len(parts) == 1 else
                       f"one global batch of {size} ({' x '.join(parts)})")
        return cls(size, description, percentage)

    def kept(self, images: int) -> int:
        """The images of a class (or a whole set) that --dataset-percentage-to-use keeps: at least one of any."""
        return images if self.percentage >= 100 or images == 0 else max(1, images * self.percentage // 100)

    def images_needed(self) -> int:
        """The fewest images of which the kept share holds one batch."""
        if self.percentage >= 100 or self.size <= 1:
            return self.size
        return -(-(self.size * 100) // self.percentage)

    def check_fits(self, kept: int, images: int, where: Path) -> None:
        if kept >= self.size:
            return
        share = "" if self.percentage >= 100 else f" ({kept} with --dataset-percentage-to-use {self.percentage})"
        raise DataError(f"the training set in {where} has {images} images{share}, fewer than {self.description}: "
                        "give a smaller --micro-batch-size")


class DataFormat(ABC):
    """One layout of a dataset's files. A format's module subclasses this and `cnns.data.formats.FORMATS` lists
    its instance; each method reads only file names unless it says otherwise."""

    name: str  # how bench-data and messages name the layout: "cifar-10", "tfrecord", "folder", ...
    dataset: Dataset
    # Its images decoded by --pipeline-num-parallel worker processes (what --dataset-benchmark times per worker
    # core), rather than batches made in the main process from the data held in memory.
    decoded_in_workers: bool = False
    reads: str = ""  # what reading one image is, as `cnns bench-data`'s account names it
    files: str = ""  # what its files look like, for the line naming what a folder lacks
    image_folder: bool = False  # torchvision's ImageFolder reads it as it is (bench-data's --compare-baseline)
    # Named only: never recognised from a folder's contents (the built-in set is CIFAR-10's files).
    named_only: bool = False
    # Its --data-dir may name files rather than a folder (a shard file, a glob, a brace pattern, a list).
    names_files: bool = False

    @abstractmethod
    def recognise(self, folder: Path) -> bool:
        """Whether `folder` holds this format's files, from their names alone."""

    def missing(self, folder: Path) -> str:
        """The one line when `folder` was named as holding this format and does not."""
        return f"no {self.name} files found in {folder}"

    def prepare(self, folder: Path) -> Path:
        """The folder the files are read from, made ready: as it is, but for a format that writes its files on
        first use (the built-in set)."""
        return folder

    def classes(self, folder: Path) -> int:
        """The classes its labels can take here (a folder tree counts its class folders); the dataset's."""
        return self.dataset.num_classes

    def class_names(self, folder: Path | None) -> tuple[list[str], str] | None:
        """(names in class-index order, where they come from), where the files carry them; None otherwise."""
        return None

    @abstractmethod
    def check(self, folder: Path, splits: list[str], batch: TrainingBatch, *, decode: bool,
              size_limit: int | None) -> None:
        """Every error that can be found cheaply before a run folder is written, for `splits` ("train",
        "validation"): the split's files are there and readable, the training set holds `batch`, and with
        `decode` the first image decodes. Cheap means a start-up on the whole of ImageNet stays quick."""

    @abstractmethod
    def sources(self, data: "DataConfig", folder: Path, request: SourceRequest) -> FormatSources:
        """The run's training and evaluation batch sources for its shard."""
