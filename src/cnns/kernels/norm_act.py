"""Training-mode batch norm and group norm fused with their activation (and a residual addition).

``batch_norm_act`` and ``group_norm_act`` compute what ``act(norm(x) [+ residual])`` computes with torch's
modules, forward and backward, for channels_last float32 or bfloat16 activations with float32 parameters
and float32/float64 statistics, in three passes over memory forward and two backward (the C++ passes of
``norm_act.cpp``; torch's norm, activation and addition each make their own). Running statistics are updated as
``nn.BatchNorm2d`` does. The per-channel quantities between the passes (means, variances, the backward's sums
and coefficients) are float64, computed in the same C++ call as the passes: one call forward, one backward.

The extension is built when the package is installed (setup.py). Where it could not be (no compiler),
``available()`` is False and nothing here is used: the models run torch's modules (see
`cnns.engine.fusion`).
"""

from __future__ import annotations

import torch

from cnns import profiling
from cnns.kernels import load_build

_ext = load_build("norm_act")

ACTIVATIONS = {"none": 0, "relu": 1, "silu": 2}
DTYPES = (torch.float32, torch.bfloat16)


def available() -> bool:
    """Whether the compiled passes are installed."""
    return _ext is not None


def wide_build() -> bool:
    """Whether the AVX-512 (AVX512-BF16) build runs (the one measured against ATen's kernels)."""
    return _ext is not None and _ext.__name__.endswith("_avx512")


def supports(x: torch.Tensor) -> bool:
    """Whether the fused passes take this activation: a 4-d CPU float32/bfloat16 tensor."""
    return _ext is not None and x.device.type == "cpu" and x.dim() == 4 and x.dtype in DTYPES


def _rows(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(N, C, H, W) -> the (G, R, C) row view of its NHWC layout (a view when x is channels_last)."""
    n, c, h, w = x.shape
    return x.permute(0, 2, 3, 1).contiguous().view(groups, -1, c)


def _unrows(y: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    n, c, h, w = shape
    return y.view(n, h, w, c).permute(0, 3, 1, 2)  # channels_last NCHW, no copy


class _NormAct(torch.autograd.Function):
    """act(x * scale + shift [+ residual]) with scale, shift from the batch's (or sample's) statistics.

    ``groups`` is 0 for batch norm (statistics per channel over N, H, W) and the group count for group
    norm (statistics per sample and group of channels over H, W and the group's channels).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, residual, groups: int, eps: float, act: int, stats_out: list | None):
        with profiling.marked(profiling.NORM_FORWARD):
            return _NormAct._forward(ctx, x, weight, bias, residual, groups, eps, act, stats_out)

    @staticmethod
    def _forward(ctx, x, weight, bias, residual, groups: int, eps: float, act: int, stats_out: list | None):
        rows = _rows(x, x.shape[0] if groups else 1)
        res = _rows(residual, rows.shape[0]) if residual is not None else None
        out, mean, invstd, scale, shift, mean_c, m2_c = _ext.forward(rows, weight, bias, res, groups, eps, act)
        if stats_out is not None and not groups:
            stats_out.extend((mean_c[0], m2_c[0], rows.shape[1]))
        ctx.groups, ctx.act = groups, act
        ctx.has_residual = residual is not None
        ctx.shape = x.shape
        ctx.param_dtypes = (None if weight is None else weight.dtype, None if bias is None else bias.dtype)
        ctx.save_for_backward(rows, out if act == ACTIVATIONS["relu"] else None, mean, invstd, weight, scale, shift)
        return _unrows(out, x.shape)

    @staticmethod
    def backward(ctx, grad):
        with profiling.marked(profiling.NORM_BACKWARD):
            return _NormAct._backward(ctx, grad)

    @staticmethod
    def _backward(ctx, grad):
        rows, out, mean, invstd, weight, scale, shift = ctx.saved_tensors
        g = _rows(grad, rows.shape[0]).to(rows.dtype)
        grad_x, grad_w, grad_b, gz = _ext.backward(g, rows, out, mean, invstd, scale, shift, weight, ctx.groups,
                                                   ctx.act, ctx.needs_input_grad[0])
        weight_dtype, bias_dtype = ctx.param_dtypes
        grad_x = _unrows(grad_x, ctx.shape) if ctx.needs_input_grad[0] else None
        grad_weight = grad_w.to(weight_dtype) if weight_dtype is not None and ctx.needs_input_grad[1] else None
        grad_bias = grad_b.to(bias_dtype) if bias_dtype is not None and ctx.needs_input_grad[2] else None
        grad_residual = _unrows(gz, ctx.shape) if ctx.has_residual and ctx.needs_input_grad[3] else None
        return grad_x, grad_weight, grad_bias, grad_residual, None, None, None, None


def _like(residual: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor | None:
    """The residual in the activations' dtype (a float32 shortcut under autocast meets bfloat16 here)."""
    return residual.to(x.dtype) if residual is not None else None


def batch_norm_act(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                   running_mean: torch.Tensor | None, running_var: torch.Tensor | None,
                   num_batches_tracked: torch.Tensor | None, momentum: float | None, eps: float,
                   act: str = "none", residual: torch.Tensor | None = None) -> torch.Tensor:
    """``act(F.batch_norm(x, ..., training=True) [+ residual])``, running statistics updated as torch does.

    The running variance takes the unbiased variance (count - 1); with ``momentum=None`` the cumulative
    average over ``num_batches_tracked`` batches, as ``nn.BatchNorm2d`` does.
    """
    n, c, h, w = x.shape
    if n * h * w < 2:
        raise ValueError(f"Expected more than 1 value per channel when training, got input size {list(x.shape)}")
    residual = _like(residual, x)
    stats: list = []
    y = _NormAct.apply(x, weight, bias, residual, 0, eps, ACTIVATIONS[act], stats)
    if running_mean is not None and stats:
        mean, m2, count = stats
        with torch.no_grad():
            if num_batches_tracked is not None:
                num_batches_tracked.add_(1)
            factor = momentum if momentum is not None else 1.0 / float(num_batches_tracked)
            running_mean.mul_(1 - factor).add_(mean.to(running_mean.dtype), alpha=factor)
            running_var.mul_(1 - factor).add_((m2 / (count - 1)).to(running_var.dtype), alpha=factor)
    return y


def group_norm_act(x: torch.Tensor, groups: int, weight: torch.Tensor | None, bias: torch.Tensor | None,
                   eps: float, act: str = "none", residual: torch.Tensor | None = None) -> torch.Tensor:
    """``act(F.group_norm(x, groups, weight, bias, eps) [+ residual])``."""
    if x.shape[1] % groups:
        raise ValueError(f"Expected number of channels in input to be divisible by num_groups, "
                         f"but got input of shape {list(x.shape)} and num_groups={groups}")
    residual = _like(residual, x)
    return _NormAct.apply(x, weight, bias, residual, groups, eps, ACTIVATIONS[act], None)
