"""The class names a run's predictions are read with: from the run's data folder, where it is still there."""

from __future__ import annotations

import sys
from pathlib import Path

from cnns.config import RunConfig
from cnns.data import formats


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

    Where the run's data format carries them (`cnns.data.formats.class_names`: CIFAR's name lists as the
    official archives ship them, the built-in set's shape names, a folder tree's class folders) and the run's
    data folder is still there; a list with the wrong number of names is not trusted. Otherwise None."""
    count = int(cfg.model.num_classes)
    folder = data_folder(cfg, run_folder)
    found = formats.class_names(cfg.data.dataset, folder)
    if found is None:
        return None, "none (class indices)"
    names, source = found
    if len(names) != count:
        print(f"notice: {source} lists {len(names)} class names for a {count}-class model: "
              "printing class indices instead", file=sys.stderr)
        return None, "none (class indices)"
    return names, source
