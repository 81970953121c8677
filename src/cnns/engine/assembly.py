"""How a built model becomes the model a run trains and evaluates: `assemble`, whose body is the order.

Models are single-device modules that know nothing of training, precision or parallelism; everything that
changes how they run is applied here, each step one call into the module that owns it, and none of them
changes a parameter's or buffer's name, so a checkpoint always holds the plain model's state dict
(`unwrap`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from cnns.config import ParallelConfig, RunConfig
from cnns.engine.fusion import fuse_passes
from cnns.engine.stages import Stage, build_stage
from cnns.engine.compilation import maybe_compile
from cnns.engine.kernel_choice import choose_kernels
from cnns.engine.recomputation import recompute
from cnns.parallel.batchnorm import batch_norm_span, cross_replica_batch_norm
from cnns.parallel.pipeline import StageModule
from cnns.parallel.replicas import data_parallel
from cnns.parallel.world import World
from cnns.precision import PrecisionPolicy


@dataclass
class AssembledModel:
    """A model as a run uses it."""

    model: nn.Module  # what runs: this process's pipeline stage, or the (replicated, compiled) model
    plain: nn.Module  # what is saved and loaded: the model, or the part of it this stage holds
    replicated: DistributedDataParallel | None = None  # the DDP wrapper, with replicas
    stage: Stage | None = None  # with pipelining: this process's stage
    fused: int = 0  # the layers given the fused CPU passes (`cnns.engine.fusion.fuse_passes`), for the header


def assemble(model: nn.Module, cfg: RunConfig, world: World, device: torch.device,
             policy: PrecisionPolicy) -> AssembledModel:
    """The built single-device `model` made the run's, in this order:

    0. training-time norm settings (--BN-decay)
    1. precision: weight dtype, norms kept float32 where the policy says, channels_last on the device
    2. fused passes (CPU): norm + activation (+ residual) and squeeze-excitation, batch norms taking the
       --BN-span's statistics where there is a span; then the kernels (GPU algorithms, float32 kernels for the
       half convolutions of a CPU that only emulates the half type, else the bfloat16 depthwise backward,
       channels_last gradients)
    3. recomputation (--enable-recomputation): per block, or per segment between --pipeline-splits on one device
       (a pipeline stage that cuts inside a recomputed block keeps it for the parts: `keep_recomputation`)
    4. cross-replica batch norm (--BN-span, the batch norms the fused passes left), then this process's
       pipeline stage (--shards > 1, replicas start equal) or data parallel (--replicas > 1, DDP)
    5. compilation (--compile, which a pipeline stage never has: `cnns.config.defaults.stages_compile`)

    The fused passes come before recomputation so that a recomputed block recomputes the fused forward, and
    both before the parallel wrappers, which cut (stages) or wrap (DDP) the finished single-device model.
    """
    set_norm_momentum(model, cfg.train.BN_decay)
    policy.apply_to_model(model)
    model.to(device=device, memory_format=torch.channels_last)
    fused = fuse_passes(model, device, batch_norm_span(world.bn_group), cfg.train.fused_norm)
    choose_kernels(model, device, policy.compute_dtype, reproducible=cfg.train.seed_specified)
    if cfg.parallel.enable_recomputation:
        recompute(model, cfg.model, cfg.parallel.pipeline_splits,
                  between_splits=recomputes_between_splits(cfg.parallel))
    model, _ = cross_replica_batch_norm(model, world.bn_group, device)
    if world.shards > 1:
        stage = build_stage(cfg, model, world, device, policy)
        world.broadcast_state(stage.module.model, among_replicas=True)
        return AssembledModel(stage.module, stage.module.model, stage=stage, fused=fused)
    replicated = data_parallel(model, world, device)
    running = maybe_compile(replicated, cfg.train.compile)
    return AssembledModel(running, model, replicated if replicated is not model else None, fused=fused)


def set_norm_momentum(model: nn.Module, decay: float) -> None:
    """Graphcore's application's --BN-decay d is torch's momentum 1-d (a training setting, so not in model code):
    the one place the decay becomes a momentum."""
    momentum = 1.0 - decay
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.momentum = momentum


def recomputes_between_splits(p: ParallelConfig) -> bool:
    """Whether --pipeline-splits mark recomputation points on one device, as Graphcore's application's
    single-IPU pipeline did (`--pipeline --shards 1 --pipeline-splits ... --enable-recomputation`)."""
    return p.pipeline and p.shards == 1 and bool(p.pipeline_splits) and p.enable_recomputation


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model under any compilation and replication (DDP) wrapper; of a pipeline stage, the
    part of the model it holds (under the whole model's names)."""
    model = getattr(model, "_orig_mod", model)
    model = model.module if isinstance(model, DistributedDataParallel) else model
    return model.model if isinstance(model, StageModule) else model
