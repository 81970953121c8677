"""Parallelism applied to a built model in one place, in one fixed order (torchtitan's shape).

    1. cross-replica batch norm (--BN-span): batch-norm statistics over the span's replicas
    2. pipeline stage (--shards > 1): this process's part of the model replaces it; replicas start equal
       (the pipelined step averages the stage's gradients over its replicas, not DDP)
    3. data parallel (--replicas > 1): DDP, rank 0's weights broadcast at construction
    4. the float32 reduction of accumulated half gradients, as DDP's communication hook, registered once
       the step that owns the sums exists (`Parallelized.reduce_in_float32`)
    5. compilation (--compile)

The model code knows none of this; `cnns.engine.build` builds the single-device model with its run-time
wrappers (precision, channels_last, fused passes, recomputation) before it. The mechanisms live in
`cnns.parallel`; this module is in the engine because the stage cut needs the engine's recomputation
wrapper and the optimiser's parameter order, which `cnns.parallel` sits below.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from cnns.config import RunConfig
from cnns.engine.stages import Stage, build_stage
from cnns.engine.wrappers import maybe_compile
from cnns.parallel.batchnorm import cross_replica_batch_norm
from cnns.parallel.replicas import data_parallel
from cnns.parallel.world import World
from cnns.precision import PrecisionPolicy


@dataclass
class Parallelized:
    model: nn.Module  # what runs: the stage, or the (replicated, compiled) model
    plain: nn.Module  # what is saved and loaded: the model, or the stage's part of it
    replicated: nn.Module | None = None  # the DistributedDataParallel wrapper, with replicas
    stage: Stage | None = None  # with pipelining: this process's stage
    replicas: int = 1

    def reduce_in_float32(self, accumulator) -> None:
        """Step 4: where the step sums half gradients in float32 over the micro-batches
        (`cnns.engine.step.FloatGradientAccumulator`), DDP all-reduces that float32 sum instead of the last
        micro-batch's half gradients."""
        if self.replicated is not None and accumulator.enabled:
            self.replicated.register_comm_hook(None, accumulator.reduce_hook(None, self.replicas))


def parallelize(plain: nn.Module, cfg: RunConfig, world: World, device: torch.device,
                policy: PrecisionPolicy) -> Parallelized:
    plain, _ = cross_replica_batch_norm(plain, world.bn_group, device)
    if world.shards > 1:
        stage = build_stage(cfg, plain, world, device, policy)
        world.broadcast_state(stage.module.model, among_replicas=True)
        return Parallelized(stage.module, stage.module.model, stage=stage, replicas=world.replicas)
    replicated = data_parallel(plain, world, device)
    model = maybe_compile(replicated, cfg.train.compile)
    return Parallelized(model, plain, replicated if replicated is not plain else None, replicas=world.replicas)
