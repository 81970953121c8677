"""Pipelined model parallelism: one stage of a model per process, on torch.distributed.pipelining.

Every process builds the whole model the same way (same random seed: identical initial weights), cuts it
into the pieces of `cnns.models.splits.model_pieces`, and keeps only its stage's pieces: the other
modules are removed, so the stage's state dict is the matching part of the whole model's, under
the same keys. Checkpoints merge the stages' parts back into the whole model (`cnns.engine.stages`).

The schedules are torch's, under the names Graphcore's application gives them: Grouped is
`ScheduleGPipe` (all forwards, then all backwards), Interleaved is `Schedule1F1B`; Sequential (one
micro-batch through every stage, forward and backward, before the next) is `ScheduleSequential` below,
which torch does not have.

Activations cross between stages as contiguous NHWC tensors: the model runs channels_last, and a
channels_last NCHW tensor viewed as NHWC is contiguous, so nothing is copied to send it (a send
needs contiguous memory) and the next stage gets channels_last activations back by a view.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, ContextManager, Sequence

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.pipelining.schedules import PipelineScheduleSingle

from cnns.errors import ConfigError
from cnns.models.splits import Piece

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


def stage_of(model: nn.Module, stages: Sequence[Sequence[Piece]], index: int, example: torch.Tensor,
             micro_batch: int, group: Any, device: torch.device,
             autocast: Callable[[], ContextManager] = contextlib.nullcontext) -> tuple[StageModule, PipelineStage]:
    """Stage `index` of the whole `model` (cut into `stages` of pieces), as the module it runs and
    torch's PipelineStage over the replica's `group` of stage processes. `example` is one input
    image batch (any batch size); the model is pruned to the stage's modules in place."""
    boundaries = boundary_shapes(model, stages, example, autocast)
    last = index == len(stages) - 1
    module = StageModule(keep_only(model, [name for piece in stages[index] for name in piece.modules]),
                         stages[index], first=index == 0, last=last, autocast=autocast)
    stage = PipelineStage(
        module, index, len(stages), device,
        # Activations between stages carry gradients back (the metadata says so); images do not.
        input_args=as_sent(boundaries[index], micro_batch, nhwc=index > 0).requires_grad_(index > 0),
        output_args=as_sent(boundaries[index + 1], micro_batch, nhwc=not last).requires_grad_(True),
        group=group,
    )
    return module, stage


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


class ScheduleSequential(PipelineScheduleSingle):
    """The Sequential schedule of Graphcore's application: one micro-batch goes forward through every stage and back
    before the next one starts (no overlap between stages; for debugging, and the layout of a
    sharded model). torch has no such schedule; this is its GPipe loop with the backward of each
    micro-batch moved right after its forward."""

    def _step_microbatches(self, arg_mbs=None, kwarg_mbs=None, target_mbs=None, losses=None,
                           return_outputs=True, loss_kwargs=None):
        from torch.distributed.pipelining.schedules import _batch_p2p, _wait_batch_p2p

        arg_mbs, kwarg_mbs = self._check_inputs(arg_mbs, kwarg_mbs, target_mbs, losses)
        self._initialize_stage(arg_mbs[0], kwarg_mbs[0], target_mbs[0] if target_mbs is not None else None,
                               loss_kwargs)
        stage, last = self._stage, self._n_microbatches - 1
        for i in range(self._n_microbatches):
            _wait_batch_p2p(_batch_p2p(stage.get_fwd_recv_ops(i), desc="fwd_recv"))
            output = stage.forward_one_chunk(i, arg_mbs[i], kwarg_mbs[i], save_forward_output=return_outputs)
            _wait_batch_p2p(_batch_p2p(stage.get_fwd_send_ops(i), desc="fwd_send"))
            self._maybe_compute_loss(stage, output, target_mbs, i, loss_kwargs)
            _wait_batch_p2p(_batch_p2p(stage.get_bwd_recv_ops(i), desc="bwd_recv"))
            stage.backward_one_chunk(i, loss=self._maybe_get_loss(stage, i), last_backward=i == last)
            _wait_batch_p2p(_batch_p2p(stage.get_bwd_send_ops(i), desc="bwd_send"))
        self._update_losses(stage, losses)
        stage.perform_reduce_grad(self._n_microbatches if self.scale_grads else 1)


def build_pipeline_schedule(name: str, stage: PipelineStage, micro_batches: int, loss_fn: Callable) -> PipelineScheduleSingle:
    """The named schedule over `micro_batches` per update. The loss function already divides by the
    micro-batch count (as one process's accumulation does), so the schedule leaves gradients as they are."""
    kinds = {"Grouped": ScheduleGPipe, "Interleaved": Schedule1F1B, "Sequential": ScheduleSequential}
    if name not in kinds:
        raise ConfigError(f"unknown --pipeline-schedule {name}; choose one of {', '.join(kinds)}")
    # Interleaved's micro-batch count was checked as the options resolved (`cnns.config.defaults`).
    return kinds[name](stage, micro_batches, loss_fn=loss_fn, scale_grads=False)


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
# Where the time goes


class StageClock:
    """Seconds one stage computes (its forward and backward chunks) against its time in the schedule.

    The rest of the schedule's time is waiting: the pipeline's bubble (stages idle while it fills
    and drains), transfers between stages and imbalance between them. The chunks are timed by
    wrapping the PipelineStage's two chunk methods; on CUDA with events, so timing never
    synchronises the device during training: the pairs whose end has completed are folded into the
    totals once more than PENDING_EVENTS are waiting (events on a stream complete in order), so a long
    run holds a bounded number of them; the rest are read at the end.
    """

    PENDING_EVENTS = 64  # per kind of chunk

    def __init__(self, stage: PipelineStage, device: torch.device):
        self.cuda = device.type == "cuda"
        self.seconds = {"forward": 0.0, "backward": 0.0, "schedule": 0.0}
        self._events: dict[str, list] = {"forward": [], "backward": [], "schedule": []}
        self.updates = 0
        for kind, name in (("forward", "forward_one_chunk"), ("backward", "backward_one_chunk")):
            setattr(stage, name, self._timed(kind, getattr(stage, name)))

    def _timed(self, kind: str, function: Callable) -> Callable:
        def run(*args, **kwargs):
            with self.measure(kind):
                return function(*args, **kwargs)

        return run

    @contextlib.contextmanager
    def measure(self, kind: str):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            pairs = self._events[kind]
            pairs.append((start, end))
            if len(pairs) > self.PENDING_EVENTS:
                self._fold_completed(kind)
        else:
            began = time.perf_counter()
            yield
            self.seconds[kind] += time.perf_counter() - began

    def _fold_completed(self, kind: str) -> None:
        """Add the pairs that have completed (a prefix of the list) to the totals, without waiting."""
        pairs = self._events[kind]
        done = 0
        while done < len(pairs) and pairs[done][1].query():
            done += 1
        self.seconds[kind] += sum(start.elapsed_time(end) for start, end in pairs[:done]) / 1000.0
        del pairs[:done]

    def totals(self) -> dict[str, float]:
        if self.cuda:
            torch.cuda.synchronize()
            for kind, pairs in self._events.items():
                self.seconds[kind] += sum(start.elapsed_time(end) for start, end in pairs) / 1000.0
                pairs.clear()
        return {**self.seconds, "updates": float(self.updates)}


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
