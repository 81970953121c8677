"""The training step's images/s on a GPU, estimated before the model runs, for --decode-device auto to weigh
against the CPU decoder's measured rate (`cnns.data.decoding.choose_from_rates`): the model's training FLOPs
per image against the GPU's measured matmul rate, at the share of it a compiled CNN step reaches.

An estimate, not a measurement (measuring the step would mean compiling it first): it only has to say whether
the CPU decoder falls short by a clear margin, as it does for ResNet-50 on an H200 (docs/performance.md)."""

from __future__ import annotations

import torch

# The share of the GPU's measured 2048 x 2048 bfloat16 matmul rate that compiled ResNet-50 training reached
# on an H200 (its images/s x training FLOPs an image; docs/performance.md has both figures).
STEP_SHARE_OF_MATMUL_RATE = 0.33
TRAINING_FLOPS_PER_FORWARD = 3  # forward, and the backward pass's two products per layer


def forward_flops(model_spec) -> float:
    """Forward FLOPs of one image through the model, counted on the meta device (nothing is computed)."""
    from torch.utils.flop_counter import FlopCounterMode

    from cnns.models import build_model

    with torch.device("meta"):
        model = build_model(model_spec).eval()
        image = torch.empty(1, 3, model_spec.image_size, model_spec.image_size)
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        model(image)
    return float(counter.get_total_flops())


def matmul_flops_per_second(device: torch.device, dtype: torch.dtype, n: int = 2048, calls: int = 10) -> float:
    """FLOP/s of an n x n matmul in `dtype` on the GPU `device`, timed by CUDA events after a warm-up."""
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        a @ b
    end.record()
    end.synchronize()
    return 2 * n**3 * calls / (start.elapsed_time(end) / 1e3)


def estimated_step_rate(model_spec, device: torch.device, dtype: torch.dtype) -> float:
    """Images/s the training step of `model_spec` is estimated to take on the GPU `device` computing in `dtype`."""
    flops = TRAINING_FLOPS_PER_FORWARD * forward_flops(model_spec)
    return STEP_SHARE_OF_MATMUL_RATE * matmul_flops_per_second(device, dtype) / flops
