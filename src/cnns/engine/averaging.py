"""Weight averaging of a run's checkpoints: weight_avg.py, and --weight-avg-N / --weight-avg-exp after training.

The seed's formulas (seed code), over checkpoints ordered by iteration:
  mean:        V = C_0 / n, then V = V + C_i / n for each later C_i
  exponential: V = C_0,     then V = decay * V + (1 - decay) * C_i for each later C_i
computed in float64 and cast back to each tensor's dtype. Integer tensors (BatchNorm's
num_batches_tracked) are not averaged: the last checkpoint's value is kept. Checkpoints are read one
at a time, so averaging many large ones needs memory for two models, not all of them.

The initial checkpoint (iteration 0, the untrained weights) never takes part. The result is saved
in the run folder in the checkpoints' format ("model" is a plain state dict, weights_only-loadable),
named weight_avg*.pt, which validation.py picks up.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable

import torch

from cnns.checkpoint import list_checkpoints, load_checkpoint, save_checkpoint
from cnns.config import RunConfig
from cnns.errors import CheckpointError, ConfigError
from cnns.runlog import RunLog

if TYPE_CHECKING:
    from cnns.engine.validation import Target

Checkpoints = list[tuple[int, Path]]


def average_state_dicts(states: Iterable[dict[str, torch.Tensor]], count: int, mode: str,
                        decay: float = 0.97) -> dict[str, torch.Tensor]:
    """The seed's mean or exponential average of `count` state dicts, consumed one at a time."""
    average: dict[str, torch.Tensor] = {}
    last: dict[str, torch.Tensor] = {}
    for index, state in enumerate(states):
        if index > 0 and state.keys() != last.keys():
            raise CheckpointError("the checkpoints to average hold different tensors (not one model)")
        for key, tensor in state.items():
            if not tensor.is_floating_point():
                continue
            value = tensor.to(torch.float64)
            if index == 0:
                average[key] = value / count if mode == "mean" else value
            elif mode == "mean":
                average[key] = average[key] + value / count
            else:
                average[key] = decay * average[key] + (1 - decay) * value
        last = state
    return {key: average[key].to(tensor.dtype) if key in average else tensor.clone() for key, tensor in last.items()}


def trained_checkpoints(folder: Path) -> Checkpoints:
    """The run's checkpoints by iteration, without the initial, untrained one."""
    return [(iteration, path) for iteration, path in list_checkpoints(folder) if iteration > 0]


def last_checkpoints(checkpoints: Checkpoints, count: int | None, discard_last: int) -> Checkpoints:
    """weight_avg.py's choice: drop the newest `discard_last`, then keep the newest `count` (all if None)."""
    kept = checkpoints[: len(checkpoints) - discard_last] if discard_last > 0 else list(checkpoints)
    return kept[-count:] if count else kept


def checkpoints_in_last_epochs(checkpoints: Checkpoints, epochs: float, epoch_of: Callable[[int], float]) -> Checkpoints:
    """--weight-avg-N: the checkpoints of the last `epochs` epochs (epochs compared to 0.1, as the seed)."""
    final_epoch = epoch_of(checkpoints[-1][0])
    return [(it, path) for it, path in checkpoints if round(epoch_of(it), 1) >= round(final_epoch - epochs, 1)]


def write_average(folder: Path, name: str, chosen: Checkpoints, mode: str, decay: float, log: RunLog) -> Path:
    """Average the chosen checkpoints into `<folder>/<name>.pt` (written atomically)."""
    states = (load_checkpoint(path) for _, path in chosen)
    model = average_state_dicts((state["model"] for state in states), len(chosen), mode, decay)
    newest = load_checkpoint(chosen[-1][1], mmap=True)
    path = folder / f"{name}.pt"
    save_checkpoint(path, {
        "model": model, "iteration": chosen[-1][0], "epoch": float(newest.get("epoch", 0.0)),
        "averaged_iterations": [iteration for iteration, _ in chosen], "averaging": mode,
        "decay": decay if mode == "exponential" else 0.0,
    })
    detail = f"exponential, decay {decay}" if mode == "exponential" else "mean"
    log.print(f"Averaged {len(chosen)} checkpoints ({detail}; iterations "
              f"{', '.join(str(it) for it, _ in chosen)}) into {path}")
    return path


