"""What every command builds from a RunConfig before it trains or evaluates: device, precision,
data sources, the model assembled for the run (`cnns.engine.assembly.assemble`), the device feed, and this
process's world.

Training (`session`), validation and weight averaging all start here, so they build the same
model the same way; none of them imports another to get it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from cnns.config import RunConfig
from cnns.data.sources import DataSources
from cnns.devices import resolve_device
from cnns.engine.assembly import AssembledModel, assemble
from cnns.engine.build import keep_freed_host_memory, seed_everything
from cnns.engine.feed import DeviceFeed
from cnns.engine.stages import Stage
from cnns.models import build_model, count_parameters
from cnns.parallel.world import World
from cnns.precision import PrecisionPolicy


@dataclass
class Components:
    """Everything built from the configuration, before training starts."""

    device: torch.device
    policy: PrecisionPolicy
    model: nn.Module  # what runs: possibly replicated (DDP) and compiled
    plain_model: nn.Module  # what is saved and loaded
    sources: DataSources
    feed: DeviceFeed
    seed: int
    world: World = field(default_factory=World)
    assembled: AssembledModel | None = None  # how `model` runs over the processes (`cnns.engine.assembly`)
    total_parameters: int = 0  # of the whole model, whatever part of it this process holds

    @property
    def replicated(self) -> nn.Module | None:
        """The DistributedDataParallel wrapper, with replicas."""
        return self.assembled.replicated if self.assembled is not None else None

    @property
    def stage(self) -> Stage | None:
        """With pipelining: this process's stage (`model` runs it)."""
        return self.assembled.stage if self.assembled is not None else None

    def process_seed(self, offset: int, identical_replicas: bool) -> int:
        """A seed for a per-process random stream: the same on every replica only when asked
        (--identical-replica-seeding), so replicas mix or drop out differently by default."""
        return self.seed + offset + (0 if identical_replicas else self.world.replica_rank)


def build_components(cfg: RunConfig, world: World | None = None, *, need_train: bool = True,
                     need_eval: bool = True) -> Components:
    from cnns.data.sources import build_sources

    world = world or World()
    device = world.device(resolve_device(cfg.device))
    seed = cfg.train.seed
    # Replica 0 draws what a single process would (its initial weights are broadcast to the others).
    seed_everything(seed if cfg.parallel.identical_seeding else seed + world.replica_rank)
    policy = PrecisionPolicy.resolve(cfg.precision.precision, cfg.precision.half_dtype, device,
                                     half_dtype_given=cfg.precision.half_dtype_given)
    if cfg.precision.half_partials and device.type == "cuda":
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = True
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
    sources = build_sources(cfg.data, micro_batch_size=cfg.train.micro_batch_size,
                            eval_batch_size=cfg.train.eval_batch_size,
                            seed=seed, device=device, shard=world.shard, need_train=need_train, need_eval=need_eval,
                            global_batch_size=cfg.train.global_batch_size)
    keep_freed_host_memory(device)  # before the model allocates anything large
    model = build_model(cfg.model)
    total_parameters = count_parameters(model)
    feed = DeviceFeed(device, policy.weight_dtype, imagenet_normalisation=cfg.data.normalise_imagenet,
                      host_normalisation=cfg.data.host_normalisation)
    assembled = assemble(model, cfg, world, device, policy)
    return Components(device, policy, assembled.model, assembled.plain, sources, feed, seed, world, assembled,
                      total_parameters=total_parameters)
