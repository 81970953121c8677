"""What a training run builds beyond the components: its length, schedule, optimiser, loss scaler, step,
moving average and extra random streams (everything a checkpoint saves and restores besides the model)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cnns.config import RunConfig
from cnns.engine.build import RunLength, build_loss_scaler, build_optimiser_for, build_lr_schedule
from cnns.engine.components import Components
from cnns.engine.ema import WeightEma, build_ema
from cnns.engine.step import PipelinedTrainStep, TrainStep, cross_entropy_loss
from cnns.engine.wrappers import replays_cuda_graphs
from cnns.optim import HalfPrecisionOptimiser
from cnns.parallel.replicas import no_sync_context
from cnns.precision import LossScaler
from cnns.schedules import ScheduleSpec


def build_mixer(cfg: RunConfig, num_classes: int, seed: int):
    """Mixup/cutmix on the device batches (NCHW), or None when both are off."""
    from cnns.data.mixing import batch_mixer

    d = cfg.data
    return batch_mixer(num_classes, seed, mixup_alpha=d.mixup_alpha, cutmix_lambda=d.cutmix_lambda,
                       cutmix_version=d.cutmix_version, label_smoothing=cfg.train.label_smoothing, layout="NCHW")


@dataclass
class TrainingParts:
    """What a training run adds to the components; everything a checkpoint saves and restores."""

    length: RunLength
    schedule: ScheduleSpec
    optimiser: HalfPrecisionOptimiser
    scaler: LossScaler
    step: TrainStep | PipelinedTrainStep
    ema: WeightEma | None
    generators: dict[str, torch.Generator]  # random streams beyond the global ones, saved by name


def build_training_parts(cfg: RunConfig, c: Components) -> TrainingParts:
    world = c.world
    length = RunLength.resolve(cfg, c.sources.train.num_samples)
    schedule = build_lr_schedule(cfg, length.total_iterations, length.epochs)
    optimiser = build_optimiser_for(c.plain_model, cfg, c.policy, c.seed,
                                    shard_state=cfg.parallel.rts and world.replicas > 1,
                                    replica_group=world.replica_group)
    scaler = build_loss_scaler(cfg, c.policy)
    mixer = build_mixer(cfg, c.sources.num_classes, c.process_seed(11, cfg.parallel.identical_seeding))
    generators = {"mix": mixer.generator} if mixer is not None else {}
    ema = build_ema(c.plain_model, cfg.train.ema_decay)
    if c.stage is not None:
        step = PipelinedTrainStep(c.stage, optimiser, c.policy, scaler, cross_entropy_loss(cfg.train.label_smoothing),
                                  cfg.train.grad_accum, cfg.precision.grad_accum_dtype == "float32", world,
                                  fp_exceptions=cfg.train.fp_exceptions, mix=mixer)
        return TrainingParts(length, schedule, optimiser, scaler, step, ema, generators)
    step = TrainStep(c.model, optimiser, c.policy, scaler, cross_entropy_loss(cfg.train.label_smoothing),
                     cfg.train.grad_accum, accumulate_in_float32=cfg.precision.grad_accum_dtype == "float32",
                     fp_exceptions=cfg.train.fp_exceptions, mix=mixer, no_sync=no_sync_context(c.replicated),
                     replicated=c.replicated is not None,
                     keep_gradient_buffers=replays_cuda_graphs(cfg.train.compile, c.device))
    c.assembled.reduce_in_float32(step.accumulator)
    return TrainingParts(length, schedule, optimiser, scaler, step, ema, generators)


