"""--BN-span N: batch-norm statistics computed over the N replicas of one span, not over each micro-batch.

Why this exists: torch's ``nn.SyncBatchNorm`` refuses CPU tensors. Checked with torch 2.14.1 in a
2-process gloo group: a training-mode forward on a CPU tensor raises
``ValueError: SyncBatchNorm expected input tensor to be on GPU or XPU or privateuseone``. So on the
CPU every batch norm's forward is replaced (a bound method on the instance) by the cross-replica
normalisation below, written by hand because no
library offers it; on CUDA ``SyncBatchNorm`` serves (timm's ``convert_sync_batchnorm``, which also
converts timm's ``BatchNormAct2d``).

What is reduced: in training mode each batch norm sums, over N and the spatial dimensions of its
local input, each channel's values and squared values in float32, appends the local count, and
reduces those 2C+1 float32 numbers with ONE all-reduce (sum) over the span's process group, per
layer per forward. Then mean = sum / count, biased variance = sum of squares / count - mean²
(clamped at 0), and the input is normalised and scaled exactly as ``F.batch_norm`` does with the
span's combined batch; running statistics are updated as torch's batch norm updates them (momentum
or, with ``momentum=None``, the cumulative average; unbiased variance count / (count - 1);
``num_batches_tracked`` + 1), so every replica of a span keeps the same running statistics. In eval
mode the original forward runs (running statistics, no communication). The arithmetic is float32
whatever the input's dtype; the output has the input's dtype and memory format.

The reduction is ``torch.distributed._functional_collectives.all_reduce``: torch 2.14.1 deprecates
``torch.distributed.nn.functional.all_reduce`` (a FutureWarning on every first call, and an error
under torch.compile) and names this one as its replacement; it has a registered autograd formula
(backward = all-reduce sum of the gradient) and torch.compile can trace it.

Why the gradient is right: the statistics are a sum over every replica's input, and the backward of
an all-reduce (sum) is an all-reduce (sum) of the gradients with respect to its output. So the
gradient that reaches each replica's input through the mean and variance is the sum over the span's
replicas of d(local loss)/d(statistics): each replica's input gets the gradient of the SUM of the
span's local losses. DDP then averages parameter gradients over the R replicas, and with every local
loss a mean over its own micro-batch, the result is the gradient of the mean loss over the combined
batch — exactly the gradient of the plain model on that batch (tests/test_cross_replica_batchnorm.py
checks it to 1e-5 against a single process). Note that the sum of squares minus the squared mean loses
precision when a channel's mean is large against its spread (float32 cancellation); torch's own CPU
batch norm computes the variance in two passes.
"""

from __future__ import annotations

import functools
import types

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


