"""What a run builds besides the model, each from the RunConfig: its random state, its length, schedule,
optimiser, loss scaler, mixing and step (`cnns.engine.setup.set_up` calls them in its order).

How the model itself is made the run's is `cnns.engine.assembly.assemble` (and `unwrap` undoes it).
"""

from __future__ import annotations

import ctypes
import random
import sys

import numpy as np
import torch
from torch import nn

from cnns.config import RunConfig
from cnns.engine.assembly import AssembledModel
from cnns.engine.step import PipelinedTrainStep, TrainStep, cross_entropy_loss
from cnns.engine.compilation import replays_cuda_graphs
from cnns.optim import (HalfPrecisionOptimiser, OptimiserSpec, build_optimiser, build_sharded_optimiser,
                        parameter_groups)
from cnns.precision import LossScaler, PrecisionPolicy
from cnns.parallel.world import World
from cnns.lr_schedules import ScheduleSpec, warmup_steps_from_epochs


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4


def keep_freed_host_memory(device: torch.device, enabled: bool) -> bool:
    """Let glibc reuse freed tensor memory instead of handing it back to the kernel after every step.

    By default glibc serves each allocation above its mmap threshold (at most 32 MiB) with a fresh
    mmap and unmaps it when freed, so every activation of every step is page-faulted and zeroed by the
    kernel again: a large share of a CPU step's system time (docs/performance.md). Serving everything
    from the heap and never trimming it keeps the
    pages mapped; the process keeps its peak memory, which a training run reaches every step anyway.
    The counterpart of LD_PRELOADing jemalloc/tcmalloc, done in-process; --no-malloc-tuning (`enabled` False)
    leaves the allocator alone. Returns whether it was applied.
    """
    if not enabled or device.type != "cpu" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, ...): nothing to tune
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    # -1 is SIZE_MAX once glibc widens it: never trim the heap top.
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, -1))


def build_optimiser_for(model: nn.Module, cfg: RunConfig, policy: PrecisionPolicy, seed: int,
                        shard_state: bool = False, replica_group=None) -> HalfPrecisionOptimiser:
    """The run's optimiser; `shard_state` (--rts with replicas): its state sharded over the replicas
    (the processes of `replica_group`, every process when None)."""
    o = cfg.optim
    spec = OptimiserSpec(o.optimiser, o.learning_rate, **o.settings)
    # One wrapper for every precision: float32 parameters are updated in place, half ones through a
    # float32 working copy rounded back (stochastically in 16.16 unless switched off).
    # The rounding generator has the same seed on every replica: the replicas round the same update
    # the same way, so their weights stay equal.
    if shard_state:
        def make_inner(groups, spec):
            return build_sharded_optimiser(groups, spec, group=replica_group)
    else:
        make_inner = build_optimiser
    # --offload-optimiser: on an accelerator the optimiser's state and working copies stay in host memory.
    on_accelerator = next((p.device.type != "cpu" for p in model.parameters()), False)
    return HalfPrecisionOptimiser(
        parameter_groups(model, o.settings["weight_decay"]), lambda groups: make_inner(groups, spec),
        stochastic_rounding=cfg.precision.stochastic_rounding and policy.half_weights, seed=seed + 7,
        offload_to=torch.device("cpu") if cfg.parallel.offload_optimiser and on_accelerator else None,
    )


def build_lr_schedule(cfg: RunConfig, total_steps: int, epochs: float) -> ScheduleSpec:
    o = cfg.optim
    warmup = warmup_steps_from_epochs(total_steps, o.warmup_epochs, epochs) if o.warmup_epochs else 0
    warmup = min(warmup, total_steps - 1) if o.lr_schedule == "polynomial" else min(warmup, total_steps)
    # The options by their own names; the run's length adds the steps.
    return ScheduleSpec(
        lr_schedule=o.lr_schedule, learning_rate=o.learning_rate, total_steps=total_steps, warmup_steps=warmup,
        learning_rate_decay=o.learning_rate_decay, learning_rate_schedule=o.learning_rate_schedule,
        lr_decay_rate=o.lr_decay_rate, lr_drops=o.lr_drops,
        poly_lr_decay_power=o.poly_lr_decay_power, poly_lr_end_ratio=o.poly_lr_end_ratio,
    )


def build_loss_scaler(cfg: RunConfig, policy: PrecisionPolicy) -> LossScaler:
    if policy.compute_dtype == torch.float32:
        return LossScaler(1.0, dynamic=False)  # nothing to protect in float32
    return LossScaler(cfg.precision.loss_scaling, dynamic=cfg.precision.auto_loss_scaling)


def build_mixer(cfg: RunConfig, num_classes: int, seed: int):
    """Mixup/cutmix on the device batches (NCHW), or None when both are off."""
    from cnns.data.mixing import batch_mixer

    d = cfg.data
    return batch_mixer(num_classes, seed, mixup_alpha=d.mixup_alpha, cutmix_lambda=d.cutmix_lambda,
                       cutmix_version=d.cutmix_version, label_smoothing=cfg.train.label_smoothing, layout="NCHW")


def build_step(cfg: RunConfig, assembled: AssembledModel, optimiser: HalfPrecisionOptimiser, policy: PrecisionPolicy,
               scaler: LossScaler, mixer, world: World, device: torch.device) -> TrainStep | PipelinedTrainStep:
    """One weight update of the assembled model: of this process's pipeline stage, or of the whole model."""
    loss = cross_entropy_loss(cfg.train.label_smoothing)
    in_float32 = cfg.precision.gradient_accumulation_dtype == "float32"
    if assembled.stage is not None:
        return PipelinedTrainStep(assembled.stage, optimiser, policy, scaler, loss,
                                  cfg.train.gradient_accumulation_count, in_float32,
                                  world, fp_exceptions=cfg.train.fp_exceptions, mix=mixer)
    return TrainStep(assembled.model, optimiser, policy, scaler, loss, cfg.train.gradient_accumulation_count,
                     accumulate_in_float32=in_float32, fp_exceptions=cfg.train.fp_exceptions, mix=mixer,
                     replicated=assembled.replicated, replicas=world.replicas,
                     keep_gradient_buffers=replays_cuda_graphs(cfg.train.compile, device))

