"""A stage process's part of torch.distributed.pipelining: its PipelineStage, the schedule that runs it and the clock
that times it. Imported only where a run has stages (torch's pipelining imports torch._dynamo, seconds a process).

The schedules are torch's, under the names Graphcore's application gives them: Grouped is
`ScheduleGPipe` (all forwards, then all backwards), Interleaved is `Schedule1F1B`; Sequential (one
micro-batch through every stage, forward and backward, before the next) is `ScheduleSequential` below,
which torch does not have.
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
from cnns.models.split_points import Piece
from cnns.parallel.pipeline import StageModule, as_sent, boundary_shapes, keep_only


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
