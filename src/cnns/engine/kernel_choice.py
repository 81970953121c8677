"""The kernels a run computes with, none of which changes a result beyond its rounding (`choose_kernels`):
gradients kept channels_last, cuDNN's fastest or deterministic algorithms on a GPU, the bfloat16 depthwise
backward routed away from oneDNN's slow one, float32 kernels for the half convolutions of a CPU that only
emulates the half type, and the float32 backward of convolutions with a few output positions as two matrix
products.

The GPU choice sets process-wide flags (cuDNN's benchmark and deterministic modes, torch's deterministic
algorithms, cuBLAS's workspace): a process trains one run, so they are the run's. The rest changes the model's
modules (`cnns.engine.specialise.specialise`), keeping their parameters, buffers and state-dict keys.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from cnns.engine.specialise import specialise
from cnns.kernels import depthwise
from cnns.precision import cpu_half_is_emulated


def choose_kernels(model: nn.Module, device: torch.device, compute_dtype: torch.dtype, reproducible: bool) -> None:
    """The kernels a run computes with, none of which changes a result beyond its rounding: on a GPU cuDNN's
    fastest or (with --seed) deterministic ones; on a CPU that only emulates the half type, float32 kernels for
    its convolutions; on one that computes bfloat16, another backward for the depthwise convolutions whose
    oneDNN one is slow; on a CPU computing in float32, matrix products for the backward of convolutions with few
    output positions (the emulated half type's float32 kernels choose them too); everywhere, gradients kept
    channels_last."""
    if device.type == "cuda":
        choose_gpu_kernels(model, reproducible)
    half = compute_dtype in (torch.bfloat16, torch.float16)  # 16.16 and 16.32
    if device.type == "cpu" and half and cpu_half_is_emulated(device, compute_dtype):
        compute_half_convolutions_in_float32(model)
    elif device.type == "cpu" and compute_dtype == torch.bfloat16:
        route_slow_depthwise_backward(model)
    elif device.type == "cpu" and compute_dtype == torch.float32:
        route_few_position_backward(model)
    keep_gradients_channels_last(model)  # last: hooks the pooling layers as the GPU choice left them

# ------------------------------------------------------------------------------------------------
# channels_last gradients


class _ChannelsLastGradient(torch.autograd.Function):
    """Identity forward; the gradient passes backward in channels_last memory format."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous(memory_format=torch.channels_last)


def _channels_last_gradient_hook(module: nn.Module, args: tuple):
    x = args[0] if args else None
    if torch.is_tensor(x) and x.dim() == 4 and x.requires_grad and torch.is_grad_enabled():
        return (_ChannelsLastGradient.apply(x), *args[1:])
    return None


def keep_gradients_channels_last(model: nn.Module) -> int:
    """channels_last end to end, backward included.

    A few layers hand their input gradient back in NCHW order even when the input is channels_last:
    global average pooling (its backward expands the pooled gradient) and the CIFAR ResNets'
    option-A shortcut (subsampling plus zero channels: the backward of a strided slice is a fresh
    NCHW tensor). Every kernel behind them then meets one NCHW and one channels_last operand and
    takes its slow generic path, down to the next convolution. A forward pre-hook (torch's documented
    way to change a module's input) routes their input through an identity whose backward converts the
    gradient once. Returns the number of layers hooked.
    """
    from cnns.models.cifar_resnet import ZeroPadShortcut

    hooked = 0
    for module in model.modules():
        if isinstance(module, (nn.AdaptiveAvgPool2d, ZeroPadShortcut)):
            module.register_forward_pre_hook(_channels_last_gradient_hook)
            hooked += 1
    return hooked


# ------------------------------------------------------------------------------------------------
# reproducible GPU runs


def choose_gpu_kernels(model: nn.Module, reproducible: bool) -> None:
    """Which kernels a GPU run computes with: with --seed the deterministic ones (`compute_reproducibly`);
    otherwise cuDNN times its algorithms once for each of the run's few fixed shapes and keeps the fastest
    (timm's default too)."""
    if reproducible:
        compute_reproducibly(model)
    else:
        torch.backends.cudnn.benchmark = True


def compute_reproducibly(model: nn.Module) -> int:
    """--seed on a GPU: the same run, or one interrupted and restored, computes the same bits.

    On a CPU that holds already (oneDNN's kernels and the fused passes are deterministic at a given thread
    count). On CUDA, cuDNN picks among convolution algorithms by speed, some of them summing with atomic
    additions in whatever order the threads arrive, and cuBLAS does the same with a small workspace. So:
    torch's deterministic algorithms (cuDNN's deterministic convolutions, cuBLAS with a fixed workspace),
    which can be slower; a run without --seed keeps the fastest. The one layer of cnns' models whose CUDA
    backward has no deterministic kernel is global average pooling (``adaptive_avg_pool2d_backward_cuda``
    adds atomically): it becomes a mean over the spatial dimensions, the same value, whose backward is a
    broadcast. Any other such operator warns (``warn_only``) rather than stopping the run.
    Returns the number of pooling layers changed.
    """
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS makes its first handle
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.use_deterministic_algorithms(True, warn_only=True)
    # Deterministic mode also fills every new tensor with NaN, a pass over each activation that only
    # matters to code reading memory it never wrote; nothing here does.
    torch.utils.deterministic.fill_uninitialized_memory = False
    changed = 0
    for module in model.modules():
        if isinstance(module, nn.AdaptiveAvgPool2d) and _is_global(module.output_size) \
                and not isinstance(module, _GlobalMean):
            specialise(module, _GlobalMean)
            changed += 1
    return changed


def _is_global(output_size) -> bool:
    return tuple(output_size) == (1, 1) if isinstance(output_size, (tuple, list)) else output_size == 1


class _GlobalMean:
    """Global average pooling as a mean over the spatial dimensions: the same value, a deterministic backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=(-2, -1), keepdim=True)


# ------------------------------------------------------------------------------------------------
# bfloat16 depthwise convolutions on the CPU


# How one half of a depthwise backward is computed: by the same oneDNN kernel as the forward's dtype, by
# oneDNN in float32 (operands converted, the result rounded back), or by cnns.kernels.depthwise.
NATIVE, FLOAT32, CNNS = "native", "float32", "cnns"


class _DepthwiseConv(torch.autograd.Function):
    """A bfloat16 depthwise convolution whose slow backward halves are computed another way.

    oneDNN's bfloat16 depthwise kernels are fast forward but have two pathological backward cases on
    EfficientNet-B0's shapes (docs/performance.md): the input gradient of a strided depthwise convolution and
    the weight gradient of a 5x5 one. Those halves go to the C++ kernels where they are built, else to oneDNN
    in float32; the other half and the forward stay oneDNN bfloat16. All accumulate in float32 and round the
    result to bfloat16 as the bfloat16 kernel does.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, stride, padding, dilation, groups, input_route, weight_route):
        ctx.save_for_backward(x, weight)
        ctx.conv = (stride, padding, dilation, groups, bias is not None, input_route, weight_route)
        return F.conv2d(x, weight, bias, stride, padding, dilation, groups)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        stride, padding, dilation, groups, has_bias, input_route, weight_route = ctx.conv
        want_input, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_input = grad_weight = grad_bias = None

        def onednn(g, inp, w, mask):
            return torch.ops.aten.convolution_backward(g, inp, w, None, stride, padding, dilation, False,
                                                      [0, 0], groups, mask)

        if want_input and input_route == CNNS:
            grad_input = depthwise.input_gradient(grad, weight, x.shape[2:], stride, padding)
        if want_weight and weight_route == CNNS:
            grad_weight = depthwise.weight_gradient(grad, x, weight.shape[-1], stride, padding).to(weight.dtype)
        float32 = [want_input and input_route == FLOAT32, want_weight and weight_route == FLOAT32, False]
        if any(float32):
            # The input gradient needs the input's shape only: a broadcast stand-in, not a converted copy.
            inp = x.float() if float32[1] else grad.new_empty(1, dtype=torch.float32).expand(x.shape)
            halves = onednn(grad.float(), inp, weight.float(), float32)
            grad_input = halves[0].to(x.dtype) if float32[0] else grad_input
            grad_weight = halves[1].to(weight.dtype) if float32[1] else grad_weight
        native = [want_input and input_route == NATIVE, want_weight and weight_route == NATIVE, False]
        if any(native):
            halves = onednn(grad, x, weight, native)
            grad_input = halves[0] if native[0] else grad_input
            grad_weight = halves[1] if native[1] else grad_weight
        if has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad.float().sum((0, 2, 3)).to(grad.dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None, None


class _RoutedDepthwise:
    """An nn.Conv2d whose bfloat16 training convolution is `_DepthwiseConv` with its `depthwise_routes`."""

    def _conv_forward(self, x: torch.Tensor, weight: torch.Tensor, bias):
        if torch.is_grad_enabled() and torch.is_autocast_enabled("cpu"):
            # 16.32: autocast would run the convolution in its dtype; cast as it does, and route from there.
            dtype = torch.get_autocast_dtype("cpu")
            x, weight = x.to(dtype), weight.to(dtype)
            bias = bias.to(dtype) if bias is not None else None
        if not (torch.is_grad_enabled() and x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16):
            return super()._conv_forward(x, weight, bias)
        return _DepthwiseConv.apply(x, weight, bias, self.stride, self.padding, self.dilation, self.groups,
                                    *self._cnns_depthwise_routes)


def depthwise_routes(conv: nn.Conv2d) -> tuple[str, str]:
    """How the backward of this bfloat16 convolution computes its input and weight gradients (see above).

    Depthwise = one input channel per group. Strided ones take another input gradient, 5x5 and larger another
    weight gradient: cnns.kernels.depthwise where it supports the convolution, else oneDNN in float32. 3x3
    stride-1 depthwise and grouped convolutions (group size 16, Graphcore's application's --group-dim) stay
    oneDNN's bfloat16: its input gradient at stride 1 beats the C++ kernel on EfficientNet-B0's shapes, and its
    3x3 weight gradients are about as fast (docs/performance.md).
    """
    if conv.padding_mode != "zeros" or isinstance(conv.padding, str):
        return NATIVE, NATIVE
    if not (conv.groups > 1 and conv.weight.shape[1] == 1):
        return NATIVE, NATIVE
    faster = CNNS if depthwise.supports(conv) else FLOAT32
    return (faster if max(conv.stride) > 1 else NATIVE), (faster if max(conv.kernel_size) >= 5 else NATIVE)


def route_slow_depthwise_backward(model: nn.Module) -> int:
    """Give the depthwise convolutions with a pathological bfloat16 backward half another one (above).

    Returns the number of convolutions rerouted.
    """
    rerouted = 0
    for module in model.modules():
        if type(module) is nn.Conv2d and depthwise_routes(module) != (NATIVE, NATIVE):
            module._cnns_depthwise_routes = depthwise_routes(module)
            specialise(module, _RoutedDepthwise)
            rerouted += 1
    return rerouted


# ------------------------------------------------------------------------------------------------
# half convolutions on a CPU that only emulates the half type


class _Float32ComputedConv(torch.autograd.Function):
    """A convolution computed by float32 kernels, forward and backward: oneDNN's, and for a backward with few
    output positions two matrix products (`float32_convolution_backward`). Float32 operands pass unconverted.

    Without AVX512-BF16 or AMX (AMX-FP16 for float16), oneDNN has no half convolution and torch falls back to a
    generic im2col + matrix product, many times slower than float32. The half operands convert to float32
    exactly, and a product of two half values is exact in float32 (8 or 11 significant bits each, 24 in
    float32), so this computes what a CPU with half arithmetic computes (exact products, float32 sums, the result
    rounded to the half type), in another summation order. The half inputs are what is saved for the backward:
    no float32 copy is kept between the passes.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, stride, padding, dilation, groups):
        ctx.save_for_backward(x, weight)
        ctx.conv = (stride, padding, dilation, groups, bias is not None)
        with torch.autocast("cpu", enabled=False):  # 16.32: autocast would make the float32 operands half again
            out = F.conv2d(x.float(), weight.float(), bias.float() if bias is not None else None, stride, padding,
                           dilation, groups)
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        stride, padding, dilation, groups, has_bias = ctx.conv
        mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], has_bias and ctx.needs_input_grad[2]]
        with torch.autocast("cpu", enabled=False):
            grad_input, grad_weight, grad_bias = float32_convolution_backward(
                grad.float(), x.float(), weight.float(), stride, padding, dilation, groups, mask)
        return (grad_input.to(x.dtype) if mask[0] else None, grad_weight.to(weight.dtype) if mask[1] else None,
                grad_bias.to(weight.dtype) if mask[2] else None, None, None, None, None)


class _Float32ComputedHalfConv:
    """An nn.Conv2d whose half-precision convolutions are `_Float32ComputedConv`."""

    def _conv_forward(self, x: torch.Tensor, weight: torch.Tensor, bias):
        if torch.is_autocast_enabled("cpu"):
            # 16.32: autocast would run the convolution in its dtype; cast as it does, and compute from there.
            dtype = torch.get_autocast_dtype("cpu")
            x, weight = x.to(dtype), weight.to(dtype)
            bias = bias.to(dtype) if bias is not None else None
        if x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != x.dtype:
            return super()._conv_forward(x, weight, bias)
        return _Float32ComputedConv.apply(x, weight, bias, self.stride, self.padding, self.dilation, self.groups)


def compute_half_convolutions_in_float32(model: nn.Module) -> int:
    """Every zero-padded nn.Conv2d of `model` with numeric padding (the backward's form; not "same") computes its
    half-precision convolutions with float32 kernels (above). Returns the number of convolutions changed."""
    changed = 0
    for module in _plain_zero_padded_convolutions(model):
        specialise(module, _Float32ComputedHalfConv)
        changed += 1
    return changed


# ------------------------------------------------------------------------------------------------
# float32 convolutions with few output positions


# A dense convolution whose output has at most this many positions per image has its float32 backward computed
# as two matrix products: oneDNN's backward is several times slower there (a ResNet's last stage on small
# images), while from 3 x 3 positions on it is as fast or faster (docs/performance.md, "Convolutions with few
# output positions", has the measurements).
FEW_OUTPUT_POSITIONS = 4


def has_few_output_positions(output_size, groups: int, dilation) -> bool:
    """Whether this convolution's backward is computed as matrix products (above): a dense one (no groups, no
    dilation) whose output, of spatial size ``output_size``, has at most FEW_OUTPUT_POSITIONS positions."""
    height, width = output_size
    return groups == 1 and tuple(dilation) == (1, 1) and height * width <= FEW_OUTPUT_POSITIONS


def float32_convolution_backward(grad, x, weight, stride, padding, dilation, groups, mask):
    """`aten.convolution_backward` of float32 operands (bias: its gradient when ``mask[2]``): oneDNN's, or two
    matrix products where the output has few positions (`has_few_output_positions`)."""
    if not has_few_output_positions(grad.shape[-2:], groups, dilation):
        return torch.ops.aten.convolution_backward(grad, x, weight, [weight.shape[0]] if mask[2] else None, stride,
                                                  padding, dilation, False, [0, 0], groups, mask)
    return _matmul_convolution_backward(grad, x, weight, stride, padding, mask)


def _matmul_convolution_backward(grad, x, weight, stride, padding, mask):
    """A dense convolution's backward as matrix products over its unfolded input (im2col): one row per output
    position, one column per weight tap (input channel, kernel row, kernel column). The weight gradient is
    rows^T x grad, the input gradient grad x weight folded back onto the input's positions (col2im sums the
    overlapping windows). The same sums as oneDNN's in another order.

    The columns follow the weight's memory order, so that neither the weight nor its gradient is transposed: a
    channels_last weight is (out, kernel row, kernel column, in) in memory; only the batch-sized rows are."""
    batch, out_channels = grad.shape[:2]
    in_channels, taps = weight.shape[1], weight.shape[2] * weight.shape[3]
    positions = grad.shape[2] * grad.shape[3]
    channels_last = weight.stride(1) == 1
    grad_rows = grad.permute(0, 2, 3, 1).reshape(batch * positions, out_channels)  # a view when channels_last
    grad_input = grad_weight = grad_bias = None
    if mask[1]:
        columns = F.unfold(x, weight.shape[2:], padding=padding, stride=stride).view(
            batch, in_channels, taps, positions)
        rows = columns.permute(0, 3, 2, 1) if channels_last else columns.permute(0, 3, 1, 2)
        products = grad_rows.t() @ rows.reshape(batch * positions, -1)
        grad_weight = _in_layout_of(weight, products.view(out_channels, *weight.shape[2:], in_channels).permute(
            0, 3, 1, 2) if channels_last else products.view(weight.shape))
    if mask[0]:
        weight_rows = weight.permute(0, 2, 3, 1) if channels_last else weight
        windows = grad_rows @ weight_rows.reshape(out_channels, -1)
        windows = windows.view(batch, positions, taps, in_channels).permute(0, 3, 2, 1) if channels_last else \
            windows.view(batch, positions, in_channels, taps).permute(0, 2, 3, 1)
        grad_input = _in_layout_of(x, F.fold(windows.reshape(batch, in_channels * taps, positions), x.shape[2:],
                                             weight.shape[2:], padding=padding, stride=stride))
    if mask[2]:
        grad_bias = grad_rows.sum(0)
    return grad_input, grad_weight, grad_bias


def _in_layout_of(tensor: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """`values` with `tensor`'s strides, as oneDNN gives a gradient (a channels_last 1 x 1 weight's too)."""
    return values if values.stride() == tensor.stride() else torch.empty_like(tensor).copy_(values)


class _FewPositionConv:
    """An nn.Conv2d whose float32 training convolutions with few output positions are `_Float32ComputedConv`:
    oneDNN's forward, the backward as matrix products."""

    def _conv_forward(self, x: torch.Tensor, weight: torch.Tensor, bias):
        if torch.is_grad_enabled() and x.dtype == weight.dtype == torch.float32 \
                and not torch.is_autocast_enabled("cpu") \
                and has_few_output_positions(_output_size(self, x), self.groups, self.dilation):
            return _Float32ComputedConv.apply(x, weight, bias, self.stride, self.padding, self.dilation, self.groups)
        return super()._conv_forward(x, weight, bias)


def _output_size(conv: nn.Conv2d, x: torch.Tensor) -> tuple[int, int]:
    """The spatial size `conv` gives `x`, without computing it."""
    height, width = ((size + 2 * pad - dil * (k - 1) - 1) // step + 1 for size, pad, dil, k, step in
                     zip(x.shape[-2:], conv.padding, conv.dilation, conv.kernel_size, conv.stride))
    return height, width


def route_few_position_backward(model: nn.Module) -> int:
    """Every zero-padded nn.Conv2d of `model` with numeric padding computes the float32 backward of an output with
    few positions as matrix products (above); whether an output has few positions is decided per call, from the
    input's size. Returns the number of convolutions changed."""
    changed = 0
    for module in _plain_zero_padded_convolutions(model):
        specialise(module, _FewPositionConv)
        changed += 1
    return changed


def _plain_zero_padded_convolutions(model: nn.Module):
    """The nn.Conv2d modules of `model` with zero padding given as numbers (the backward's form; not "same") whose
    convolution no other choice has changed."""
    for module in model.modules():
        if isinstance(module, nn.Conv2d) and module.padding_mode == "zeros" and not isinstance(module.padding, str) \
                and type(module)._conv_forward is nn.Conv2d._conv_forward:
            yield module
