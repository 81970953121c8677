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

    def classes(self, folder: Path) -> int:
        """Its class folders, from their names alone (the training folder's, else the validation folder's)."""
        from cnns.data.imagenet import folder_tree_classes

        found = folder_tree_classes(folder)
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
        from cnns.bounded import read_bounded
        from cnns.data.imagenet import check_same_classes

        check_same_classes(folder)
        for split in splits:
            first = check_image_folder_split(folder, split, batch if split == "train" else None)
            if decode:
                self.check_first_image(read_bounded(first, size_limit), str(first))


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
