"""A training session: build everything from a RunConfig, train, checkpoint, average, validate.

`train.py` and `restore.py` both end here; restore passes the checkpoint to continue from. A
checkpoint holds everything the continuation needs to be exact: model, optimiser (with its
stochastic-rounding generator), loss scaler, every random stream, the moving average of the
weights, and the iteration, which fixes both the data position (iteration x accumulation
micro-batches, the order being a pure function of seed, epoch and batch) and the learning rate
(a closed form of the iteration).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cnns.checkpoint import capture_rng_state, checkpoint_path, restore_rng_state, save_checkpoint
from cnns.config import RunConfig
from cnns.engine.averaging import training_time_averages
from cnns.engine.build import (RunLength, build_loss_scaler, build_optimiser_for, build_schedule, unwrap)
from cnns.engine.components import Components, build_components
from cnns.engine.ema import WeightEma, build_ema
from cnns.engine.loop import LoopResult, StopRequest, TrainingLoop
from cnns.engine.stages import stage_model_state, stage_optimiser_state, stage_part, whole_from_parts
from cnns.engine.step import PipelinedTrainStep, TrainStep, cross_entropy_loss
from cnns.engine.wrappers import replays_cuda_graphs
from cnns.engine.validation import generated_validation_limit, validate_run_folder
from cnns.errors import CheckpointError
from cnns.models import count_parameters
from cnns.parallel.replicas import average_running_statistics, no_sync_context
from cnns.parallel.world import World
from cnns.runlog import RunLog
from cnns.runs import RestorePoint
from cnns.weights import InitialWeights


def build_mixer(cfg: RunConfig, num_classes: int, seed: int):
    """Mixup/cutmix on the device batches (NCHW), or None when both are off."""
    from cnns.data.mixing import batch_mixer

    d = cfg.data
    return batch_mixer(num_classes, seed, mixup_alpha=d.mixup_alpha, cutmix_lambda=d.cutmix_lambda,
                       cutmix_version=d.cutmix_version, label_smoothing=cfg.train.label_smoothing, layout="NCHW")


def print_startup(log: RunLog, cfg: RunConfig, model: nn.Module, c: Components) -> None:
    o = cfg.options
    log.print(f"Command line: {o.get('command', '')}")
    log.print(f"{cfg.model.arch}-{cfg.model.size} on {o.get('dataset')}, device {c.device}, precision {o['precision']}"
              f" ({'stochastic rounding' if o['stochastic_rounding'] else 'round to nearest'})")
    if c.policy.note:
        log.print(c.policy.note)
    log.print(f" Batch Size: {o['global_batch_size']} (micro-batch {o['micro_batch_size']}"
              f" x accumulation {o['gradient_accumulation_count']} x replicas {o['replicas']})")
    log.print(f" Learning Rate: {o['learning_rate']:.6g} ({o['lr_schedule']}, {o['optimiser']})")
    log.print(f"Total Parameters:{c.total_parameters or count_parameters(model)}")
    if c.stage is not None:  # what this process holds of the model (each stage's log with --log-all-instances)
        names = c.stage.stage_parameter_names
        log.print(f" Pipeline stage {c.world.stage + 1} of {c.world.shards}: {count_parameters(c.stage.module.model)} "
                  f"parameters, {len(names)} tensors ({names[0]} ... {names[-1]})")


@dataclass
class TrainingParts:
    """What a training run adds to the components; everything a checkpoint saves and restores."""

    length: RunLength
    schedule: Any
    optimiser: Any
    scaler: Any
    step: TrainStep | PipelinedTrainStep
    ema: WeightEma | None
    generators: dict[str, torch.Generator]  # random streams beyond the global ones, saved by name


def build_training_parts(cfg: RunConfig, c: Components) -> TrainingParts:
    world = c.world
    length = RunLength.resolve(cfg, c.sources.train.num_samples)
    schedule = build_schedule(cfg, length.total_iterations, length.epochs)
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
    if c.replicated is not None and step.accumulator.enabled:
        c.replicated.register_comm_hook(None, step.accumulator.reduce_hook(None, world.replicas))
    return TrainingParts(length, schedule, optimiser, scaler, step, ema, generators)


class TrainingSession:
    """One training run in one process; with replicas every process runs one, rank 0 writes the run
    folder (`instance_folder` is where another rank writes with --log-all-instances or
    --ckpt-all-instances)."""

    def __init__(self, cfg: RunConfig, log: RunLog, folder: Path, world: World | None = None,
                 instance_folder: Path | None = None, initial: InitialWeights | None = None):
        self.cfg = cfg
        self.log = log
        self.folder = folder
        self.world = world or World()
        self.instance_folder = instance_folder
        self.initial = initial  # --init-path: the weights a new run starts from

    def run(self, restore: RestorePoint | None = None) -> int:
        cfg, log = self.cfg, self.log
        c = build_components(cfg, self.world, need_eval=cfg.train.validation)
        starts_from_weights = restore is None and self.initial is not None
        if starts_from_weights:  # before the training parts: the moving average starts from them too
            self.initial.load_into(c.plain_model)
        parts = build_training_parts(cfg, c)
        # Apply a restored state before the first printed line: a checkpoint that does not fit this
        # run fails with the run folder untouched.
        start_iteration, notes = self._restore(restore, c, parts) if restore is not None else (0, [])
        if restore is not None:
            log.print(f"Restoring training from latest checkpoint: {restore.path}")
            for note in notes:  # what could not be carried over
                log.notice(note)
        print_startup(log, cfg, c.plain_model, c)
        for line in self.initial.notes if starts_from_weights else []:
            log.print(line)
        mine, total = parts.optimiser.owned_elements()
        if mine != total:
            log.print(f" Optimiser state sharded over {self.world.replicas} replicas (--rts): this process "
                      f"owns {mine} of {total} optimiser state elements")
        if cfg.train.compile_only:
            log.print("Training graph successfully compiled")
            log.print("Model, data pipeline and optimiser built (--compile-only): exiting without training.")
            return 0
        if start_iteration >= parts.length.total_iterations:
            log.print(f"Training already complete at iteration {start_iteration}.")
        result = self._train(c, parts, start_iteration)
        log.print(f"Training loop completed in {result.seconds:.3f}s.")
        if c.stage is not None:
            self._report_stage_times(parts)
        if result.interrupted_by:
            log.print(f"Training interrupted by {result.interrupted_by} at iteration {result.final_iteration}; "
                      f"checkpoint saved. Continue with: python restore.py --restore-path {self.folder}")
            return 0
        start = time.perf_counter()
        self._after_training(c, (result.final_iteration - start_iteration) * cfg.train.global_batch_size)
        self._report_skipped_images(c)
        log.print(f"Time to train: {round(result.seconds + time.perf_counter() - start, 3)}s.")
        if self.world.is_writer:
            from cnns.plots import plot_training

            plot_training(self.folder)  # training.png: loss, accuracy, learning rate, throughput
        return 0

    def _train(self, c: Components, parts: TrainingParts, start_iteration: int) -> LoopResult:
        cfg = self.cfg
        train_source = c.sources.train

        def after_update() -> None:
            parts.ema.update(c.plain_model)

        loop = TrainingLoop(parts.step, c.feed, train_source, parts.schedule, parts.length, cfg.train.grad_accum,
                            cfg.train.global_batch_size, train_source.num_samples, self.log,
                            lambda iteration: self._save(c, parts, iteration), start_iteration,
                            after_update=after_update if parts.ema is not None else None, world=self.world)
        c.model.train()
        with StopRequest().installed() as stop, self._profiler(cfg, c.device):
            if start_iteration == 0 and cfg.train.ckpts_per_epoch:
                self._save(c, parts, 0)  # the initial weights; a restored run has it already
            return loop.run(stop)

    def _save(self, c: Components, parts: TrainingParts, iteration: int) -> None:
        """Called by every process: a sharded optimiser's state and every rank's random streams are
        gathered first; rank 0 (and with --ckpt-all-instances every rank) writes."""
        world = self.world
        average_running_statistics(c.plain_model, world)  # every replica saves the same model
        parts.optimiser.consolidate()
        rng = capture_rng_state(parts.generators)
        every_rng = world.gather(rng) if world.distributed else None
        stage_parts = self._gather_stages(c, parts) if c.stage is not None else None
        if world.is_writer:
            start = time.perf_counter()
            state = self._checkpoint_state(c, parts, iteration, rng, with_optimiser=stage_parts is None)
            if stage_parts is not None:  # the whole model, optimiser and average from the stages
                state.update(whole_from_parts(c.stage, stage_parts))
            if every_rng is not None:
                state["rng_by_rank"] = every_rng
            path = checkpoint_path(self.folder, iteration)
            save_checkpoint(path, state)
            if iteration == 0:
                self.log.print(f"Saved initial checkpoint to {path}")
            else:
                self.log.print(f"Saved checkpoint to {path} in {time.perf_counter() - start:.3f}s")
        elif self.cfg.log.ckpt_all_instances and self.instance_folder is not None and c.stage is None:
            # A sharded optimiser's whole state exists on rank 0 only.
            state = self._checkpoint_state(c, parts, iteration, rng, with_optimiser=not self.cfg.parallel.rts)
            save_checkpoint(checkpoint_path(self.instance_folder, iteration), state)

    def _report_stage_times(self, parts: TrainingParts) -> None:
        """Where a pipelined run's time went, stage by stage (replica 0's stages)."""
        from cnns.parallel.pipeline import time_report

        every = self.world.gather_to_writer(parts.step.clock.totals())
        if every is not None:
            for line in time_report(every[:self.world.shards], self.cfg.parallel.schedule, self.cfg.train.grad_accum):
                self.log.print(line)

    def _gather_stages(self, c: Components, parts: TrainingParts) -> list | None:
        """Replica 0's stages send their parts of the model, optimiser and average to the writer."""
        part = None
        if self.world.replica_rank == 0:  # (a sharded optimiser's state is whole there only)
            part = stage_part(c.stage, c.plain_model.state_dict(), parts.optimiser.state_dict(),
                              parts.ema.state_dict() if parts.ema is not None else None)
        return self.world.gather_to_writer(part)

    def _checkpoint_state(self, c: Components, parts: TrainingParts, iteration: int, rng: dict[str, Any],
                          with_optimiser: bool) -> dict[str, Any]:
        state = {
            "model": unwrap(c.model).state_dict(),
            "loss_scaler": parts.scaler.state_dict(),
            "rng": rng,
            "iteration": iteration,
            "epoch": self._epoch_of(c, iteration),
            "seed": c.seed,
            "replicas": self.world.replicas,
        }
        if with_optimiser:
            state["optimiser"] = parts.optimiser.state_dict()
        if parts.ema is not None:
            state["ema"] = parts.ema.state_dict()
        return state

    def _epoch_of(self, c: Components, iteration: int) -> float:
        return self.cfg.train.global_batch_size * iteration / c.sources.train.num_samples

    def _restore(self, restore: RestorePoint, c: Components, parts: TrainingParts) -> tuple[int, list[str]]:
        """The checkpoint's state in place: (its iteration, the notices of what could not be carried)."""
        state, path = restore.state, restore.path
        if "seed" in state and int(state["seed"]) != c.seed:
            raise CheckpointError(f"{path} was written with seed {int(state['seed'])}, but this run's "
                                  f"arguments.json says {c.seed}: it belongs to another run")
        try:
            model, optimiser = state["model"], state["optimiser"]
            ema = state["ema"] if parts.ema is not None else None
            if c.stage is not None:  # a whole-model checkpoint dealt out to this stage
                model = stage_model_state(c.stage, model)
                optimiser = stage_optimiser_state(c.stage, optimiser, self.world)
                ema = stage_model_state(c.stage, ema) if ema is not None else None
            unwrap(c.model).load_state_dict(model)
            parts.optimiser.load_state_dict(optimiser)
            parts.scaler.load_state_dict(state["loss_scaler"])
            notes = restore_rng_state(_rng_of_this_process(state, self.world), parts.generators)
            if parts.optimiser.streams_restarted:
                notes.append("the stochastic-rounding stream was written on another kind of device: it "
                                           "continues from a seed derived from it (the run is no longer bitwise "
                                           "repeatable)")
            if ema is not None:
                parts.ema.load_state_dict(ema)
            return int(state["iteration"]), notes
        except (KeyError, RuntimeError, ValueError, TypeError) as exc:
            reason = f"no {exc.args[0]!r} entry" if isinstance(exc, KeyError) else str(exc).splitlines()[0][:200]
            raise CheckpointError(f"{path} does not match this run's model or optimiser: {reason}") from None

    def _after_training(self, c: Components, trained_images: int) -> None:
        """The seed's end of training: weight averages (rank 0), then validation of what is not
        validated yet (every process validates its share of the images; of generated data, as many
        images as this run trained on)."""
        cfg = self.cfg
        if self.world.is_writer:
            training_time_averages(self.folder, cfg.train.weight_avg_N, cfg.train.weight_avg_exp,
                                   lambda iteration: self._epoch_of(c, iteration), self.log)
        if cfg.train.validation and c.sources.eval is not None:
            train_samples = c.sources.train.num_samples
            if c.stage is not None:  # every process validates its share of the images with the whole model
                c = build_components(cfg, self.world.without_stages(), need_train=False)
            batches = generated_validation_limit(cfg, c, self.log, trained_images)
            validate_run_folder(self.folder, c, self.log, cfg.train.global_batch_size, train_samples, batches)

    def _report_skipped_images(self, c: Components) -> None:
        """--skip-corrupt-images: how many images every process dropped, and the first few by name."""
        sources = [s for s in (c.sources.train, c.sources.eval) if s is not None]
        skipped = sum(getattr(source, "skipped_images", 0) for source in sources)
        # Every replica's share of the data (each stage of a replica reads the same).
        skipped = int(self.world.sum([skipped])[0]) // self.world.shards
        if not skipped:
            return
        mine = [name for source in sources for name in getattr(source, "skipped_names", [])]
        every = self.world.gather(mine) if self.world.distributed else [mine]
        # A bad image is met again every epoch: the count is of images dropped, the names distinct.
        names = list(dict.fromkeys(name for names in every for name in names))[:3]
        self.log.print(f"Skipped {skipped} image{'' if skipped == 1 else 's'} that could not be decoded "
                       f"(--skip-corrupt-images); first: {', '.join(names)}")

    def _profiler(self, cfg: RunConfig, device: torch.device):
        import contextlib

        if not cfg.train.profile:
            return contextlib.nullcontext()
        from torch.profiler import ProfilerActivity, profile, tensorboard_trace_handler

        # The GPU's kernels when the run uses one (a CPU run on a GPU host does not load CUPTI).
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        out = cfg.train.profile_dir or str(self.folder / "profile")
        self.log.print(f"Writing a profiler trace to {out}")
        return profile(activities=activities, on_trace_ready=tensorboard_trace_handler(out))


def _rng_of_this_process(state: dict[str, Any], world: World) -> dict[str, Any]:
    """This rank's random streams when the checkpoint was written by as many processes, else rank 0's."""
    every = state.get("rng_by_rank")
    if isinstance(every, list) and len(every) == world.size:
        return every[world.rank]
    return state["rng"]
