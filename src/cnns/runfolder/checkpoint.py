"""Checkpoints: atomic saves of the full training state, weights-only loading.

A checkpoint ``ckpt-<iteration>.pt`` is a dict that `torch.load(path, weights_only=True)` reads:
``"model"`` is the plain model state dict (the keys of a single-process run, no wrapper prefixes);
the other entries hold what `restore.py` needs to continue exactly: optimiser, loss scaler, random
states, iteration, and the options of the run. Nothing in a checkpoint is ever executed.
"""

from __future__ import annotations

import re
import zipfile
from pathlib import Path
from typing import Any

import torch

from cnns.errors import CheckpointError, WriteError, reason
from cnns.safe_writes import write_atomically

CHECKPOINT_PATTERN = re.compile(r"^ckpt-(\d+)\.pt$")
WEIGHT_AVERAGE_GLOB = "weight_avg*.pt"


def checkpoint_path(folder: Path, iteration: int) -> Path:
    return Path(folder) / f"ckpt-{iteration}.pt"


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Written atomically (`cnns.safe_writes.write_atomically`): a full disk, a quota or a crash mid-write leaves the
    previous checkpoints as they were and no partial ``ckpt-*``; the failure is a CheckpointError of one line."""
    path = Path(path)
    try:
        write_atomically(path, lambda file: torch.save(state, file))
    except WriteError as exc:
        raise CheckpointError(f"cannot write checkpoint {path}: {reason(exc.cause)}; "
                              "the previous checkpoints are intact") from None


def load_checkpoint(path: Path, map_location: str | torch.device = "cpu", *, mmap: bool = False) -> dict[str, Any]:
    """Load with weights_only=True; a missing, truncated, corrupt or foreign file is a CheckpointError.

    The zip records' CRCs are checked first (torch.load does not), so damaged bytes inside a tensor
    are an error rather than wrong weights. `mmap=True` maps the tensors instead of reading them: a
    cheap way to check, before a command writes anything, that a file is a whole checkpoint and to
    compare its keys and shapes with a model.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint not found: {path}")
    whole_archive = _check_records(path)
    try:
        state = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as exc:  # torch raises many types for corrupt files; all mean the same to a user
        raise CheckpointError(f"cannot read checkpoint {path}: {_unreadable_reason(exc, whole_archive)}") from None
    if not isinstance(state, dict) or not _is_state_dict(state.get("model")):
        raise CheckpointError(f"{path} is not a cnns checkpoint (no 'model' state dict)")
    for key, kinds in _ENTRY_TYPES.items():
        if key in state and not (isinstance(state[key], kinds) and not isinstance(state[key], bool)):
            raise CheckpointError(f"{path} is not a cnns checkpoint: its {key!r} entry is a "
                                  f"{type(state[key]).__name__}, not {' or '.join(k.__name__ for k in kinds)}")
    if "ema" in state and not _is_state_dict(state["ema"]):
        raise CheckpointError(f"{path} is not a cnns checkpoint: its 'ema' entry is not a state dict")
    return state


# The other entries that restore.py and validation.py read, when present, and their types.
_ENTRY_TYPES: dict[str, tuple[type, ...]] = {
    "iteration": (int,), "epoch": (int, float), "seed": (int,), "replicas": (int,),
    "optimiser": (dict,), "loss_scaler": (dict,), "rng": (dict,),
}


