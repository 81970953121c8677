"""Wiring: a RunConfig becomes the model, optimiser, schedule and loss scaler the loop runs.

Order of model wrapping is fixed: build -> training-time norm settings -> precision -> channels_last
-> device -> the wrappers of `cnns.engine.wrappers` (backward layouts, depthwise routing,
recomputation) -> the parallel wrappers of `cnns.engine.parallelize` (cross-replica batch norm, pipeline
stage or DDP, compilation). Checkpoints always save the plain model (`unwrap`), so their keys are those of a
single-process run of the same model.
"""

from __future__ import annotations

import ctypes
import os
import random
import sys
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from cnns.config import RunConfig
from cnns.optim import (HalfPrecisionOptimiser, OptimiserSpec, build_optimiser, build_sharded_optimiser,
                        parameter_groups)
from cnns.precision import LossScaler, PrecisionPolicy
from cnns.engine.fusion import (fuse_norm_activations, fuse_squeeze_excitation, fused_norms,
                                fuses_squeeze_excitation)
from cnns.engine.wrappers import (choose_gpu_kernels, keep_gradients_channels_last, recompute_between_splits,
                                  recompute_blocks, route_slow_depthwise_backward)
from cnns.schedules import ScheduleSpec, warmup_steps_from_epochs


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def run_seed(cfg: RunConfig) -> int:
    """The run's seed: --seed, or a fresh one (recorded in arguments.json so the run can be replayed)."""
    if cfg.train.seed is not None:
        return cfg.train.seed
    return int.from_bytes(os.urandom(4), "little")


def set_norm_momentum(model: nn.Module, momentum: float) -> None:
    """The seed's --BN-decay d is torch's momentum 1-d (a training setting, so not in model code)."""
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.momentum = momentum


# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4


def keep_freed_host_memory(device: torch.device) -> bool:
    """Let glibc reuse freed tensor memory instead of handing it back to the kernel after every step.

    By default glibc serves each allocation above its mmap threshold (at most 32 MiB) with a fresh
    mmap and unmaps it when freed, so every activation of every step is page-faulted and zeroed by the
    kernel again: on this 2-core CPU about 1.3 GB of faults per ResNet-50 step (batch 32), 0.4 s of
    system time, 8-12 % of the step. Serving everything from the heap and never trimming it keeps the
    pages mapped; the process keeps its peak memory, which a training run reaches every step anyway.
    The counterpart of LD_PRELOADing jemalloc/tcmalloc, done in-process. CNNS_MALLOC_TUNING=0 turns
    it off. Returns whether it was applied.
    """
    if device.type != "cpu" or not sys.platform.startswith("linux") or os.environ.get("CNNS_MALLOC_TUNING") == "0":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, ...): nothing to tune
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    # -1 is SIZE_MAX once glibc widens it: never trim the heap top.
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, -1))


def build_model_for_training(cfg: RunConfig, policy: PrecisionPolicy, device: torch.device,
                             bn_group=None) -> nn.Module:
    """The plain model, on the device, with the run-time wrappers of `cnns.engine.wrappers` in their
    order; the fused batch norms take their statistics over the --BN-span group of replicas when there is one
    (the parallel wrappers come after, `cnns.engine.parallelize`)."""
    from cnns.models import build_model, recomputation_blocks
    from cnns.parallel.batchnorm import batch_norm_span

    keep_freed_host_memory(device)  # before the model and the data allocate anything large
    model = build_model(cfg.model)
    set_norm_momentum(model, cfg.train.bn_momentum)
    policy.apply_to_model(model)
    model.to(device=device, memory_format=torch.channels_last)
    norms = fused_norms(device)
    if norms:  # with a --BN-span, the fused batch norms take the span's statistics
        fuse_norm_activations(model, norms, batch_norm_span(bn_group))
    if fuses_squeeze_excitation(device):
        fuse_squeeze_excitation(model)
    keep_gradients_channels_last(model)
    if device.type == "cuda":
        choose_gpu_kernels(model, reproducible=cfg.train.seed_specified)
    if device.type == "cpu" and policy.compute_dtype == torch.bfloat16:  # 16.16 and 16.32
        route_slow_depthwise_backward(model)
    if cfg.parallel.recomputation and recomputation_points(cfg):
        recompute_between_splits(model, recomputation_segments(cfg, model))
    elif cfg.parallel.recomputation:
        recompute_blocks(model, recomputation_blocks(cfg.model, model))
    return model


