"""Training-mode batch norm and group norm fused with their activation (and a residual addition).

``batch_norm_act`` and ``group_norm_act`` compute what ``act(norm(x) [+ residual])`` computes with torch's
modules, forward and backward, for channels_last float32 or bfloat16 activations with float32 parameters
and float32/float64 statistics, in three passes over memory forward and two backward (the C++ passes of
``norm_act.cpp``; torch's norm, activation and addition each make their own). Running statistics are updated as
``nn.BatchNorm2d`` does. The per-channel quantities between the passes (means, variances, the backward's sums
and coefficients) are float64, computed in the same C++ call as the passes: one call forward, one backward.

A batch norm whose statistics span several replicas (--BN-span) takes ``all_reduce``, a function summing a
float64 tensor over the span's processes: the forward then runs the moments pass, sums each channel's count,
sum and sum of squares over the span (one all-reduce), and runs the scale-shift-activate pass with the span's
statistics; the backward runs its reduction pass, sums the two per-channel sums over the span (one
all-reduce) and runs the input-gradient pass with them, as torch's SyncBatchNorm does on GPUs.

The passes are built when the package is installed (setup.py). Where they could not be (no compiler),
``available()`` is False and nothing here is used: the models run torch's modules (see
`cnns.engine.fusion`).
"""

from __future__ import annotations

from typing import Callable

import torch

from cnns import profiling
from cnns.kernels import DOUBLE, DTYPE_CODES, INT, INT64, POINTER, Library, address, runnable_builds, threads

# Sums a float64 tensor over the processes of a --BN-span (`cnns.parallel.batchnorm.BatchNormSpan.sum`).
AllReduce = Callable[[torch.Tensor], torch.Tensor]

ACTIVATIONS = {"none": 0, "relu": 1, "silu": 2}
DTYPES = (torch.float32, torch.bfloat16)


