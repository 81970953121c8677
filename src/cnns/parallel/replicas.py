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


def averaged_gradients(grads: list[torch.Tensor | None], group, replicas: int) -> list[torch.Tensor | None]:
    """An update's gradients averaged over the replicas, in float32 whatever their dtype: one all-reduce.

    For pipeline stages, whose schedule runs the backward passes itself (DDP's reducer would only
    see the last micro-batch's half gradients). The sum is taken in float32 even where the gradients are
    half (one micro-batch per update, or --gradient-accumulation-dtype half): the optimiser computes the
    update in float32 anyway, and a half all-reduce would round every replica's sum to the half spacing.
    Each average has its gradient's memory layout (`in_layout_of`), so the copies are straight passes.
    """
    import torch.distributed as dist

    from cnns.optim import in_layout_of

    present = [g for g in grads if g is not None]
    if not present:
        return list(grads)
    flat = torch.empty(sum(g.numel() for g in present), dtype=torch.float32, device=present[0].device)
    views = [in_layout_of(piece, g) for piece, g in zip(flat.split([g.numel() for g in present]), present)]
    torch._foreach_copy_(views, present)
    dist.all_reduce(flat, group=group)
    flat.div_(replicas)
    averaged = iter(views)
    return [None if g is None else next(averaged) for g in grads]
