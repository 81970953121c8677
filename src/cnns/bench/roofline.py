"""The roofline of a benchmark: the shortest time the machine could take for the model's work.

Every ATen operator of one training step (forward, backward, the optimiser's update) or inference forward is
recorded once on the meta device (shapes only), and the roofline is the sum over them of
max(FLOPs / compute peak, minimal bytes / memory bandwidth), peak and bandwidth measured (`cnns.bench.rates`).
FLOPs are torch.utils.flop_counter's, but a convolution's backward costs what its forward costs per gradient
asked for (torch counts a grouped weight gradient dense). Minimal bytes: each tensor read once and written once
in the activations' dtype (what both loops run); aliases move nothing; the optimiser reads weight, gradient and
momentum and writes weight and momentum (float32). So a norm's forward counts its input once, though a real
kernel reads it twice: the roofline is what no implementation of the same operators can beat, and only fusing
operators goes below it. A loop's fraction of its roofline is roofline seconds over measured seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

# Operators that only describe other memory or allocate without writing: no bytes move.
_ALIASES = {
    "view", "_unsafe_view", "reshape", "permute", "transpose", "t", "expand", "as_strided", "alias", "detach",
    "squeeze", "unsqueeze", "slice", "select", "split", "split_with_sizes", "unbind", "flatten", "unflatten",
    "_reshape_alias", "lift_fresh", "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
    "is_same_size",
}


@dataclass
class OpCost:
    name: str
    flops: float
    bytes: float
    # its inputs with as many elements as its largest: what a normalisation's reductions must read
    largest_input_bytes: float = 0.0


def _nbytes(tensors) -> float:
    seen: set[int] = set()
    total = 0.0
    for t in tensors:
        if isinstance(t, torch.Tensor) and id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def _convolution_backward_flops(grad_out, x, weight, bias_sizes, stride, padding, dilation, transposed,
                                output_padding, groups, output_mask) -> float:
    """The input gradient and the weight gradient each cost what the forward convolution costs.

    (torch.utils.flop_counter's formula for the weight gradient ignores ``groups``: it counts a depthwise
    convolution's as a dense one's, 32-1152x too many in EfficientNet.)"""
    # A product per output element (a transposed convolution: per input element) and weight of one group.
    forward = 2.0 * (x if transposed else grad_out).numel() * weight[0].numel()
    return forward * (int(output_mask[0]) + int(output_mask[1]))


class _OpRecorder(TorchDispatchMode):
    """Records each operator's FLOPs and minimal bytes as it runs (on meta tensors: shapes only)."""

    def __init__(self):
        super().__init__()
        self.ops: list[OpCost] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name in _ALIASES:
            return out
        flops = 0.0
        packet = func.overloadpacket
        if name == "convolution_backward":
            flops = _convolution_backward_flops(*args)
        elif packet in flop_registry:
            flops = float(flop_registry[packet](*args, **kwargs, out_val=out))
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        largest = max((t.numel() for t in inputs), default=0)
        # An in-place operator returns one of its inputs: it is read once and written once.
        self.ops.append(OpCost(name, flops, _nbytes(inputs) + _nbytes(outputs),
                               _nbytes([t for t in inputs if t.numel() == largest])))
        return out


def model_operators(model_spec, batch_size: int, train: bool, dtype: torch.dtype) -> list[OpCost]:
    """Every operator of one step of the model on a micro-batch, with its FLOPs and minimal bytes."""
    from cnns.models import build_model

    with torch.device("meta"):
        model = build_model(model_spec)
    model = model.to(dtype=dtype, memory_format=torch.channels_last).train(train)
    size = model_spec.image_size
    images = torch.empty(batch_size, 3, size, size, device="meta", dtype=dtype).contiguous(
        memory_format=torch.channels_last)
    labels = torch.zeros(batch_size, dtype=torch.long, device="meta")
    recorder = _OpRecorder()
    with recorder, torch.set_grad_enabled(train):
        logits = model(images)
        if train:
            torch.nn.functional.cross_entropy(logits.float(), labels).backward()
    ops = recorder.ops
    if train:  # SGD with momentum: read weight, gradient, momentum; write weight, momentum (float32)
        params = sum(p.numel() for p in model.parameters())
        ops.append(OpCost("optimiser", 2.0 * params, 5 * 4 * params))
    return ops


def roofline_seconds(ops: list[OpCost], peak_gflops: float, bandwidth_gbs: float) -> float:
    """Sum over the operators of the longer of their compute time and their memory time."""
    return sum(max(op.flops / (peak_gflops * 1e9), op.bytes / (bandwidth_gbs * 1e9)) for op in ops)


def update_seconds(model_spec, micro_batch: int, accumulation: int, train: bool, dtype: torch.dtype,
                   peak_gflops: float, bandwidth_gbs: float) -> float:
    """The roofline time of one weight update (``accumulation`` micro-batches and one optimiser step), or of
    one inference batch."""
    ops = model_operators(model_spec, micro_batch, train, dtype)
    passes = [op for op in ops if op.name != "optimiser"]
    update = [op for op in ops if op.name == "optimiser"]
    return (accumulation * roofline_seconds(passes, peak_gflops, bandwidth_gbs)
            + roofline_seconds(update, peak_gflops, bandwidth_gbs))
