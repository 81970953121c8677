"""Data-parallel replicas: DistributedDataParallel around the plain model.

Gradients are all-reduced once per weight update: the step (`cnns.engine.step.TrainStep`) runs every
micro-batch but the last under DDP's `no_sync()`, so DDP only reduces (bucketed, overlapped with the last
backward) the sum of the update's micro-batch gradients. Batch-norm running statistics are each replica's own while it
trains (no broadcast before every forward: a collective per micro-batch) and are averaged over the
replicas before every checkpoint (`average_running_statistics`, timm's ``--dist-bn reduce``), so every
instance saves, validates and continues with the same model. With --BN-span the statistics used in
training are the span's, as before.
"""

from __future__ import annotations

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


def average_running_statistics(model: nn.Module, world: World) -> None:
    """Every norm layer's running mean and variance averaged over the replicas, in one all-reduce.

    Each replica's statistics are those of its own shard of the data; their mean is what one process
    running all the shards would have tracked (to the momentum's second order), and it makes the
    replicas' models identical again. Layers are found by their buffers (torch's batch norms, the
    span's and the fused kernels' modules alike)."""
    if world.replicas == 1:
        return
    buffers = [buffer for module in model.modules()
               for buffer in (getattr(module, "running_mean", None), getattr(module, "running_var", None))
               if isinstance(buffer, torch.Tensor)]
    if not buffers:
        return
    flat = world.average_among_replicas_(torch.cat([b.detach().float().flatten() for b in buffers]))
    with torch.no_grad():
        for buffer, values in zip(buffers, flat.split([b.numel() for b in buffers])):
            buffer.copy_(values.view_as(buffer))


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
