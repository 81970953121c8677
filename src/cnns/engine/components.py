"""What every command builds from a RunConfig before it trains or evaluates: device, precision,
data sources, the model with its run-time wrappers, the device feed, and this process's world.

Training (`session`), validation and weight averaging all start here, so they build the same
model the same way; none of them imports another to get it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from cnns.config import RunConfig
from cnns.engine.build import build_model_for_training, resolve_device, run_seed, seed_everything
from cnns.engine.feed import DeviceFeed
from cnns.engine.stages import Stage, build_stage
from cnns.engine.wrappers import maybe_compile
from cnns.models import count_parameters
from cnns.parallel.replicas import data_parallel
from cnns.parallel.world import World
from cnns.precision import PrecisionPolicy


@dataclass
class Components:
    """Everything built from the configuration, before training starts."""

    device: torch.device
    policy: PrecisionPolicy
    model: nn.Module  # what runs: possibly replicated (DDP) and compiled
    plain_model: nn.Module  # what is saved and loaded
    sources: Any
    feed: DeviceFeed
    seed: int
    world: World = field(default_factory=World)
    replicated: nn.Module | None = None  # the DistributedDataParallel wrapper, with replicas
    stage: Stage | None = None  # with pipelining: this process's stage (`model` runs it)
    total_parameters: int = 0  # of the whole model, whatever part of it this process holds

    def process_seed(self, offset: int, identical_replicas: bool) -> int:
        """A seed for a per-process random stream: the same on every replica only when asked
        (--identical-replica-seeding), so replicas mix or drop out differently by default."""
        return self.seed + offset + (0 if identical_replicas else self.world.replica_rank)


def build_components(cfg: RunConfig, world: World | None = None, *, need_train: bool = True,
                     need_eval: bool = True) -> Components:
    from cnns.data.pipeline import build_sources

    world = world or World()
    device = world.device(resolve_device(cfg.device, cfg.options.get("select_ipus")))
    seed = run_seed(cfg)
    # Replica 0 draws what a single process would (its initial weights are broadcast to the others).
    seed_everything(seed if cfg.parallel.identical_seeding else seed + world.replica_rank)
    policy = PrecisionPolicy.resolve(cfg.precision.precision, cfg.precision.half_dtype, device,
                                     avoid_emulated_half=not cfg.precision.half_dtype_given)
    if cfg.precision.half_partials and device.type == "cuda":
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = True
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
    sources = build_sources(cfg.data, micro_batch_size=cfg.train.micro_batch_size,
                            eval_batch_size=cfg.options.get("validation_micro_batch_size") or cfg.train.micro_batch_size,
                            seed=seed, device=device, shard=world.shard, need_train=need_train, need_eval=need_eval,
                            global_batch_size=cfg.train.global_batch_size)
    plain = build_model_for_training(cfg, policy, device, world.bn_group)
    total_parameters = count_parameters(plain)
    feed = DeviceFeed(device, policy.weight_dtype, imagenet_normalisation=cfg.data.normalise_imagenet,
                      host_normalisation=cfg.data.host_normalisation)
    if world.shards > 1:
        # Pipelined: the stage replaces the model; its gradients are averaged over the replicas by
        # the pipelined step (not DDP: see cnns.engine.step.PipelinedTrainStep).
        stage = build_stage(cfg, plain, world, device, policy)
        world.broadcast_state(stage.module.model, among_replicas=True)  # replicas start equal (as DDP does)
        return Components(device, policy, stage.module, stage.module.model, sources, feed, seed, world,
                          stage=stage, total_parameters=total_parameters)
    replicated = data_parallel(plain, world, device)
    model = maybe_compile(replicated, cfg.train.compile)
    return Components(device, policy, model, plain, sources, feed, seed, world,
                      replicated if replicated is not plain else None, total_parameters=total_parameters)
