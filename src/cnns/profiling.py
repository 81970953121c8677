"""Names the training loops give the parts of an update in a profiler trace, read by `cnns profile`.

Both loops, cnns's (`cnns.engine.loop`, `cnns.engine.step`) and the plain one it is measured against
(`cnns.bench.baseline`), mark each weight update, the data it waits for and its optimiser step, and the
fused kernels (`cnns.kernels.norm_act`) mark their passes, so that `cnns.bench.opprofile` can say where
an update's time goes without guessing from operator names alone. ``torch.profiler.record_function``
costs a flag check when no profiler is running.
"""

from __future__ import annotations

from torch.profiler import record_function

UPDATE = "cnns/update"
DATA = "cnns/data"
OPTIMISER = "cnns/optimiser"
NORM_FORWARD = "cnns/norm_act_forward"
NORM_BACKWARD = "cnns/norm_act_backward"


def marked(name: str) -> record_function:
    """A context in which the profiler's events belong to ``name``."""
    return record_function(name)
