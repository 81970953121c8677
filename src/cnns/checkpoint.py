"""Checkpoints: atomic saves of the full training state, weights-only loading.

A checkpoint ``ckpt-<iteration>.pt`` is a dict that `torch.load(path, weights_only=True)` reads:
``"model"`` is the plain model state dict (the keys of a single-process run, no wrapper prefixes);
the other entries hold what `restore.py` needs to continue exactly: optimiser, loss scaler, random
states, iteration, and the options of the run. Nothing in a checkpoint is ever executed.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch

from cnns.errors import CheckpointError

CHECKPOINT_PATTERN = re.compile(r"^ckpt-(\d+)\.pt$")


def checkpoint_path(folder: Path, iteration: int) -> Path:
    return Path(folder) / f"ckpt-{iteration}.pt"


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Write to a temporary file in the same folder, fsync, then rename over the final name.

    A crash mid-write leaves at worst a stray temporary file, never a truncated ``ckpt-*``.
    """
    path = Path(path)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise


def load_checkpoint(path: Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load with weights_only=True; a missing, truncated or foreign file is a CheckpointError."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint not found: {path}")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # torch raises many types for corrupt files; all mean the same to a user
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"cannot read checkpoint {path}: {reason[:200]}") from None
    if not isinstance(state, dict) or "model" not in state or not isinstance(state["model"], dict):
        raise CheckpointError(f"{path} is not a cnns checkpoint (no 'model' state dict)")
    return state


def list_checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """Training checkpoints of a run folder as (iteration, path), oldest first."""
    found = []
    for entry in Path(folder).iterdir():
        match = CHECKPOINT_PATTERN.match(entry.name)
        if match and entry.is_file():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def iteration_of(path: Path) -> int:
    """Iteration in a checkpoint's name, -1 for other files (e.g. weight averages)."""
    match = CHECKPOINT_PATTERN.match(Path(path).name)
    return int(match.group(1)) if match else -1


def capture_rng_state(generators: dict[str, torch.Generator] | None = None) -> dict[str, Any]:
    """Every random state a run depends on, as tensors (weights_only-loadable)."""
    import random

    import numpy as np

    py_state = random.getstate()
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": [py_state[0], list(py_state[1]), py_state[2]],
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype("int64")), *np_state[2:]],
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    for name, generator in (generators or {}).items():
        state[f"gen:{name}"] = generator.get_state()
    return state


def restore_rng_state(state: dict[str, Any], generators: dict[str, torch.Generator] | None = None) -> None:
    import random

    import numpy as np

    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    for name, generator in (generators or {}).items():
        if f"gen:{name}" in state:
            generator.set_state(state[f"gen:{name}"])
