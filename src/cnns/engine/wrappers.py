"""How a built model runs for training, never what it computes: each function here changes one thing and
keeps the model's parameters, buffers and state-dict keys, so checkpoints always hold the plain model's state.

* channels_last gradients, reproducible GPU kernels, the bfloat16 depthwise backward, float32 kernels for half
  convolutions a CPU only emulates (`choose_kernels`): speed
* recomputation (`recompute`): memory
* compilation (`maybe_compile`): speed, where it wins

The order they are applied in is stated once, by `cnns.engine.assembly.assemble`. A module whose computation
changes becomes an instance of a subclass of its own class (`specialise`) rather than getting a bound method
patched in: it stays the same object under the same name, with the same hooks and keys, and a deep copy (the
moving average) keeps the change.
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from cnns.errors import ConfigError
from cnns.kernels import depthwise
from cnns.precision import cpu_half_is_emulated


def specialise(module: nn.Module, override: type) -> nn.Module:
    """`module` made an instance of a subclass of its own class whose methods `override` (a mixin) replaces.

    The module stays the same object, under the same name in its parent (the root of a model too), with the
    same parameters, buffers, hooks and state-dict keys; a deep copy is specialised as well.
    `torch.nn.utils.parametrize` changes a module's class the same way. Returns the module.
    """
    module.__class__ = _subclass(override, type(module))
    return module


@functools.cache
def _subclass(override: type, base: type) -> type:
    return type(f"{override.__name__.lstrip('_')}{base.__name__}", (override, base), {})


def choose_kernels(model: nn.Module, device: torch.device, compute_dtype: torch.dtype, reproducible: bool) -> None:
    """The kernels a run computes with, none of which changes a result beyond its rounding: on a GPU cuDNN's
    fastest or (with --seed) deterministic ones; on a CPU that only emulates the half type, float32 kernels for
    its convolutions; on one that computes bfloat16, another backward for the depthwise convolutions whose
    oneDNN one is slow; everywhere, gradients kept channels_last."""
    if device.type == "cuda":
        choose_gpu_kernels(model, reproducible)
    half = compute_dtype in (torch.bfloat16, torch.float16)  # 16.16 and 16.32
    if device.type == "cpu" and half and cpu_half_is_emulated(device, compute_dtype):
        compute_half_convolutions_in_float32(model)
    elif device.type == "cpu" and compute_dtype == torch.bfloat16:
        route_slow_depthwise_backward(model)
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
    """A half-precision convolution computed by oneDNN's float32 kernels, forward and backward.

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
            grad_input, grad_weight, grad_bias = torch.ops.aten.convolution_backward(
                grad.float(), x.float(), weight.float(), [weight.shape[0]] if has_bias else None, stride, padding,
                dilation, False, [0, 0], groups, mask)
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
    for module in model.modules():
        if isinstance(module, nn.Conv2d) and module.padding_mode == "zeros" and not isinstance(module.padding, str) \
                and type(module)._conv_forward is nn.Conv2d._conv_forward:
            specialise(module, _Float32ComputedHalfConv)
            changed += 1
    return changed


# ------------------------------------------------------------------------------------------------
# recomputation


@contextlib.contextmanager
def _batch_norm_statistics_kept(module: nn.Module):
    """Undo what a recomputed forward does to running statistics: they were updated once already.

    The recomputation runs the block's forward again in training mode, so without this every batch
    norm would fold the same batch into its running mean and variance twice (and count it twice).
    """
    saved = [(buffer, buffer.clone()) for norm in module.modules()
             if isinstance(norm, nn.modules.batchnorm._BatchNorm) for buffer in norm.buffers(recurse=False)]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)


def recomputed(function, owner: nn.Module):
    """`function` (a part of `owner`'s computation) with its activations recomputed in the backward
    pass when `owner` trains; batch-norm statistics of `owner` are updated once."""

    def run(*args, **kwargs):
        if not (owner.training and torch.is_grad_enabled()):
            return function(*args, **kwargs)
        # context_fn: nothing around the first forward, statistics restored around the recomputation.
        return checkpoint(function, *args, use_reentrant=False, preserve_rng_state=True,
                          context_fn=lambda: (contextlib.nullcontext(), _batch_norm_statistics_kept(owner)), **kwargs)

    return run


class _Recomputed:
    """A block whose forward (its class's, or the fused one of `cnns.engine.fusion`) is recomputed."""

    def forward(self, *args, **kwargs):
        return recomputed(super().forward, self)(*args, **kwargs)


class _RecomputedSegments:
    """A whole model run as its segments between recomputation points (``_cnns_segments``)."""

    def forward(self, x):
        for run in self._cnns_segments:
            x = run(x)
        return x


