"""The class names a run's predictions are read with: from the run's data folder, where it is still there."""

from __future__ import annotations

import sys
from pathlib import Path

from cnns.config import RunConfig


def data_folder(cfg: RunConfig, run_folder: Path | None = None) -> Path | None:
    """The run's data folder, if it is still there. arguments.json keeps --data-dir as it was given:
    a relative one is tried from here, then from where training ran (the run folder is
    <training directory>/<--log-dir>/<run name> unless --logs-path placed it elsewhere)."""
    if cfg.data.source != "files" or not cfg.data.data_dir:
        return None
    folder = Path(cfg.data.data_dir)
    candidates = [folder]
    log_dir = Path(cfg.log.log_dir) if cfg.log.log_dir else None
    if (not folder.is_absolute() and run_folder is not None and log_dir is not None and not log_dir.is_absolute()
            and not cfg.log.logs_path):
        up = len(log_dir.parts) + 1
        parents = run_folder.resolve().parents
        if up <= len(parents) - 1:
            candidates.append(parents[up - 1] / folder)
    return next((candidate for candidate in candidates if candidate.is_dir()), None)


def class_names(cfg: RunConfig, run_folder: Path | None = None) -> tuple[list[str] | None, str]:
    """(names in class-index order or None, where they come from).

    CIFAR-10's ``batches.meta.txt`` and CIFAR-100's ``fine_label_names.txt`` (as the official binary
    archives ship them) from the run's data folder or its archive subfolder; the built-in dataset's
    shape names; an ImageNet JPEG tree's class folder names (sorted: the dataset's class index).
    TFRecords carry no class list that the reader exposes, and a list with the wrong number of names
    is not trusted: then, and when the run's data folder is not there, None."""
    from cnns.data.builtin import BUILTIN_CLASSES

    count = int(cfg.model.num_classes)
    dataset = cfg.data.dataset
    if dataset == "builtin":
        return list(BUILTIN_CLASSES), "the built-in dataset"
    folder = data_folder(cfg, run_folder)
    if folder is None:
        return None, "none (class indices)"
    found: tuple[list[str], str] | None = None
    if dataset in ("cifar-10", "cifar-100"):
        found = _cifar_names(folder, dataset)
    elif dataset == "imagenet":
        found = _jpeg_tree_names(folder)
    if found is None:
        return None, "none (class indices)"
    names, source = found
    if len(names) != count:
        print(f"notice: {source} lists {len(names)} class names for a {count}-class model: "
              "printing class indices instead", file=sys.stderr)
        return None, "none (class indices)"
    return names, source


def _cifar_names(folder: Path, dataset: str) -> tuple[list[str], str] | None:
    filename, subfolder = (("batches.meta.txt", "cifar-10-batches-bin") if dataset == "cifar-10"
                           else ("fine_label_names.txt", "cifar-100-binary"))
    for place in (folder, folder / subfolder):
        path = place / filename
        if path.is_file():
            try:
                text = path.read_text(encoding="utf-8", errors="replace")
            except OSError:
                return None
            # The archives end the list with blank lines (and some copies with trailing spaces).
            return [line.strip() for line in text.splitlines() if line.strip()], str(path)
    return None


def _jpeg_tree_names(folder: Path) -> tuple[list[str], str] | None:
    from cnns.data.imagefolder import find_split_folder, list_classes

    # The dataset numbers classes by the training folder's sub-folders when there is one.
    for split in ("train", "validation"):
        split_folder = find_split_folder(folder, split)
        if split_folder is not None:
            names = list_classes(split_folder)
            if names:
                return names, f"the class folders of {split_folder}"
    return None
