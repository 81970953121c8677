"""The built-in dataset: ten classes of drawn shapes in CIFAR-10's binary format (`cnns.data.drawn_shapes`), written on
first use into its folder, so that every command runs with no download."""

from __future__ import annotations

from pathlib import Path

from cnns.data.drawn_shapes import BUILTIN_CLASSES, TEST_IMAGES, TRAIN_IMAGES
from cnns.data.formats.base import Dataset
from cnns.data.formats.cifar import CifarBinary

BUILTIN = Dataset("builtin", num_classes=len(BUILTIN_CLASSES), cifar_sized=True, train_images=TRAIN_IMAGES,
                  eval_images=TEST_IMAGES,
                  path_words=("builtin",), default_data_dir="data/builtin")


class BuiltinShapes(CifarBinary):
    named_only = True  # its files are CIFAR-10's: a folder of them is recognised as CIFAR-10

    def __init__(self):
        super().__init__(BUILTIN, records="cifar-10")

    def recognise(self, folder: Path) -> bool:
        return True  # made on first use (`prepare`)

    def prepare(self, folder: Path) -> Path:
        from cnns.data.drawn_shapes import ensure_builtin_dataset

        return ensure_builtin_dataset(folder)

    def class_names(self, folder: Path | None) -> tuple[list[str], str] | None:
        return list(BUILTIN_CLASSES), "the built-in dataset"


BUILTIN_SHAPES = BuiltinShapes()