def recompute(model: nn.Module, spec, splits: tuple[str, ...] | None, between_splits: bool) -> int:
    """--enable-recomputation: per segment between the --pipeline-splits when the run marks recomputation points
    on one device (`between_splits`), else per block. Returns the number of segments or blocks recomputed."""
    from cnns.models import recomputation_blocks, resolve_splits
    from cnns.models.splits import model_pieces, stage_pieces

    if between_splits:
        cuts = resolve_splits(spec, model, list(splits or ()))
        return recompute_between_splits(model, stage_pieces(model_pieces(spec, model, cuts), cuts))
    return recompute_blocks(model, recomputation_blocks(spec, model))


def recompute_blocks(model: nn.Module, blocks: list[str]) -> int:
    """Graphcore's application's --enable-recomputation on one device: keep only each block's input,
    recompute the rest.

    ``blocks`` are qualified module names (the residual units or EfficientNet blocks, see
    `cnns.models.recomputation_blocks`). In training each block runs under non-reentrant
    `torch.utils.checkpoint`: its inner activations are freed after the forward and recomputed in the
    backward, with the random state replayed (dropout, drop-path) and batch-norm statistics updated
    once. Gradients are bitwise those of the plain model. Returns the number of blocks wrapped.
    """
    for name in blocks:
        specialise(model.get_submodule(name), _Recomputed)
    return len(blocks)


def keep_recomputation(pieces: list, model: nn.Module) -> list:
    """`pieces` of `model` (`cnns.models.splits.Piece`) with the recomputation `recompute` gave the model: the
    parts of a recomputed block that a pipeline cut runs on their own (not through the block's forward) are
    each recomputed, the stage boundary between them kept."""
    def kept(piece):
        block = model.get_submodule(piece.block) if piece.block else None
        return replace(piece, run=recomputed(piece.run, block)) if isinstance(block, _Recomputed) else piece

    return [kept(piece) for piece in pieces]


def recompute_between_splits(model: nn.Module, segments: list) -> int:
    """Graphcore's application's recomputation points on one device (`--pipeline --shards 1 --pipeline-splits ...
    --enable-recomputation`): the model runs as its segments between the splits (lists of
    `cnns.models.splits.Piece`), and only each segment's input is kept for the backward pass;
    everything inside a segment is recomputed. Returns the number of segments."""

    def segment(pieces):
        def run(x):
            for piece in pieces:
                x = piece.run(x)
            return x

        return recomputed(run, model)

    model._cnns_segments = [segment(pieces) for pieces in segments]
    specialise(model, _RecomputedSegments)
    return len(model._cnns_segments)


# ------------------------------------------------------------------------------------------------
# compilation


def replays_cuda_graphs(compiled: bool, device: torch.device) -> bool:
    """Whether `maybe_compile` makes a model on `device` replay CUDA graphs: --compile on a GPU."""
    return compiled and device.type == "cuda"


def maybe_compile(model: nn.Module, enabled: bool) -> nn.Module:
    """torch.compile the model when --compile asks for it: the default on a GPU, off on a CPU
    (`cnns.config.defaults.device_defaults`). Compilation happens at the first call; a model that cannot
    compile fails there (`compilation_failures_named`), never silently eager.

    On a CPU the convolutions stay oneDNN calls and Inductor's fused batch-norm/ReLU kernels are no faster
    than ATen's, so compilation costs its time and gains nothing (docs/performance.md). On CUDA the
    reduce-overhead mode records CUDA graphs, which removes the per-kernel launch cost that small batches
    are bound by. A graph's replays write into memory of its own, so the training step keeps its gradients
    outside it (`TrainStep`'s ``keep_gradient_buffers``).
    """
    if not enabled:
        return model
    first = next(model.parameters(), None)
    if first is not None and replays_cuda_graphs(enabled, first.device):
        return torch.compile(model, mode="reduce-overhead")
    return torch.compile(model)


@contextlib.contextmanager
def compilation_failures_named():
    """torch.compile compiles at a model's first call (and again for a new shape): a model or option it cannot
    compile stops the command with one line that names the way out, instead of dynamo's traceback (dynamo's
    own fallback to eager, ``suppress_errors``, stays off: a run asked to compile never runs eager silently)."""
    from torch._dynamo.exc import TorchDynamoException

    try:
        yield
    except TorchDynamoException as exc:
        cause = getattr(exc, "inner_exception", None) or exc  # a backend's own error, under dynamo's wrapping
        reason = next((line for line in str(cause).splitlines() if line.strip()), type(cause).__name__)[:300]
        raise ConfigError(f"torch.compile could not compile the model ({reason}); run again with --no-compile "
                          "to run it eagerly") from None
