"""A training session: build everything from a RunConfig, train, checkpoint, validate.

`train.py` and `restore.py` both end here; restore passes the checkpoint to continue from.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cnns.checkpoint import (capture_rng_state, checkpoint_path, list_checkpoints, load_checkpoint,
                             restore_rng_state, save_checkpoint)
from cnns.config import RunConfig
from cnns.engine.build import (RunLength, build_loss_scaler, build_model_for_training, build_optimiser_for,
                               build_schedule, maybe_compile, resolve_device, run_seed, seed_everything, unwrap)
from cnns.engine.evaluate import EvalResult, evaluate
from cnns.engine.feed import DeviceFeed
from cnns.engine.loop import StopRequest, TrainingLoop
from cnns.engine.step import TrainStep, cross_entropy_loss
from cnns.errors import CheckpointError
from cnns.precision import PrecisionPolicy
from cnns.runlog import RunLog


@dataclass
class Components:
    """Everything built from the configuration, before training starts."""

    device: torch.device
    policy: PrecisionPolicy
    model: nn.Module  # possibly compiled
    plain_model: nn.Module
    sources: Any
    feed: DeviceFeed
    seed: int


def build_components(cfg: RunConfig, *, need_train: bool = True, need_eval: bool = True) -> Components:
    from cnns.data.pipeline import build_sources

    device = resolve_device(cfg.device, cfg.options.get("select_ipus"))
    seed = run_seed(cfg)
    seed_everything(seed)
    policy = PrecisionPolicy.resolve(cfg.precision.precision, cfg.precision.half_dtype, device)
    if cfg.precision.half_partials and device.type == "cuda":
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = True
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
    sources = build_sources(cfg.data, micro_batch_size=cfg.train.micro_batch_size,
                            eval_batch_size=cfg.options.get("validation_micro_batch_size") or cfg.train.micro_batch_size,
                            seed=seed, device=device, need_train=need_train, need_eval=need_eval)
    plain = build_model_for_training(cfg, policy, device)
    model = maybe_compile(plain, cfg.train.compile)
    feed = DeviceFeed(device, policy.weight_dtype, imagenet_normalisation=cfg.data.normalise_imagenet,
                      host_normalisation=cfg.data.host_normalisation)
    return Components(device, policy, model, plain, sources, feed, seed)


def build_mixer(cfg: RunConfig, num_classes: int, seed: int):
    """Mixup/cutmix on the device batches (NCHW), or None when both are off."""
    from cnns.data.mixing import batch_mixer

    d = cfg.data
    return batch_mixer(num_classes, seed + 11, mixup_alpha=d.mixup_alpha, cutmix_lambda=d.cutmix_lambda,
                       cutmix_version=d.cutmix_version, label_smoothing=cfg.train.label_smoothing, layout="NCHW")


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def print_startup(log: RunLog, cfg: RunConfig, model: nn.Module, device: torch.device) -> None:
    o = cfg.options
    log.print(f"Command line: {o.get('command', '')}")
    log.print(f"{cfg.model.arch}-{cfg.model.size} on {o.get('dataset')}, device {device}, precision {o['precision']}"
              f" ({'stochastic rounding' if o['stochastic_rounding'] else 'round to nearest'})")
    log.print(f" Batch Size: {o['global_batch_size']} (micro-batch {o['micro_batch_size']}"
              f" x accumulation {o['gradient_accumulation_count']} x replicas {o['replicas']})")
    log.print(f" Learning Rate: {o['learning_rate']:.6g} ({o['lr_schedule']}, {o['optimiser']})")
    log.print(f"Total Parameters:{count_parameters(model)}")


class TrainingSession:
    def __init__(self, cfg: RunConfig, log: RunLog, folder: Path):
        self.cfg = cfg
        self.log = log
        self.folder = folder

    def run(self, restore_from: Path | None = None) -> int:
        cfg, log = self.cfg, self.log
        c = build_components(cfg, need_eval=cfg.train.validation)
        print_startup(log, cfg, c.plain_model, c.device)
        if cfg.train.compile_only:
            log.print("Model, data pipeline and optimiser built (--compile-only): exiting without training.")
            return 0
        train_source = c.sources.train
        length = RunLength.resolve(cfg, train_source.num_samples)
        schedule = build_schedule(cfg, length.total_iterations, length.epochs)
        optimiser = build_optimiser_for(c.plain_model, cfg, c.policy, c.seed)
        scaler = build_loss_scaler(cfg, c.policy)
        mixer = build_mixer(cfg, c.sources.num_classes, c.seed)
        step = TrainStep(c.model, optimiser, c.policy, scaler, cross_entropy_loss(cfg.train.label_smoothing),
                         cfg.train.grad_accum, accumulate_in_float32=cfg.precision.grad_accum_dtype == "float32",
                         fp_exceptions=cfg.train.fp_exceptions, mix=mixer)
        generators = {"mix": mixer.generator} if mixer is not None else {}
        start_iteration = 0
        if restore_from is not None:
            start_iteration = self._restore(restore_from, c, optimiser, scaler, generators)

        def save(iteration: int) -> None:
            state = {
                "model": unwrap(c.model).state_dict(),
                "optimiser": optimiser.state_dict(),
                "loss_scaler": scaler.state_dict(),
                "rng": capture_rng_state(generators),
                "iteration": iteration,
                "epoch": cfg.train.global_batch_size * iteration / train_source.num_samples,
                "seed": c.seed,
            }
            save_checkpoint(checkpoint_path(self.folder, iteration), state)

        if start_iteration == 0 and cfg.train.ckpts_per_epoch:
            save(0)
        loop = TrainingLoop(step, c.feed, train_source, schedule, length, cfg.train.grad_accum,
                            cfg.train.global_batch_size, train_source.num_samples, log, save, start_iteration)
        c.model.train()
        stop = StopRequest()
        with stop.installed(), self._profiler(cfg):
            result = loop.run(stop)
        log.print(f"Training loop completed in {result.seconds:.3f}s.")
        if result.interrupted_by:
            log.print(f"Training interrupted by {result.interrupted_by} at iteration {result.final_iteration}; "
                      f"checkpoint saved. Continue with: python restore.py --restore-path {self.folder}")
            return 0
        start = time.perf_counter()
        if cfg.train.validation and c.sources.eval is not None:
            validate_run_checkpoints(self.folder, c, log, cfg.train.global_batch_size, train_source.num_samples,
                                     skip_iteration_zero=True)
        log.print(f"Time to train: {round(result.seconds + time.perf_counter() - start, 3)}s.")
        return 0

    def _restore(self, path: Path, c: Components, optimiser, scaler, generators) -> int:
        state = load_checkpoint(path, map_location=c.device)
        try:
            unwrap(c.model).load_state_dict(state["model"])
            optimiser.load_state_dict(state["optimiser"])
            scaler.load_state_dict(state["loss_scaler"])
            restore_rng_state(state["rng"], generators)
            iteration = int(state["iteration"])
        except (KeyError, RuntimeError, ValueError) as exc:
            raise CheckpointError(f"{path} does not match this run's model or optimiser: "
                                  f"{str(exc).splitlines()[0][:200]}") from None
        self.log.print(f"Restoring training from latest checkpoint: {path}")
        return iteration

    def _profiler(self, cfg: RunConfig):
        import contextlib

        if not cfg.train.profile:
            return contextlib.nullcontext()
        from torch.profiler import ProfilerActivity, profile, tensorboard_trace_handler

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        out = cfg.train.profile_dir or str(self.folder / "profile")
        self.log.print(f"Writing a profiler trace to {out}")
        return profile(activities=activities, on_trace_ready=tensorboard_trace_handler(out))


def validate_run_checkpoints(folder: Path, c: Components, log: RunLog, global_batch_size: int,
                             num_train_samples: int, skip_iteration_zero: bool = False,
                             skip_names: set[str] | None = None) -> list[EvalResult]:
    """Validate every checkpoint of a run folder, oldest first, with the seed's validation line."""
    results = []
    for iteration, path in list_checkpoints(folder):
        if (skip_iteration_zero and iteration == 0) or (skip_names and path.stem in skip_names):
            continue
        state = load_checkpoint(path, map_location=c.device)
        unwrap(c.model).load_state_dict(state["model"])
        result = evaluate(c.model, c.sources.eval.epoch(0), c.feed, c.policy)
        log_validation(log, path.stem, iteration, global_batch_size * iteration / num_train_samples, result)
        results.append(result)
    return results


def log_validation(log: RunLog, name: str, iteration: int, epoch: float, result: EvalResult) -> None:
    log.validation_result({
        "name": name, "iteration": iteration, "epoch": epoch, "val_acc": result.top1, "raw_acc": result.top1,
        "val_time": result.seconds, "val_size": result.count, "img_per_sec": result.throughput,
        "latency": result.latency_avg_ms, "val_top5": result.top5,
    })
