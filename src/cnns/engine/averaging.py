"""Weight averaging of a run's checkpoints: weight_avg.py, and --weight-avg-N / --weight-avg-exp after training.

Graphcore's application's formulas, over checkpoints ordered by iteration:
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
from typing import Callable, Iterable

import torch

from cnns.errors import CheckpointError
from cnns.runfolder.checkpoint import list_checkpoints, load_checkpoint, save_checkpoint
from cnns.runfolder.log import RunLog

Checkpoints = list[tuple[int, Path]]


def average_state_dicts(states: Iterable[dict[str, torch.Tensor]], count: int, mode: str,
                        decay: float = 0.97) -> dict[str, torch.Tensor]:
    """Graphcore's application's mean or exponential average of `count` state dicts, consumed one at a time."""
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
    """--weight-avg-N: the checkpoints of the last `epochs` epochs (epochs compared to 0.1, as Graphcore's application does)."""
    final_epoch = epoch_of(checkpoints[-1][0])
    return [(it, path) for it, path in checkpoints if round(epoch_of(it), 1) >= round(final_epoch - epochs, 1)]


def write_average(folder: Path, name: str, chosen: Checkpoints, mode: str, decay: float, log: RunLog,
                  states: Iterable[dict] | None = None) -> Path:
    """Average the chosen checkpoints into `<folder>/<name>.pt` (written atomically). `states`: the chosen
    checkpoints as the caller has already read them (memory-mapped), so that none is read twice; else each is
    read in turn."""
    newest: dict = {}

    def models() -> Iterable[dict[str, torch.Tensor]]:
        nonlocal newest
        for newest in states if states is not None else (load_checkpoint(path, mmap=True) for _, path in chosen):
            yield newest["model"]

    model = average_state_dicts(models(), len(chosen), mode, decay)
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