def _check_records(path: Path) -> bool:
    """torch.load does not check the CRC-32 that a checkpoint's zip archive keeps of each record, so
    bytes damaged inside a tensor would load as wrong weights: check them (one CRC pass over bytes torch.load
    reads anyway).
    Returns whether the file is a whole zip archive; one that is not (truncated, random bytes, the
    legacy format) is left to torch.load."""
    # zipfile, like torch.load, raises many types for damaged bytes (BadZipFile, zlib.error, EOFError,
    # NotImplementedError for a flipped compression method, RuntimeError for a flipped encryption flag).
    try:
        archive = zipfile.ZipFile(path)
    except Exception:  # noqa: BLE001 - not a readable zip archive
        return False
    with archive:
        try:
            damaged = archive.testzip()  # the first record whose bytes do not match their CRC
        except Exception as exc:  # noqa: BLE001
            raise CheckpointError(f"cannot read checkpoint {path}: the file is corrupt "
                                  f"({_unreadable_reason(exc, True)})") from None
    if damaged is not None:
        raise CheckpointError(f"cannot read checkpoint {path}: the file is corrupt "
                              f"(record {damaged!r} does not match its CRC)")
    return True


def _unreadable_reason(exc: Exception, whole_archive: bool) -> str:
    """torch's messages for a damaged file are long and internal; say what they mean."""
    text = str(exc).strip()
    if "Weights only load failed" in text:
        return "it holds objects other than tensors, refused by weights_only loading"
    if not whole_archive or "central directory" in text or "zip archive" in text or "mmap can only be used" in text:
        # torch's own words for these vary: "failed finding central directory", "[Errno 22] Invalid
        # argument" (a third of a file), "invalid load key" (random bytes read as a legacy pickle).
        return "the file is truncated or is not a PyTorch checkpoint"
    return (text.splitlines()[0] if text else type(exc).__name__)[:200]


def _is_state_dict(value: Any) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) and torch.is_tensor(v) for k, v in value.items())


def check_matches_model(path: Path, state_dict: dict[str, torch.Tensor], model_state: dict[str, torch.Tensor],
                        what: str) -> None:
    """Same keys and shapes as the model's state dict, or a CheckpointError naming the first difference."""
    missing = [k for k in model_state if k not in state_dict]
    unexpected = [k for k in state_dict if k not in model_state]
    if missing or unexpected:
        detail = f"missing {missing[0]!r}" if missing else f"unexpected {unexpected[0]!r}"
        raise CheckpointError(f"{path} does not match the model {what}: {detail} "
                              f"({len(missing)} missing, {len(unexpected)} unexpected keys)")
    for key, tensor in model_state.items():
        if state_dict[key].shape != tensor.shape:
            raise CheckpointError(f"{path} does not match the model {what}: {key} has shape "
                                  f"{tuple(state_dict[key].shape)}, the model {tuple(tensor.shape)}")


def list_checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """Training checkpoints of a run folder as (iteration, path), oldest first."""
    found = []
    for entry in Path(folder).iterdir():
        match = CHECKPOINT_PATTERN.match(entry.name)
        if match and entry.is_file():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def list_weight_averages(folder: Path) -> list[Path]:
    """Averaged weights written by weight_avg.py or --weight-avg-N/--weight-avg-exp, by name."""
    return sorted(p for p in Path(folder).glob(WEIGHT_AVERAGE_GLOB) if p.is_file())


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


def restore_rng_state(state: dict[str, Any], generators: dict[str, torch.Generator] | None = None) -> list[str]:
    """Every random state of `capture_rng_state` back in place; the lines to tell the user when the
    checkpoint's CUDA streams cannot all be carried (written on another GPU count, or on a CPU host:
    a GPU's streams then stay as the run's seed made them; exactness is for the same devices)."""
    import random

    import numpy as np

    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, cached))
    notes = []
    if torch.cuda.is_available():
        saved, here = state.get("cuda") or [], torch.cuda.device_count()
        for index, cuda_state in enumerate(saved[:here]):
            torch.cuda.set_rng_state(cuda_state, index)
        if len(saved) != here:
            notes.append(f"the checkpoint holds the random streams of {len(saved)} GPUs, this machine has {here}: "
                         "the others continue from the run's seed (the run is no longer bitwise repeatable)")
    for name, generator in (generators or {}).items():
        if f"gen:{name}" in state:
            generator.set_state(state[f"gen:{name}"])
    return notes
