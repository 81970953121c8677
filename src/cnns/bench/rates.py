"""What the machine can do, measured: the matmul rate (the roofline's compute peak), the stream bandwidth,
and a model's forward FLOPs per image, which turn a benchmark's images/s into fractions of them."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from cnns.bench import roofline
from cnns.precision import HALF_DTYPES, default_half_dtype


def matmul_rate(dtype: torch.dtype = torch.bfloat16, n: int = 2048, repeats: int = 8, budget_s: float = 3.0,
                device: torch.device = torch.device("cpu")) -> float:
    """Best-of GFLOP/s of an n x n matmul in ``dtype`` on ``device``, measured for at most about ``budget_s``
    seconds.

    A CPU without bfloat16 arithmetic (no AVX512-BF16 or AMX, e.g. an AVX2-only EPYC) emulates it
    orders of magnitude slower than float32, so one 2048x2048 product could outlast the budget many times
    over. A 256x256 probe estimates the rate first, and the big product is only timed when the budget allows it.
    """
    def timed(size: int, count: int) -> float:
        a = torch.randn(size, size, device=device).to(dtype)
        b = torch.randn(size, size, device=device).to(dtype)
        a @ b
        roofline.synchronize(device)
        start = time.perf_counter()
        for _ in range(count):
            a @ b
        roofline.synchronize(device)
        return count * 2 * size**3 / (time.perf_counter() - start) / 1e9

    probe = timed(256, 2)
    if 2 * n**3 / (probe * 1e9) * (repeats + 1) > budget_s:
        return probe
    best = 0.0
    for _ in range(repeats):
        best = max(best, timed(n, 2))
    return best


def peak_rate(device: torch.device = torch.device("cpu")) -> tuple[float, dict[str, float]]:
    """The roofline: the faster of the float32 and half matmul rates (GFLOP/s) on ``device``, and both rates.

    On a CPU with bfloat16 arithmetic that is the bfloat16 rate; on one
    without, float32 is what the hardware can do and what the fast path runs. On a GPU the half type is the
    one 16.x runs there (`cnns.precision.default_half_dtype`).
    """
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
        peak, rates = peak_rate(self.device)
        self.peak = max(self.peak, peak)
        self.rates = {k: max(v, self.rates.get(k, 0.0)) for k, v in rates.items()}
        self.bandwidth = max(self.bandwidth, roofline.stream_bandwidth(device=self.device))
        return self

    def describe(self) -> str:
        where = "on " + (f"{torch.get_num_threads()} threads" if self.device.type == "cpu" else
                         f"{self.device}, {torch.cuda.get_device_name(self.device)}")
        rates = ", ".join(f"{name} {rate:.1f}" for name, rate in self.rates.items())
        return f"2048x2048 matmul: {rates} GFLOP/s; stream triad {self.bandwidth:.1f} GB/s; {where}"


_FLOPS_CACHE: dict[Any, float] = {}


def forward_flops(model_spec) -> float:
    """Forward FLOPs of one image through the model (counted once per model, batch of 1, eval mode)."""
    from torch.utils.flop_counter import FlopCounterMode

    from cnns.models import build_model

    if model_spec in _FLOPS_CACHE:
        return _FLOPS_CACHE[model_spec]
    model = build_model(model_spec).eval()
    image = torch.zeros(1, 3, model_spec.image_size, model_spec.image_size)
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        model(image)
    _FLOPS_CACHE[model_spec] = float(counter.get_total_flops())
    return _FLOPS_CACHE[model_spec]