class BatchNormSpan:
    """The replicas of one --BN-span as the fused batch-norm passes (`cnns.engine.fusion`) use them on a CPU.

    The passes sum per-channel statistics over the span between their passes (`sum`); where a tensor is not
    theirs to take they call `normalise`, this module's torch version. A layer they handle is `claim`-ed, so
    that `cross_replica_batch_norm` leaves it alone.
    """

    def __init__(self, group: "dist.ProcessGroup") -> None:
        self.group = group

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` summed over the span's processes (a new tensor; every process must call it)."""
        total = values.clone()
        dist.all_reduce(total, group=self.group)
        return total

    def normalise(self, bn: _BatchNorm, x: torch.Tensor) -> torch.Tensor:
        """A training-mode batch norm of ``x`` with the span's statistics (no activation)."""
        bn._check_input_dim(x)
        return _normalise_over_span(bn, x, self.group)

    @staticmethod
    def claim(bn: _BatchNorm) -> None:
        bn._cnns_bn_span = True


def batch_norm_span(group: "dist.ProcessGroup | None") -> BatchNormSpan | None:
    """The span of ``group`` for the fused passes, or None where there is nothing to span (no group, or one
    process)."""
    if group is None or dist.get_world_size(group) <= 1:
        return None
    return BatchNormSpan(group)


def cross_replica_batch_norm(model: nn.Module, group: "dist.ProcessGroup | None",
                             device: torch.device) -> tuple[nn.Module, int]:
    """--BN-span N: make every batch-norm layer of `model` compute its training statistics over all
    processes of `group` (the replicas of one BN span).

    Returns ``(model, converted)``: the model to use from now on and the number of batch-norm layers
    converted. ``group`` None, or a group of one process: nothing changes, ``(model, 0)``.

    CPU: each layer's forward is patched in place, so the returned model is the same object, module
    types and ``state_dict()`` keys are unchanged and checkpoints load into a plain model. Apply it
    before wrapping in DDP (DDP then still sees the same parameters). Layers the fused passes already
    span (`BatchNormSpan.claim`) are left as they are.

    CUDA (and other accelerators torch's SyncBatchNorm supports): the layers are REPLACED by
    ``nn.SyncBatchNorm`` (timm's ``SyncBatchNormAct`` for ``BatchNormAct2d``), sharing the original
    parameters and buffers, so the state-dict keys are the same but the module objects are new; when
    `model` is itself a batch norm the returned model is a new object. Use the returned model. No test covers
    this path yet (the CUDA tier's two-GPU test trains with group norm); docs/gpus.md says what
    has run on GPUs.
    """
    if group is None or dist.get_world_size(group) <= 1:
        return model, 0
    if device.type != "cpu":
        # torch's SyncBatchNorm on accelerators; the CPU path below spans with the functional collectives.
        from timm.layers import convert_sync_batchnorm

        converted = sum(isinstance(module, _BatchNorm) and not isinstance(module, nn.SyncBatchNorm)
                        for module in model.modules())
        return convert_sync_batchnorm(model, process_group=group), converted

    converted = 0
    for module in model.modules():
        if not isinstance(module, _BatchNorm) or getattr(module, "_cnns_bn_span", False):
            continue
        post = _post_normalisation(module)
        # The one bound-method patch left: the process group must stay out of the module's state (a subclass
        # would have to store it there, and EMA's deep copy and state_dict would then meet it).
        module.forward = types.MethodType(functools.partial(_cross_replica_forward, group=group, post=post),
                                          module)
        module._cnns_bn_span = True
        converted += 1
    return model, converted


def _post_normalisation(module: _BatchNorm) -> bool:
    """Whether the layer's own forward applies ``self.drop`` and ``self.act`` after the normalisation.

    A plain batch norm (forward = ``_BatchNorm.forward``): no. timm's ``BatchNormAct2d`` (its forward is
    a copy of ``_BatchNorm.forward`` followed by ``self.drop`` and ``self.act``): yes. Any other forward
    is refused rather than silently left local or half replaced.
    """
    forward = type(module).forward
    if forward is _BatchNorm.forward:
        return False
    try:
        from timm.layers import BatchNormAct2d
    except ImportError:  # pragma: no cover - timm is a dependency
        BatchNormAct2d = None
    if BatchNormAct2d is not None and forward is BatchNormAct2d.forward:
        return True
    raise TypeError(f"--BN-span: {type(module).__qualname__} has a forward of its own that the CPU "
                    f"cross-replica batch norm does not know how to keep")


def _cross_replica_forward(self: _BatchNorm, x: torch.Tensor, *, group, post: bool) -> torch.Tensor:
    if not self.training:
        # Eval: running statistics (or, without them, the local batch's), as SyncBatchNorm does.
        return type(self).forward(self, x)
    self._check_input_dim(x)
    y = _normalise_over_span(self, x, group)
    if post:
        y = self.act(self.drop(y))
    return y


def _normalise_over_span(bn: _BatchNorm, x: torch.Tensor, group) -> torch.Tensor:
    import torch.distributed._functional_collectives as collectives

    channels = x.shape[1]
    dims = [0, *range(2, x.dim())]
    shape = (1, channels) + (1,) * (x.dim() - 2)
    # Float32 arithmetic under any autocast, whatever the input's and the parameters' dtypes.
    with torch.autocast(device_type=x.device.type, enabled=False):
        x32 = x.float()
        local = torch.cat([x32.sum(dims), x32.square().sum(dims),
                           x32.new_full((1,), float(x.numel() // max(channels, 1)))])
        total = collectives.all_reduce(local, "sum", group)
        count = total[2 * channels]
        mean = total[:channels] / count
        var = (total[channels:2 * channels] / count - mean.square()).clamp_min(0)
        scale = torch.rsqrt(var + bn.eps)
        if bn.weight is not None:
            scale = scale * bn.weight.float()
        shift = -mean * scale
        if bn.bias is not None:
            shift = shift + bn.bias.float()
        # One pass over the input; keeps its memory format (channels_last stays channels_last).
        y = torch.addcmul(shift.view(shape), x32, scale.view(shape))
        if bn.track_running_stats:
            _update_running_statistics(bn, mean.detach(), var.detach(), count.detach())
    return y.to(x.dtype)


@torch.no_grad()
def _update_running_statistics(bn: _BatchNorm, mean: torch.Tensor, var: torch.Tensor, count: torch.Tensor):
    """What ``_BatchNorm.forward`` and ``F.batch_norm`` do to the buffers in training mode."""
    factor = 0.0 if bn.momentum is None else bn.momentum
    if bn.num_batches_tracked is not None:
        bn.num_batches_tracked.add_(1)
        if bn.momentum is None:  # cumulative moving average
            factor = 1.0 / float(bn.num_batches_tracked)
    if bn.running_mean is None or bn.running_var is None:
        return
    unbiased = var * (count / (count - 1).clamp_min(1))
    bn.running_mean.copy_(mean * factor + bn.running_mean.float() * (1 - factor))
    bn.running_var.copy_(unbiased * factor + bn.running_var.float() * (1 - factor))
