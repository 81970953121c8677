"""Names the training loops give the parts of an update in a profiler trace, read by `cnns profile`.

Both loops, cnns's (`cnns.engine.loop`, `cnns.engine.step`) and the plain one it is measured against
(`cnns.bench.baseline`), mark each weight update, the data it waits for and its optimiser step, and the
fused kernels (`cnns.kernels.norm_act`) mark their passes, so that `cnns.bench.opprofile` can say where
an update's time goes without guessing from operator names alone.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from torch.profiler import record_function

UPDATE = "cnns/update"
DATA = "cnns/data"
OPTIMISER = "cnns/optimiser"
NORM_FORWARD = "cnns/norm_act_forward"
NORM_BACKWARD = "cnns/norm_act_backward"


_UNMARKED = contextlib.nullcontext()


def marked(name: str) -> contextlib.AbstractContextManager:
    """A context in which the profiler's events belong to ``name``; nothing when no profiler is running.

    ``record_function`` enters and leaves through two dispatcher calls even with the profiler off, so
    every fused pass of every update would pay for marks nobody records (docs/performance.md, "Why
    ResNet-50 with batch norm and ResNet-20 miss their ratio goals here", has the figure).
    """
    return record_function(name) if torch.autograd._profiler_enabled() else _UNMARKED


def profiled(enabled: bool, device: torch.device, folder: Path, log) -> contextlib.AbstractContextManager:
    """--profile: a torch.profiler trace of what runs inside (the training loop, a validation), written by
    TensorBoard's trace handler to `folder` (the run folder's profile/, or the --profile-dir typed for this
    command: never one a run's arguments.json names, `cnns.runfolder.options`); `log` says where. On a CUDA run the
    GPU's kernels too (a CPU run on a GPU host does not load CUPTI)."""
    if not enabled:
        return contextlib.nullcontext()
    from torch.profiler import ProfilerActivity, profile, tensorboard_trace_handler

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    log.print(f"Writing a profiler trace to {folder}")
    return profile(activities=activities, on_trace_ready=tensorboard_trace_handler(str(folder)))
