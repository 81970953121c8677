"""Data-parallel replicas: DistributedDataParallel around the plain model, and its sync context.

Gradients are all-reduced once per weight update: the step runs every micro-batch but the last
under `no_sync()`, so DDP only reduces (bucketed, overlapped with the last backward) the sum of the
update's micro-batch gradients. Batch-norm running statistics stay each replica's own (no broadcast
before every forward: a collective per micro-batch); checkpoints hold replica 0's, as the seed's
did. With --BN-span the statistics used in training are the span's anyway.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from cnns.parallel.world import World


def data_parallel(model: nn.Module, world: World, device: torch.device) -> nn.Module:
    """DDP over the replicas (rank 0's initial weights broadcast to all), or the model itself."""
    if world.replicas == 1:
        return model
    return DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None,
        forward_sync_buffers=False,  # still synchronised once at construction
    )


def no_sync_context(model: nn.Module) -> Callable[[], ContextManager]:
    """The context that skips the gradient all-reduce for a micro-batch (DDP's `no_sync`)."""
    if isinstance(model, DistributedDataParallel):
        return model.no_sync
    return contextlib.nullcontext



def average_gradients(grads: list[torch.Tensor | None], group, replicas: int) -> None:
    """Average an update's gradients over the replicas in place: one all-reduce per dtype.

    For pipeline stages, whose schedule runs the backward passes itself (DDP's reducer would only
    see the last micro-batch's half gradients; the accumulated sum, float32 with half weights, is
    what has to be averaged).
    """
    import torch.distributed as dist

    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for grad in grads:
        if grad is not None:
            by_dtype.setdefault(grad.dtype, []).append(grad)
    for tensors in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in tensors])
        dist.all_reduce(flat, group=group)
        flat.div_(replicas)
        for tensor, piece in zip(tensors, flat.split([t.numel() for t in tensors])):
            tensor.copy_(piece.view(tensor.shape))