class Passes:
    """The passes of one build of norm_act.cpp, on tensors: each checks its operands (the C code trusts them),
    allocates its results and calls the build's C entry point."""

    def __init__(self, library: Library):
        self.name = library.name
        self.instructions = library.instructions
        rows = (INT64, INT, POINTER, INT64, INT64, INT64)  # threads, dtype, x, G, R, C
        self._moments = library.entry("cnns_norm_moments", None, *rows, POINTER, POINTER)
        self._affine_act = library.entry("cnns_norm_affine_act", None, *rows, POINTER, POINTER, POINTER, INT64,
                                         POINTER)
        self._backward_reduce = library.entry("cnns_norm_backward_reduce", None, INT64, INT, POINTER, POINTER,
                                              POINTER, INT64, INT64, INT64, POINTER, POINTER, POINTER, INT64,
                                              POINTER, POINTER, POINTER)
        self._input_gradient = library.entry("cnns_norm_input_gradient", None, *rows, POINTER, POINTER, POINTER,
                                             POINTER, POINTER)
        self._forward = library.entry("cnns_norm_forward", None, *rows, POINTER, POINTER, POINTER, INT64, DOUBLE,
                                      INT64, POINTER, POINTER, POINTER, POINTER, POINTER, POINTER, POINTER)
        self._backward = library.entry("cnns_norm_backward", None, INT64, INT, POINTER, POINTER, POINTER, INT64,
                                       INT64, INT64, POINTER, POINTER, POINTER, POINTER, POINTER, INT64, INT64,
                                       POINTER, POINTER, POINTER, POINTER)
        self._parallel_threads = library.entry("cnns_parallel_threads", INT64, INT64, INT64)

    def moments(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per (group, channel) mean and sum of squared deviations of (G, R, C) rows, float64 (G, C) each."""
        g, r, c = _check_rows(x, "x")
        if r == 0:
            raise ValueError("moments of an empty group")
        mean, m2 = _outputs(2, (g, c), torch.float64)
        self._moments(threads(), DTYPE_CODES[x.dtype], x.data_ptr(), g, r, c, mean.data_ptr(), m2.data_ptr())
        return mean, m2

    def affine_act(self, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor,
                   residual: torch.Tensor | None = None, act: int = 0) -> torch.Tensor:
        """act(x * scale + shift [+ residual]), scale and shift (G, C) float32."""
        g, r, c = _check_rows(x, "x")
        _check_coefficients(x, scale=scale, shift=shift)
        if residual is not None:
            _check_like(x, residual=residual)
            if act not in (ACTIVATIONS["none"], ACTIVATIONS["relu"]):
                raise ValueError("a residual is added before no activation or ReLU")
        y = torch.empty_like(x)
        self._affine_act(threads(), DTYPE_CODES[x.dtype], x.data_ptr(), g, r, c, scale.data_ptr(), shift.data_ptr(),
                         address(residual), act, y.data_ptr())
        return y

    def backward_reduce(self, grad: torch.Tensor, x: torch.Tensor, out: torch.Tensor | None, scale: torch.Tensor,
                        shift: torch.Tensor, mean: torch.Tensor, act: int):
        """gz = dL/dz (grad itself without an activation), and per (group, channel) sum gz and
        sum gz * (x - mean), float64 (G, C); ReLU's mask comes from its output ``out``."""
        g, r, c = _check_gradient(grad, x, out, act)
        _check_coefficients(x, scale=scale, shift=shift, mean=mean)
        gz = grad if act == ACTIVATIONS["none"] else torch.empty_like(grad)
        s1, s2 = _outputs(2, (g, c), torch.float64)
        self._backward_reduce(threads(), DTYPE_CODES[x.dtype], grad.data_ptr(), x.data_ptr(), address(out), g, r, c,
                              scale.data_ptr(), shift.data_ptr(), mean.data_ptr(), act, gz.data_ptr(),
                              s1.data_ptr(), s2.data_ptr())
        return gz, s1, s2

    def input_gradient(self, gz: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                       d: torch.Tensor) -> torch.Tensor:
        """a * gz + b * x + d, the coefficients (G, C) float32."""
        g, r, c = _check_rows(x, "x")
        _check_like(x, gz=gz)
        _check_coefficients(x, a=a, b=b, d=d)
        dx = torch.empty_like(x)
        self._input_gradient(threads(), DTYPE_CODES[x.dtype], gz.data_ptr(), x.data_ptr(), g, r, c, a.data_ptr(),
                             b.data_ptr(), d.data_ptr(), dx.data_ptr())
        return dx

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                residual: torch.Tensor | None, groups: int, eps: float, act: int):
        """y = act(norm(x) [+ residual]) with the per (G, C) mean and 1/std (float64), the float32 scale and
        shift that made y, and each channel's mean and sum of squared deviations (float64)."""
        g, r, c = _check_rows(x, "x")
        if r == 0:
            raise ValueError("moments of an empty group")
        if groups and c % groups:
            raise ValueError("channels must divide into the groups")
        if residual is not None:
            _check_like(x, residual=residual)
        weight32, bias32 = _parameter(weight, c), _parameter(bias, c)
        y = torch.empty_like(x)
        mean, invstd, mean_c, m2_c = _outputs(4, (g, c), torch.float64)
        scale, shift = _outputs(2, (g, c), torch.float32)
        self._forward(threads(), DTYPE_CODES[x.dtype], x.data_ptr(), g, r, c, address(weight32), address(bias32),
                      address(residual), groups, eps, act, y.data_ptr(), mean.data_ptr(), invstd.data_ptr(),
                      scale.data_ptr(), shift.data_ptr(), mean_c.data_ptr(), m2_c.data_ptr())
        return y, mean, invstd, scale, shift, mean_c, m2_c

    def backward(self, grad: torch.Tensor, x: torch.Tensor, out: torch.Tensor | None, mean: torch.Tensor,
                 invstd: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, weight: torch.Tensor | None,
                 groups: int, act: int, input_grad: bool):
        """The input gradient (None unless asked for), the weight and bias gradients (C, float64) and dL/dz, z
        the pre-activation (the residual's gradient), from dL/dy and what `forward` returned."""
        g, r, c = _check_gradient(grad, x, out, act)
        weight32 = _parameter(weight, c)
        dx = torch.empty_like(x) if input_grad else None
        gz = grad if act == ACTIVATIONS["none"] else torch.empty_like(grad)
        grad_w, grad_b = _outputs(2, (c,), torch.float64)
        self._backward(threads(), DTYPE_CODES[x.dtype], grad.data_ptr(), x.data_ptr(), address(out), g, r, c,
                       mean.data_ptr(), invstd.data_ptr(), scale.data_ptr(), shift.data_ptr(), address(weight32),
                       groups, act, address(dx), grad_w.data_ptr(), grad_b.data_ptr(), gz.data_ptr())
        return dx, grad_w, grad_b, gz

    def parallel_threads(self, tasks: int) -> int:
        """How many threads this build runs ``tasks`` one-item tasks on (torch's thread count, if built with
        OpenMP)."""
        return self._parallel_threads(threads(), tasks)