def training_time_averages(folder: Path, window_epochs: tuple[int, ...], decays: tuple[float, ...],
                           epoch_of: Callable[[int], float], log: RunLog) -> list[Path]:
    """--weight-avg-N N: mean over the last N epochs; --weight-avg-exp d: exponential over all."""
    checkpoints = trained_checkpoints(folder)
    if not checkpoints or not (window_epochs or decays):
        return []
    written = [write_average(folder, f"weight_avg_N_{n}", checkpoints_in_last_epochs(checkpoints, n, epoch_of),
                             "mean", 0.0, log) for n in window_epochs]
    written += [write_average(folder, f"weight_avg_exp_{d}", checkpoints, "exponential", d, log) for d in decays]
    return written


def average_name(mode: str, count: int, decay: float, discard_last: int) -> str:
    """weight_avg.py's file name, saying what was averaged, e.g. weight_avg_exp_0.97_last5."""
    name = "weight_avg_mean" if mode == "mean" else f"weight_avg_exp_{decay}"
    name += f"_last{count}"
    return name + (f"_discard{discard_last}" if discard_last else "")


def weight_avg_command(cfg: RunConfig, folder: Path, mode: str, count: int | None, decay: float | None,
                       discard_last: int, validate: bool, notices: list[str]) -> int:
    """weight_avg.py: average the chosen checkpoints, save the result, then validate it."""
    from cnns.engine.components import build_components
    from cnns.engine.validation import check_targets_match, targets_of, validate_targets

    decay = 0.97 if decay is None else decay
    _check_averaging_options(mode, count, decay, discard_last)
    if not folder.is_dir():
        raise CheckpointError(f"--restore-path {folder} is not a run folder")
    checkpoints = trained_checkpoints(folder)
    if not checkpoints:
        raise CheckpointError(f"no trained checkpoints (ckpt-<iteration>.pt, iteration > 0) in {folder}")
    chosen = last_checkpoints(checkpoints, count, discard_last)
    if not chosen:
        raise CheckpointError(f"--discard-last {discard_last} leaves none of the {len(checkpoints)} checkpoints")
    # Read and check everything before writing to the run folder.
    probes = [target for target in targets_of([path for _, path in chosen]) if not target.use_ema]
    _check_same_model(probes)
    components = build_components(cfg, need_train=False) if validate else None
    if components is not None:
        check_targets_match(probes[:1], components.plain_model, f"{cfg.model.arch}-{cfg.model.size}")
    log = RunLog(folder)
    for notice in notices:
        log.notice(notice)
    path = write_average(folder, average_name(mode, len(chosen), decay, discard_last), chosen, mode, decay, log)
    if components is not None:
        validate_targets(targets_of([path]), components, log, cfg.train.global_batch_size, 1)
    log.close()
    return 0


def _check_averaging_options(mode: str, count: int | None, decay: float, discard_last: int) -> None:
    if mode not in ("mean", "exponential"):
        raise ConfigError(f"--mode must be mean or exponential, got {mode!r}")
    if count is not None and count < 1:
        raise ConfigError(f"-N must be at least 1, got {count}")
    if discard_last < 0:
        raise ConfigError(f"--discard-last must not be negative, got {discard_last}")
    if not 0.0 <= decay <= 1.0:
        raise ConfigError(f"--decay must be between 0 and 1, got {decay}")


def _check_same_model(probes: list["Target"]) -> None:
    first = probes[0]
    for probe in probes[1:]:
        if probe.weights.keys() != first.weights.keys() or any(
                probe.weights[k].shape != first.weights[k].shape for k in first.weights):
            raise CheckpointError(f"{probe.path} and {first.path} do not hold the same model: cannot average them")
