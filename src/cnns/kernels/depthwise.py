"""Backward of depthwise convolutions on channels_last CPU activations (the C++ loops of ``depthwise.cpp``).

oneDNN's input gradient of a strided depthwise convolution and its weight gradient of a 5x5 one run far below
memory speed (docs/performance-history.md has the timings per shape); these compute the same
sums, accumulated in float32 as oneDNN's bfloat16 kernels accumulate, for float32 or bfloat16 activations.
`cnns.engine.kernel_choice.route_slow_depthwise_backward` decides which convolutions use them.
"""

from __future__ import annotations

import torch

from cnns.kernels import load_build

_ext = load_build("depthwise")

KERNEL_SIZES = (3, 5, 7)


def available() -> bool:
    """Whether the compiled kernels are installed."""
    return _ext is not None


def supports(conv: torch.nn.Conv2d) -> bool:
    """Whether these kernels compute this convolution's backward: depthwise (one input and one output channel
    per group), a square 3x3, 5x5 or 7x7 kernel, no dilation, zero padding given as numbers."""
    k = conv.kernel_size
    return (_ext is not None and conv.groups == conv.in_channels == conv.out_channels and k[0] == k[1]
            and k[0] in KERNEL_SIZES and tuple(conv.dilation) == (1, 1) and not isinstance(conv.padding, str)
            and conv.padding_mode == "zeros")


def _nhwc(t: torch.Tensor) -> torch.Tensor:
    """(N, C, H, W) -> (N, H, W, C) storage order (a view when t is channels_last)."""
    return t.permute(0, 2, 3, 1).contiguous()


def weight_gradient(grad: torch.Tensor, x: torch.Tensor, kernel_size: int, stride, padding) -> torch.Tensor:
    """dL/dweight, (C, 1, K, K) float32, from the output gradient and the input (same dtype)."""
    dw = _ext.weight_gradient(_nhwc(grad.to(x.dtype)), _nhwc(x), kernel_size, stride[0], stride[1],
                              padding[0], padding[1])
    return dw.permute(2, 0, 1).unsqueeze(1)


def input_gradient(grad: torch.Tensor, weight: torch.Tensor, input_size, stride, padding) -> torch.Tensor:
    """dL/dx, (N, C, H, W) channels_last in grad's dtype, for an input of spatial size ``input_size``."""
    taps = weight.detach().float().squeeze(1).permute(1, 2, 0).contiguous()  # (K, K, C)
    dx = _ext.input_gradient(_nhwc(grad), taps, input_size[0], input_size[1], stride[0], stride[1],
                             padding[0], padding[1])
    return dx.permute(0, 3, 1, 2)
