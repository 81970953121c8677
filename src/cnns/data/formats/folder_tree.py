"""ImageNet as a folder tree of image files, ``train/<class>/*.JPEG`` and ``validation/<class>/*`` (or ``val/``),
as torchvision's ImageFolder reads it (`cnns.data.imagefolder`): the classes are the sorted class folders."""

from __future__ import annotations

from pathlib import Path

from cnns.data.formats.base import TrainingBatch
from cnns.data.formats.imagenet import ImageNetFiles
from cnns.errors import DataError


class FolderTree(ImageNetFiles):
    name = "folder"
    reads = "the file's bytes"
    files = "JPEG folders (train/<class>/)"
    image_folder = True

    def recognise(self, folder: Path) -> bool:
        """train/, validation/ or val/ with class sub-folders."""
        return self.split_classes(folder) is not None

    def records(self, folder: Path, split: str, size_limit: int | None = None):
        from cnns.data.imagefolder import ImageFolderDataset

        return ImageFolderDataset(folder, split, size_limit=size_limit)

    @staticmethod
    def split_classes(folder: Path) -> tuple[list[str], list[str] | None] | None:
        """(training classes, validation classes or None), from folder names alone; None when `folder` holds
        no split folder with class sub-folders."""
        from cnns.data.imagefolder import find_split_folder, list_classes

        if not folder.is_dir():
            return None
        train, validation = (find_split_folder(folder, split) for split in ("train", "validation"))
        train_classes = list_classes(train) if train is not None else None
        validation_classes = list_classes(validation) if validation is not None else None
        if not train_classes and not validation_classes:
            return None
        # The class index is the training folder's wherever there is one (ImageFolderDataset's rule).
        return (train_classes if train is not None else validation_classes), validation_classes

    def classes(self, folder: Path) -> int:
        """Its class folders, from their names alone (the training folder's, else the validation folder's)."""
        found = self.split_classes(folder)
        return len(found[0]) if found is not None and found[0] else self.dataset.num_classes

    def class_names(self, folder: Path | None) -> tuple[list[str], str] | None:
        """The class folders' names, sorted: the dataset's class index (the training folder's when there is one)."""
        from cnns.data.imagefolder import find_split_folder, list_classes

        for split in ("train", "validation") if folder is not None else ():
            split_folder = find_split_folder(folder, split)
            if split_folder is not None:
                names = list_classes(split_folder)
                if names:
                    return names, f"the class folders of {split_folder}"
        return None

    def check(self, folder: Path, splits: list[str], batch: TrainingBatch, *, decode: bool,
              size_limit: int | None) -> None:
        """The validation classes are the training ones; with `decode`, the first image of each split is read
        (within --max-file-size) and decoded. Without it (--skip-corrupt-images) the first image is not read:
        training leaves it out if it cannot be read."""
        from cnns.bounded_reads import read_bounded

        check_same_classes(self.split_classes(folder), folder)
        for split in splits:
            first = check_image_folder_split(folder, split, batch if split == "train" else None)
            if decode:
                self.check_first_image(read_bounded(first, size_limit), str(first))


def check_same_classes(found: tuple[list[str], list[str] | None] | None, folder: Path) -> None:
    """DataError naming the difference when a folder tree's validation classes are not its training ones
    (the class index is the position in the sorted training classes: a difference shifts every label)."""
    if found is None or found[1] is None or found[0] == found[1]:
        return
    train, validation = (set(names) for names in found)
    parts = [f"{_first_few(only)} only in {where}"
             for only, where in ((validation - train, "validation"), (train - validation, "training")) if only]
    raise DataError(f"{folder}: the validation folder's classes differ from the training folder's ({'; '.join(parts)})")


def _first_few(names: set[str], shown: int = 3) -> str:
    ordered = sorted(names)
    return ", ".join(ordered[:shown]) + (f" and {len(ordered) - shown} more" if len(ordered) > shown else "")


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


FOLDER_TREE = FolderTree()