def _outputs(count: int, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """``count`` contiguous result tensors of one shape, from one allocation."""
    return torch.empty((count, *shape), dtype=dtype).unbind(0)


def _check_rows(t: torch.Tensor, name: str) -> torch.Size:
    """(G, R, C) of a contiguous float32/bfloat16 CPU row tensor (anything else would be read out of bounds)."""
    if t.dim() != 3 or not t.is_contiguous() or not t.is_cpu:
        raise ValueError(f"{name} must be a contiguous (G, R, C) CPU tensor")
    if t.dtype not in DTYPE_CODES:
        raise ValueError(f"{name} must be float32 or bfloat16")
    return t.shape


def _check_gradient(grad: torch.Tensor, x: torch.Tensor, out: torch.Tensor | None, act: int) -> torch.Size:
    """(G, R, C) of a backward's operands: x's rows, grad laid out as x, and ReLU's output (its mask) too."""
    shape = _check_rows(x, "x")
    _check_like(x, grad=grad)
    if act == ACTIVATIONS["relu"]:
        if out is None:
            raise ValueError("ReLU's backward needs its output")
        _check_like(x, out=out)
    return shape


def _check_like(x: torch.Tensor, **others: torch.Tensor) -> None:
    for name, t in others.items():
        if t.shape != x.shape or not t.is_contiguous() or t.dtype != x.dtype or not t.is_cpu:
            raise ValueError(f"{name} must be laid out as x")


def _check_coefficients(x: torch.Tensor, **coefficients: torch.Tensor) -> None:
    for name, t in coefficients.items():
        if (t.dim() != 2 or not t.is_contiguous() or t.dtype != torch.float32
                or t.shape[0] != x.shape[0] or t.shape[1] != x.shape[2]):
            raise ValueError(f"{name} must be a contiguous float32 (G, C) tensor of the input's G and C")


def _parameter(p: torch.Tensor | None, channels: int) -> torch.Tensor | None:
    """A norm's weight or bias as C contiguous float32 values (float32 and bfloat16 convert exactly)."""
    if p is None:
        return None
    p = p.detach()
    if p.dtype != torch.float32 or not p.is_contiguous():
        p = p.float().contiguous()
    if p.numel() != channels:
        raise ValueError("a norm parameter must have one value per channel")
    return p


def builds() -> list[Passes]:
    """Every build of the passes installed here that this CPU runs, the widest first (tests check each)."""
    return [Passes(library) for library in runnable_builds("norm_act")]


_ext: Passes | None = next(iter(builds()), None)


def available() -> bool:
    """Whether the compiled passes are installed."""
    return _ext is not None


def wide_build() -> bool:
    """Whether the AVX-512 (AVX512-BF16) build runs (the one measured against ATen's kernels)."""
    return _ext is not None and _ext.name.endswith("_avx512")


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
    def forward(ctx, x, weight, bias, residual, groups: int, eps: float, act: int, stats_out: list | None,
                all_reduce: AllReduce | None = None):
        with profiling.marked(profiling.NORM_FORWARD):
            return _NormAct._forward(ctx, x, weight, bias, residual, groups, eps, act, stats_out, all_reduce)

    @staticmethod
    def _forward(ctx, x, weight, bias, residual, groups: int, eps: float, act: int, stats_out: list | None,
                 all_reduce: AllReduce | None):
        rows = _rows(x, x.shape[0] if groups else 1)
        res = _rows(residual, rows.shape[0]) if residual is not None else None
        if all_reduce is None:
            out, mean, invstd, scale, shift, mean_c, m2_c = _ext.forward(rows, weight, bias, res, groups, eps, act)
            count = rows.shape[1]
        else:
            mean, m2_c, count, invstd, scale, shift = _span_statistics(rows, weight, bias, eps, all_reduce)
            mean_c = mean
            out = _ext.affine_act(rows, scale, shift, res, act)
        if stats_out is not None and not groups:
            stats_out.extend((mean_c[0], m2_c[0], count))
        ctx.groups, ctx.act, ctx.all_reduce, ctx.count = groups, act, all_reduce, count
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
        if ctx.all_reduce is None:
            grad_x, grad_w, grad_b, gz = _ext.backward(g, rows, out, mean, invstd, scale, shift, weight, ctx.groups,
                                                       ctx.act, ctx.needs_input_grad[0])
        else:
            grad_x, grad_w, grad_b, gz = _span_backward(g, rows, out, mean, invstd, scale, shift, weight, ctx.act,
                                                        ctx.count, ctx.all_reduce, ctx.needs_input_grad[0])
        weight_dtype, bias_dtype = ctx.param_dtypes
        grad_x = _unrows(grad_x, ctx.shape) if ctx.needs_input_grad[0] else None
        grad_weight = grad_w.to(weight_dtype) if weight_dtype is not None and ctx.needs_input_grad[1] else None
        grad_bias = grad_b.to(bias_dtype) if bias_dtype is not None and ctx.needs_input_grad[2] else None
        grad_residual = _unrows(gz, ctx.shape) if ctx.has_residual and ctx.needs_input_grad[3] else None
        return grad_x, grad_weight, grad_bias, grad_residual, None, None, None, None, None


def _span_statistics(rows: torch.Tensor, weight, bias, eps: float, all_reduce: AllReduce):
    """Batch norm's statistics over a --BN-span: each replica's per-channel count, sum and sum of squares in
    float64 (from its moments pass), summed by one all-reduce. Returns the span's mean and sum of squared
    deviations (1, C), its count, 1/std and the float32 scale and shift of the forward pass."""
    mean_c, m2_c = _ext.moments(rows)  # (1, C) float64
    local_count = rows.shape[1]
    channels = rows.shape[2]
    local = torch.cat([mean_c * local_count, m2_c + local_count * mean_c.square(),
                       mean_c.new_full((1, 1), float(local_count))], dim=1)
    total = all_reduce(local)
    count = float(total[0, 2 * channels])
    mean = total[:, :channels] / count
    m2 = (total[:, channels:2 * channels] - count * mean.square()).clamp_min(0.0)
    invstd = (m2 / count + eps).rsqrt()
    w = weight.detach().double() if weight is not None else 1.0
    b = bias.detach().double() if bias is not None else 0.0
    return mean, m2, count, invstd, (w * invstd).float(), (b - mean * w * invstd).float()


def _span_backward(g, rows, out, mean, invstd, scale, shift, weight, act: int, count: float,
                   all_reduce: AllReduce, input_grad: bool):
    """The backward of a span's batch norm: the reduction pass's two per-channel sums (of the pre-activation
    gradient gz, and of gz * (x - mean)) summed over the span, the input gradient from the span's sums, the
    weight and bias gradients from this replica's (DDP averages them as it does every parameter's)."""
    gz, s1, s2 = _ext.backward_reduce(g, rows, out, scale, shift, mean.float(), act)
    channels = rows.shape[2]
    total = all_reduce(torch.cat([s1, s2], dim=1))  # every replica calls it, whatever it needs
    span_s1, span_s2 = total[:, :channels], total[:, channels:]
    w = weight.detach().double() if weight is not None else 1.0
    coef_g = w * invstd
    coef_x = -w * invstd.pow(3) * span_s2 / count
    coef_d = -w * invstd * span_s1 / count - coef_x * mean
    grad_x = _ext.input_gradient(gz, rows, coef_g.float(), coef_x.float(), coef_d.float()) if input_grad else None
    return grad_x, (s2 * invstd)[0], s1[0], gz


def _like(residual: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor | None:
    """The residual in the activations' dtype (a float32 shortcut under autocast meets bfloat16 here)."""
    return residual.to(x.dtype) if residual is not None else None


def batch_norm_act(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                   running_mean: torch.Tensor | None, running_var: torch.Tensor | None,
                   num_batches_tracked: torch.Tensor | None, momentum: float | None, eps: float,
                   act: str = "none", residual: torch.Tensor | None = None,
                   all_reduce: AllReduce | None = None) -> torch.Tensor:
    """``act(F.batch_norm(x, ..., training=True) [+ residual])``, running statistics updated as torch does.

    The running variance takes the unbiased variance (count - 1); with ``momentum=None`` the cumulative
    average over ``num_batches_tracked`` batches, as ``nn.BatchNorm2d`` does. With ``all_reduce``, the
    statistics are the --BN-span's (module docstring).
    """
    n, c, h, w = x.shape
    if n * h * w < 2:
        raise ValueError(f"Expected more than 1 value per channel when training, got input size {list(x.shape)}")
    residual = _like(residual, x)
    stats: list = []
    y = _NormAct.apply(x, weight, bias, residual, 0, eps, ACTIVATIONS[act], stats, all_reduce)
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
