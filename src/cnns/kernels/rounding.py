"""Stochastic rounding of float32 to bfloat16 in one parallel pass (the C++ loop of ``rounding.cpp``).

`cnns.stochastic_rounding.stochastic_round` uses it on the CPU where it was built: the noise of element i is a hash of
(key, i), with one key drawn from the optimiser's generator per call, instead of 16 bits per element drawn
from torch's sequential CPU generator. Same distribution, another stream: a run is reproducible on the same
build, as its checkpoints promise.
"""

from __future__ import annotations

import torch

from cnns.kernels import INT64, POINTER, Library, runnable_builds, threads


class Rounding:
    """The pass of one build of rounding.cpp, on tensors."""

    def __init__(self, library: Library):
        self.name = library.name
        self.instructions = library.instructions
        self._round = library.entry("cnns_stochastic_round_bfloat16", None, INT64, POINTER, INT64, INT64, POINTER)
        self._parallel_threads = library.entry("cnns_parallel_threads", INT64, INT64, INT64)

    def stochastic_round_bfloat16(self, x: torch.Tensor, key: int) -> torch.Tensor:
        """``x`` (contiguous float32, CPU) rounded to bfloat16 stochastically with the noise stream ``key``."""
        if not x.is_cpu or x.dtype != torch.float32 or not x.is_contiguous():
            raise ValueError("stochastic_round_bfloat16 takes a contiguous float32 CPU tensor")
        out = torch.empty(x.shape, dtype=torch.bfloat16)
        self._round(threads(), x.data_ptr(), x.numel(), key, out.data_ptr())
        return out

    def parallel_threads(self, tasks: int) -> int:
        """How many threads this build runs ``tasks`` one-item tasks on."""
        return self._parallel_threads(threads(), tasks)


def builds() -> list[Rounding]:
    """Every build installed here that this CPU runs, the widest first (tests check each)."""
    return [Rounding(library) for library in runnable_builds("rounding")]


_ext: Rounding | None = next(iter(builds()), None)


def available() -> bool:
    """Whether the compiled pass is installed."""
    return _ext is not None


def stochastic_round_bfloat16(x: torch.Tensor, key: int) -> torch.Tensor:
    """``x`` (contiguous float32, CPU) rounded to bfloat16 stochastically with the noise stream ``key``."""
    return _ext.stochastic_round_bfloat16(x, key)
