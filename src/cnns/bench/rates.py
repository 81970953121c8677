"""How every benchmark here times and alternates what it compares, and what the machine can do, measured
that way: the matmul rate (the roofline's compute peak), the stream bandwidth, a model's forward FLOPs."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence, TypeVar

import torch
from torch.utils.benchmark import Timer

from cnns.precision import HALF_DTYPES, default_half_dtype

Item = TypeVar("Item")


def in_turn(items: Sequence[Item], round_index: int) -> list[Item]:
    """One round's order: as given, reversed every other round, so that no side always runs on a machine the
    one before it has just warmed (or loaded), and a drifting machine moves both terms of a ratio alike."""
    return list(items)[:: 1 if round_index % 2 == 0 else -1]


def best_seconds(fn: Callable[[], Any], calls: int = 3, number: int = 1) -> float:
    """Seconds per call of ``fn``: the best of ``calls`` measurements of ``number`` calls each, by
    torch.utils.benchmark.Timer (each warmed up, an accelerator synchronised before reading the clock), on this
    process's threads. The best, since other work on a shared machine only ever slows a call down."""
    timer = Timer("fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    return min(timer.timeit(number).mean for _ in range(calls))


def matmul_rate(dtype: torch.dtype = torch.bfloat16, n: int = 2048, repeats: int = 8, budget_s: float = 3.0,
                device: torch.device = torch.device("cpu")) -> float:
    """Best-of GFLOP/s of an n x n matmul in ``dtype`` on ``device``, for at most about ``budget_s`` seconds.

    A CPU without bfloat16 arithmetic (no AVX512-BF16 or AMX) emulates it orders of magnitude slower than
    float32, so one 2048x2048 product could outlast the budget many times over: a 256x256 probe estimates the
    rate first, and the big product is only timed when the budget allows it."""
    def rate(size: int, calls: int) -> float:
        a, b = (torch.randn(size, size, device=device).to(dtype) for _ in range(2))
        return 2 * size**3 / best_seconds(lambda: a @ b, calls, number=2) / 1e9

    probe = rate(256, 2)
    return probe if 2 * n**3 / (probe * 1e9) * (repeats + 1) > budget_s else rate(n, repeats)


def stream_bandwidth(megabytes: int = 128, repeats: int = 10, device: torch.device = torch.device("cpu")) -> float:
    """GB/s of a triad ``a = b + s * c`` on float32 arrays of ``megabytes`` each, far larger than the caches,
    on all threads: the two arrays read and the one written (as STREAM counts; not the write-allocate read)."""
    n = megabytes * 2**20 // 4
    a, b, c = torch.empty(n, device=device), torch.rand(n, device=device), torch.rand(n, device=device)
    return 3 * n * 4 / best_seconds(lambda: torch.add(b, c, alpha=0.5, out=a), repeats) / 1e9


def peak_rate(device: torch.device = torch.device("cpu")) -> tuple[float, dict[str, float]]:
    """The roofline's peak: the faster of the float32 and half matmul rates (GFLOP/s) on ``device``, and both.

    On a CPU with bfloat16 arithmetic that is the bfloat16 rate; on one without, float32 is what the hardware
    can do and what the fast path runs. On a GPU the half type is the one 16.x runs there."""
    half = HALF_DTYPES[default_half_dtype(device)] if device.type == "cuda" else torch.bfloat16
    rates = {str(half).removeprefix("torch."): matmul_rate(half, device=device),
             "float32": matmul_rate(torch.float32, device=device)}
    return max(rates.values()), rates


@dataclass
class DeviceRates:
    """A device's matmul rates and stream bandwidth, measured at the start of an invocation and at its end."""

    device: torch.device
    peak: float = 0.0
    rates: dict[str, float] = field(default_factory=dict)
    bandwidth: float = 0.0

    def measure(self) -> "DeviceRates":
        """Measure again and keep the best of each figure: a busy moment must not flatter the fractions."""
        # Timer synchronises the current accelerator: make it this one.
        with torch.cuda.device(self.device) if self.device.type == "cuda" else nullcontext():
            peak, rates = peak_rate(self.device)
            bandwidth = stream_bandwidth(device=self.device)
        self.peak = max(self.peak, peak)
        self.rates = {k: max(v, self.rates.get(k, 0.0)) for k, v in rates.items()}
        self.bandwidth = max(self.bandwidth, bandwidth)
        return self

    def describe(self) -> str:
        where = "on " + (f"{torch.get_num_threads()} threads" if self.device.type == "cpu" else
                         f"{self.device}, {torch.cuda.get_device_name(self.device)}")
        rates = ", ".join(f"{name} {rate:.1f}" for name, rate in self.rates.items())
        return f"2048x2048 matmul: {rates} GFLOP/s; stream triad {self.bandwidth:.1f} GB/s; {where}"


_FLOPS_CACHE: dict[Any, float] = {}


def forward_flops(model_spec) -> float:
    """Forward FLOPs of one image through the model (`cnns.engine.step_rate.forward_flops`; once per model)."""
    from cnns.engine.step_rate import forward_flops as counted

    if model_spec not in _FLOPS_CACHE:
        _FLOPS_CACHE[model_spec] = counted(model_spec)
    return _FLOPS_CACHE[model_spec]
