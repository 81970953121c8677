"""Stochastic rounding from float32 to a half type, bit by bit: what lets 16.16's half-precision weights
accumulate updates far below their spacing (Graphcore's application
rounds its 16.16 weight updates stochastically too): rounding to nearest would drop every update smaller than
half a spacing, so a small learning rate would leave the weights unchanged.

`stochastic_round` is unbiased (E[round(x)] = x) and reproducible from its generator. bfloat16 runs through
the fused CPU kernel where it was built (`cnns.kernels.rounding`), else through torch operations on
cache-sized pieces; float16 through torch operations. `cnns.optim.HalfPrecisionOptimiser` rounds each
update with it.
"""

from __future__ import annotations

import math
import sys

import torch
from torch import Tensor

HALF_TYPES = (torch.bfloat16, torch.float16)


def stochastic_round(x: Tensor, dtype: torch.dtype, generator: torch.Generator | None = None) -> Tensor:
    """Round float32 ``x`` to ``dtype`` (bfloat16 or float16) so that ``E[result] == x``.

    ``x`` goes to the neighbour of larger magnitude with probability equal to its distance from the
    smaller one over the gap between them. This is what lets 16-bit weights accumulate updates far
    smaller than their spacing, which round-to-nearest would discard every time.
    Infinities and NaNs pass through; ``generator`` must live on ``x``'s device.
    """
    if x.dtype != torch.float32:
        raise TypeError(f"stochastic_round expects float32 input, got {x.dtype}")
    if dtype == torch.bfloat16:
        return _stochastic_round_bfloat16(x, generator)
    if dtype == torch.float16:
        return _stochastic_round_float16(x, generator)
    raise TypeError(f"stochastic_round rounds to bfloat16 or float16, not {dtype}")


# Elements per piece of a bfloat16 stochastic rounding: the piece's input, noise and output stay in
# the L2/L3 caches between the few passes over it (one pass over a whole ResNet-50 at a time streams
# from memory and takes twice as long).
_ROUNDING_PIECE = 1 << 21


def _stochastic_round_bfloat16(x: Tensor, generator: torch.Generator | None) -> Tensor:
    # bfloat16 is the top 16 bits of float32. Adding a uniform integer in [0, 2**16) to the bit
    # pattern and keeping the top 16 bits carries into them with probability (low bits) / 2**16:
    # exactly the stochastic rounding of the magnitude. The sign bit is untouched because the carry
    # only ever moves a finite magnitude up to the infinity pattern, never past it; infinities keep
    # their pattern (their low bits are zero). Only NaN payloads could be carried into another value,
    # so NaNs are written back as NaN.
    #
    # It runs over every weight at every 16.16 update, so it is written for speed. On a CPU, one parallel
    # C++ pass (`cnns.kernels.rounding`) whose noise hashes (key, element index), the key one draw of the
    # generator: torch's CPU generator is sequential, so drawing every element's noise from it would
    # make the generator, not the rounding, the cost of the pass. Elsewhere
    # (GPUs; CPUs where the pass was not built), torch operators: the 16 noise bits of four elements come
    # from one full-range 64-bit draw (the CPU generator's cost is per draw; a bounded randint is several
    # times slower), the top halves are read straight out of the int32 sums (no float conversion pass),
    # and the work goes in cache-sized pieces.
    kernel = _rounding_kernel() if x.device.type == "cpu" else None
    if kernel is not None:
        key = int(torch.empty((), dtype=torch.int64).random_(-(2**63), None, generator=generator))
        return kernel.stochastic_round_bfloat16(x.contiguous(), key)
    flat = x.contiguous().view(-1)
    count = flat.numel()
    rounded = torch.empty(count, dtype=torch.bfloat16, device=x.device)
    high = 1 if sys.byteorder == "little" else 0
    piece = count if x.device.type != "cpu" else _ROUNDING_PIECE
    draws = torch.empty((min(piece, count) + 3) // 4, dtype=torch.int64, device=x.device)
    for start in range(0, count, max(1, piece)):
        end = min(count, start + piece)
        n = end - start
        noise16 = draws[: (n + 3) // 4].random_(-(2**63), None, generator=generator).view(torch.int16)[:n]
        sums = noise16.to(torch.int32).bitwise_and_(0xFFFF).add_(flat[start:end].view(torch.int32))
        out = rounded[start:end]
        out.view(torch.int16).copy_(sums.view(torch.int16)[high::2])
        # NaN weights are rare. On the CPU reading a number back costs nothing, so a sum over the piece
        # (still in cache) decides whether the exact mask is needed; elsewhere the fill never waits on
        # the host. A sum that overflows to infinity only costs the exact path.
        if x.device.type != "cpu" or not math.isfinite(float(flat[start:end].sum())):
            out.masked_fill_(torch.isnan(flat[start:end]), float("nan"))
    return rounded.view(x.shape)


def _rounding_kernel():
    """`cnns.kernels.rounding` where it was built (CPU code)."""
    from cnns.kernels import rounding

    return rounding if rounding.available() else None


def _stochastic_round_float16(x: Tensor, generator: torch.Generator | None) -> Tensor:
    # float16 has fewer exponent bits than float32, so the bit trick above does not apply. Instead
    # find the two float16 neighbours of x from its round-to-nearest value: for a finite float16 the
    # int16 bit pattern +1 / -1 is the next value away from / towards zero.
    nearest = x.to(torch.float16)
    nearest_bits = nearest.view(torch.int16)
    nearest_is_below = nearest.float().abs() <= x.abs()
    smaller_mag = torch.where(nearest_is_below, nearest_bits, nearest_bits - 1).view(torch.float16)
    larger_mag = torch.where(nearest_is_below, nearest_bits + 1, nearest_bits).view(torch.float16)
    low, high = smaller_mag.float().abs(), larger_mag.float().abs()
    gap = high - low
    # Exact values (gap 0 never happens, but x == low does) go up with probability 0.
    prob_up = torch.where(gap > 0, (x.abs() - low) / gap, torch.zeros_like(gap))
    uniform = torch.rand(x.shape, dtype=torch.float32, device=x.device, generator=generator)
    rounded = torch.where(uniform < prob_up, larger_mag, smaller_mag)
    # Beyond the largest float16 (gap infinite, prob_up 0) keep the plain cast, as for inf and NaN.
    return torch.where(torch.isfinite(nearest) & torch.isfinite(x), rounded, nearest)