def recomputation_points(cfg: RunConfig) -> bool:
    """Whether --pipeline-splits mark recomputation points on one device, as the seed's single-IPU
    pipeline did (`--pipeline --shards 1 --pipeline-splits ... --enable-recomputation`)."""
    p = cfg.parallel
    return p.pipeline and p.shards == 1 and bool(p.splits) and p.recomputation


def recomputation_segments(cfg: RunConfig, model: nn.Module) -> list:
    from cnns.models import resolve_splits
    from cnns.models.splits import model_pieces, stage_pieces

    cuts = resolve_splits(cfg.model, model, list(cfg.parallel.splits))
    return stage_pieces(model_pieces(cfg.model, model, cuts), cuts)


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model under any compilation and replication (DDP) wrapper; of a pipeline stage, the
    part of the model it holds (under the whole model's names)."""
    from torch.nn.parallel import DistributedDataParallel

    from cnns.parallel.pipeline import StageModule

    model = getattr(model, "_orig_mod", model)
    model = model.module if isinstance(model, DistributedDataParallel) else model
    return model.model if isinstance(model, StageModule) else model


def build_optimiser_for(model: nn.Module, cfg: RunConfig, policy: PrecisionPolicy, seed: int,
                        shard_state: bool = False, replica_group=None) -> HalfPrecisionOptimiser:
    """The run's optimiser; `shard_state` (--rts with replicas): its state sharded over the replicas
    (the processes of `replica_group`, every process when None)."""
    o = cfg.optim
    spec = OptimiserSpec(
        name=o.optimiser, lr=o.learning_rate, momentum=o.momentum, weight_decay=o.weight_decay,
        rmsprop_decay=o.rmsprop_decay, rmsprop_epsilon=o.rmsprop_epsilon, lars_eeta=o.lars_eeta,
        lars_epsilon=o.lars_epsilon, lars_weight_decay=o.lars_weight_decay,
    )
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
        parameter_groups(model, o.weight_decay), lambda groups: make_inner(groups, spec),
        stochastic_rounding=cfg.precision.stochastic_rounding and policy.half_weights, seed=seed + 7,
        offload_to=torch.device("cpu") if cfg.parallel.offload_optimiser and on_accelerator else None,
    )


def build_lr_schedule(cfg: RunConfig, total_steps: int, epochs: float) -> ScheduleSpec:
    o = cfg.optim
    warmup = warmup_steps_from_epochs(total_steps, o.warmup_epochs, epochs) if o.warmup_epochs else 0
    warmup = min(warmup, total_steps - 1) if o.lr_schedule == "polynomial" else min(warmup, total_steps)
    return ScheduleSpec(
        kind=o.lr_schedule, base_lr=o.learning_rate, total_steps=total_steps, warmup_steps=warmup,
        decay=o.learning_rate_decay, boundaries=o.learning_rate_schedule,
        decay_rate=o.lr_decay_rate, num_drops=o.lr_drops,
        poly_power=o.poly_power, end_ratio=o.poly_end_ratio,
    )


def build_loss_scaler(cfg: RunConfig, policy: PrecisionPolicy) -> LossScaler:
    if policy.compute_dtype == torch.float32:
        return LossScaler(1.0, dynamic=False)  # nothing to protect in float32
    return LossScaler(cfg.precision.loss_scaling, dynamic=cfg.precision.auto_loss_scaling)


@dataclass(frozen=True)
class RunLength:
    """How long the run is, in weight updates, and the cadences derived from it (the seed's rules)."""

    total_iterations: int
    iterations_per_epoch: int
    epochs: float
    log_every: int
    sync_every: int
    ckpt_every: int | None  # None: only the final checkpoint
    ckpt_offset: int

    @classmethod
    def resolve(cls, cfg: RunConfig, num_train_samples: int) -> "RunLength":
        t = cfg.train
        per_epoch = max(1, num_train_samples // t.global_batch_size)
        if t.iterations is not None:
            total = t.iterations
            epochs = total * t.global_batch_size / num_train_samples
            log_every = max(1, t.log_freq)
        else:
            total = max(1, int(num_train_samples * t.epochs // t.global_batch_size))
            epochs = t.epochs
            log_every = max(1, int(per_epoch // t.logs_per_epoch)) if t.logs_per_epoch else total
        log_every = min(log_every, total)
        di = t.device_iterations
        sync_every = log_every if log_every < di else max(1, log_every // max(1, round(log_every / di)))
        ckpt_every = None
        if t.ckpts_per_epoch:
            ckpt_every = max(1, int(per_epoch / t.ckpts_per_epoch))
        return cls(total, per_epoch, epochs, log_every, sync_every, ckpt_every,
                   int(t.ckpt_epochs_offset * per_epoch))
