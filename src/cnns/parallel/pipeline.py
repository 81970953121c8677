"""Pipelined model parallelism: one stage of a model per process, on torch.distributed.pipelining
(`cnns.parallel.pipeline_schedules`, imported where a run has stages: torch's pipelining imports torch._dynamo, seconds a
process).

Every process builds the whole model the same way (same random seed: identical initial weights), cuts it
into the pieces of `cnns.models.split_points.model_pieces`, and keeps only its stage's pieces: the other
modules are removed, so the stage's state dict is the matching part of the whole model's, under
the same keys. Checkpoints merge the stages' parts back into the whole model (`cnns.engine.stages`).

Activations cross between stages as contiguous NHWC tensors: the model runs channels_last, and a
channels_last NCHW tensor viewed as NHWC is contiguous, so nothing is copied to send it (a send
needs contiguous memory) and the next stage gets channels_last activations back by a view.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Sequence

import torch
from torch import nn

from cnns.models.split_points import Piece


class StageModule(nn.Module):
    """The pieces of one stage, run in order; ``model`` is the whole model less the other stages'
    modules (its state-dict keys are the whole model's)."""

    def __init__(self, model: nn.Module, pieces: Sequence[Piece], first: bool, last: bool,
                 autocast: Callable[[], ContextManager] = contextlib.nullcontext):
        super().__init__()
        self.model = model
        self._pieces = list(pieces)
        self._first, self._last = first, last
        self._autocast = autocast

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._first and x.dim() == 4:
            x = x.permute(0, 3, 1, 2)  # NHWC from the previous stage: a channels_last NCHW view
        with self._autocast():
            for piece in self._pieces:
                x = piece.run(x)
        if not self._last and x.dim() == 4:
            x = x.permute(0, 2, 3, 1).contiguous()  # no copy when x is channels_last
        return x


def keep_only(model: nn.Module, modules: Sequence[str]) -> nn.Module:
    """Remove every module of `model` that is neither one of `modules` (qualified names), inside one,
    nor a container of one. Names of what stays are unchanged (no renumbering of Sequentials)."""
    keep = set(modules)

    def prune(parent: nn.Module, prefix: str) -> None:
        for name in list(parent._modules):
            qualified = f"{prefix}{name}"
            if qualified in keep:
                continue
            if any(k.startswith(qualified + ".") for k in keep):
                prune(parent._modules[name], qualified + ".")
            else:
                del parent._modules[name]

    prune(model, "")
    return model


def boundary_shapes(model: nn.Module, stages: Sequence[Sequence[Piece]], example: torch.Tensor,
                    autocast: Callable[[], ContextManager]) -> list[torch.Tensor]:
    """Example tensors (batch 1) of what enters each stage and what leaves the last: the static
    metadata every PipelineStage needs, so no stage runs a trial forward and backward of its own."""
    boundaries = [example]
    x = example
    training = {module: module.training for module in model.modules()}
    model.eval()  # batch norm must not count this batch in its running statistics
    try:
        with torch.no_grad(), autocast():
            for stage in stages:
                for piece in stage:
                    x = piece.run(x)
                boundaries.append(x)
    finally:
        for module, mode in training.items():
            module.train(mode)
    return boundaries


def as_sent(x: torch.Tensor, micro_batch: int, nhwc: bool) -> torch.Tensor:
    """An empty tensor shaped like `x` at the micro-batch size; `nhwc`: in the layout stages send
    activations in (the model's input and output stay as they are)."""
    shape = (micro_batch, *x.shape[1:])
    if nhwc and x.dim() == 4:
        shape = (micro_batch, x.shape[2], x.shape[3], x.shape[1])
    return torch.empty(shape, dtype=x.dtype, device=x.device)


# ------------------------------------------------------------------------------------------------
# Whole-model state from the stages' parts, and back


def optimiser_state_by_name(state: dict[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """A torch optimiser state dict with its parameter indices replaced by parameter names
    (`names`: the parameters in the optimiser's order)."""
    return {
        "state": {names[index]: value for index, value in state["state"].items()},
        "param_groups": [{**group, "params": [names[i] for i in group["params"]]} for group in state["param_groups"]],
    }


def optimiser_state_by_index(by_name: dict[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """The inverse of `optimiser_state_by_name` for the parameters `names` (a whole model's, or one
    stage's): groups keep their order and hyperparameters, and hold the named parameters they list."""
    index = {name: i for i, name in enumerate(names)}
    groups = [{**group, "params": [index[name] for name in group["params"] if name in index]}
              for group in by_name["param_groups"]]
    return {"state": {index[name]: value for name, value in by_name["state"].items() if name in index},
            "param_groups": groups}


def merge_optimiser_states(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The stages' by-name optimiser states (in stage order) as one: parameters in stage order
    within each group, which is the whole model's order."""
    merged = {"state": {}, "param_groups": [{**group, "params": []} for group in parts[0]["param_groups"]]}
    for part in parts:
        merged["state"].update(part["state"])
        for group, theirs in zip(merged["param_groups"], part["param_groups"]):
            group["params"].extend(theirs["params"])
    return merged


# ------------------------------------------------------------------------------------------------
# Where the time goes (measured by `cnns.parallel.pipeline_schedules.StageClock`)


def time_report(totals: Sequence[dict[str, float]], schedule: str, micro_batches: int) -> list[str]:
    """Lines for the log: per stage its compute (forward, backward) and waiting share of the schedule,
    and the bubble an ideal pipeline of equal stages would have (GPipe and 1F1B: (S-1)/(M+S-1))."""
    stages = len(totals)
    lines = [f"Pipeline time by stage ({schedule}, {stages} stages, {micro_batches} micro-batches per update, "
             f"{int(totals[0]['updates'])} updates):"]
    for index, t in enumerate(totals):
        compute = t["forward"] + t["backward"]
        waiting = max(0.0, t["schedule"] - compute)
        share = waiting / t["schedule"] if t["schedule"] > 0 else 0.0
        lines.append(f"  stage {index}: compute {compute:.3f}s (forward {t['forward']:.3f}s, backward "
                     f"{t['backward']:.3f}s), waiting {waiting:.3f}s ({100 * share:.0f}% of {t['schedule']:.3f}s: "
                     f"bubble, transfers, imbalance)")
    if schedule == "Sequential":
        lines.append("  Sequential runs one stage at a time: each stage waits while the others compute")
    else:
        bubble = (stages - 1) / (micro_batches + stages - 1)
        lines.append(f"  an ideal pipeline of {stages} equal stages would wait {100 * bubble:.0f}% of the time "
                     f"(bubble (S-1)/(M+S-1))")
    return lines
