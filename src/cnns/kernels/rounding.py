"""Stochastic rounding of float32 to bfloat16 in one parallel pass (the C++ loop of ``rounding.cpp``).

`cnns.stochastic_rounding.stochastic_round` uses it on the CPU where it was built: the noise of element i is a hash of
(key, i), with one key drawn from the optimiser's generator per call, instead of 16 bits per element drawn
from torch's sequential CPU generator. Same distribution, another stream: a run is reproducible on the same
build, as its checkpoints promise.
"""

from __future__ import annotations

import torch

from cnns.kernels import load_build

_ext = load_build("rounding")


def available() -> bool:
    """Whether the compiled pass is installed."""
    return _ext is not None


def stochastic_round_bfloat16(x: torch.Tensor, key: int) -> torch.Tensor:
    """``x`` (contiguous float32, CPU) rounded to bfloat16 stochastically with the noise stream ``key``."""
    return _ext.stochastic_round_bfloat16(x, key)
