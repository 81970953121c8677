"""Backward of depthwise convolutions on channels_last CPU activations (the C++ loops of ``depthwise.cpp``).

oneDNN's input gradient of a strided depthwise convolution and its weight gradient of a 5x5 one run far below
memory speed (docs/performance-history.md has the timings per shape); these compute the same
sums, accumulated in float32 as oneDNN's bfloat16 kernels accumulate, for float32 or bfloat16 activations.
`cnns.engine.kernel_choice.route_slow_depthwise_backward` decides which convolutions use them.
"""

from __future__ import annotations

import torch

from cnns.kernels import DTYPE_CODES, INT, INT64, POINTER, Library, runnable_builds, threads

KERNEL_SIZES = (3, 5, 7)


class Backward:
    """The two loops of one build of depthwise.cpp, on tensors: this class checks the operands and the geometry
    (the C code trusts them) and allocates the results."""

    def __init__(self, library: Library):
        self.name = library.name
        self.instructions = library.instructions
        geometry = (INT64,) * 11  # N, H, W, C, Ho, Wo, kernel, stride_h, stride_w, pad_h, pad_w
        self._weight_gradient = library.entry("cnns_depthwise_weight_gradient", None, INT64, INT, POINTER, POINTER,
                                              *geometry, POINTER)
        self._input_gradient = library.entry("cnns_depthwise_input_gradient", None, INT64, INT, POINTER, POINTER,
                                             *geometry, POINTER)
        self._parallel_threads = library.entry("cnns_parallel_threads", INT64, INT64, INT64)

    def weight_gradient(self, grad: torch.Tensor, x: torch.Tensor, kernel: int, stride_h: int, stride_w: int,
                        pad_h: int, pad_w: int) -> torch.Tensor:
        """(K, K, C) float32 weight gradient from grad (N, Ho, Wo, C) and x (N, H, W, C), one dtype."""
        _check_nhwc(grad, "grad")
        _check_nhwc(x, "x")
        if x.dtype != grad.dtype:
            raise ValueError("x and grad must have one dtype")
        n, h, w, c = x.shape
        if grad.shape[0] != n or grad.shape[3] != c:
            raise ValueError("x and grad must agree in N and C")
        if kernel not in KERNEL_SIZES:
            raise ValueError(f"depthwise weight gradient: kernel sizes 3, 5 and 7 only, not {kernel}")
        geometry = _geometry(grad, h, w, kernel, stride_h, stride_w, pad_h, pad_w)
        out = torch.empty((kernel, kernel, c), dtype=torch.float32)
        self._weight_gradient(threads(), DTYPE_CODES[x.dtype], grad.data_ptr(), x.data_ptr(), *geometry,
                              out.data_ptr())
        return out

    def input_gradient(self, grad: torch.Tensor, weight: torch.Tensor, h: int, w: int, stride_h: int,
                       stride_w: int, pad_h: int, pad_w: int) -> torch.Tensor:
        """(N, H, W, C) input gradient in grad's dtype, from the (K, K, C) float32 weight."""
        _check_nhwc(grad, "grad")
        if (weight.dim() != 3 or weight.shape[0] != weight.shape[1] or not weight.is_contiguous()
                or weight.dtype != torch.float32 or weight.shape[2] != grad.shape[3]):
            raise ValueError("the weight must be a contiguous (K, K, C) float32 tensor")
        kernel = weight.shape[0]
        geometry = _geometry(grad, h, w, kernel, stride_h, stride_w, pad_h, pad_w)
        dx = torch.empty((grad.shape[0], h, w, grad.shape[3]), dtype=grad.dtype)
        self._input_gradient(threads(), DTYPE_CODES[grad.dtype], grad.data_ptr(), weight.data_ptr(), *geometry,
                             dx.data_ptr())
        return dx

    def parallel_threads(self, tasks: int) -> int:
        """How many threads this build runs ``tasks`` one-item tasks on."""
        return self._parallel_threads(threads(), tasks)


def _check_nhwc(t: torch.Tensor, name: str) -> None:
    if t.dim() != 4 or not t.is_contiguous() or not t.is_cpu:
        raise ValueError(f"{name} must be a contiguous (N, H, W, C) CPU tensor")
    if t.dtype not in DTYPE_CODES:
        raise ValueError(f"{name} must be float32 or bfloat16")


def _geometry(grad: torch.Tensor, h: int, w: int, kernel: int, stride_h: int, stride_w: int, pad_h: int,
              pad_w: int) -> tuple[int, ...]:
    """(N, H, W, C, Ho, Wo, kernel, strides, paddings) for the C loops, once grad's size is the convolution's."""
    n, ho, wo, c = grad.shape
    if not (stride_h >= 1 and stride_w >= 1 and 0 <= pad_h < kernel and 0 <= pad_w < kernel and kernel >= 1):
        raise ValueError("bad stride or padding")
    if ho != (h + 2 * pad_h - kernel) // stride_h + 1 or wo != (w + 2 * pad_w - kernel) // stride_w + 1:
        raise ValueError("grad's spatial size does not match the convolution")
    return n, h, w, c, ho, wo, kernel, stride_h, stride_w, pad_h, pad_w


def builds() -> list[Backward]:
    """Every build installed here that this CPU runs, the widest first (tests check each)."""
    return [Backward(library) for library in runnable_builds("depthwise")]


_ext: Backward | None = next(iter(builds()), None)


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
