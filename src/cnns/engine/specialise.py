"""How a built model's modules change the way they run, never what they compute: `specialise` makes a module an
instance of a subclass of its own class rather than patching a bound method in, so it stays the same object
under the same name, with the same parameters, buffers, hooks and state-dict keys, checkpoints hold the plain
model's state, and a deep copy (the moving average) keeps the change.

Its users, each one job: `cnns.engine.kernel_choice` (speed: the kernels a run computes with),
`cnns.engine.recomputation` (memory), `cnns.engine.fusion` (speed: fused CPU passes) and
`cnns.engine.compilation` (torch.compile). The order they are applied in is stated once, by
`cnns.engine.assembly.assemble`.
"""

from __future__ import annotations

import functools

from torch import nn


def specialise(module: nn.Module, override: type) -> nn.Module:
    """`module` made an instance of a subclass of its own class whose methods `override` (a mixin) replaces.

    The module stays the same object, under the same name in its parent (the root of a model too), with the
    same parameters, buffers, hooks and state-dict keys; a deep copy is specialised as well.
    `torch.nn.utils.parametrize` changes a module's class the same way. Returns the module.
    """
    module.__class__ = _subclass(override, type(module))
    return module


@functools.cache
def _subclass(override: type, base: type) -> type:
    return type(f"{override.__name__.lstrip('_')}{base.__name__}", (override, base), {})
