"""Names the training loops give the parts of an update in a profiler trace, read by `cnns profile`.

Both loops, cnns's (`cnns.engine.loop`, `cnns.engine.step`) and the plain one it is measured against
(`cnns.bench.baseline`), mark each weight update, the data it waits for and its optimiser step, and the
fused kernels (`cnns.kernels.norm_act`) mark their passes, so that `cnns.bench.opprofile` can say where
an update's time goes without guessing from operator names alone.
"""

from __future__ import annotations

import contextlib

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
