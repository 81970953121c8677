"""A training session: build everything from a RunConfig, run the loop, then average and validate.

`train.py` and `restore.py` both end here; restore passes the checkpoint to continue from. What a checkpoint
holds and how the processes write and restore it is `cnns.engine.checkpointer`'s; what the run builds beyond
the components, `cnns.engine.parts`.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import nn

from cnns.config import RunConfig
from cnns.engine.averaging import training_time_averages
from cnns.engine.checkpointer import Checkpointer
from cnns.engine.components import Components, build_components
from cnns.engine.loop import Diverged, LoopResult, StopRequest, TrainingLoop, checkpoint_cadence_notice
from cnns.engine.parts import TrainingParts, build_training_parts
from cnns.engine.validation import generated_validation_limit, validate_run_folder
from cnns.errors import CnnsError
from cnns.models import count_parameters
from cnns.parallel.world import World
from cnns.runlog import RunLog
from cnns.runs import RestorePoint
from cnns.weights import InitialWeights


def print_startup(log: RunLog, cfg: RunConfig, model: nn.Module, c: Components) -> None:
    t, p = cfg.train, cfg.precision
    log.print(f"Command line: {cfg.log.command}")
    log.print(f"{cfg.model.arch}-{cfg.model.size} on {cfg.data.dataset}, device {c.device}, precision {p.precision}"
              f" ({'stochastic rounding' if p.stochastic_rounding else 'round to nearest'})")
    if c.policy.note:
        log.print(c.policy.note)
    log.print(f" Batch Size: {t.global_batch_size} (micro-batch {t.micro_batch_size}"
              f" x accumulation {t.grad_accum} x replicas {cfg.parallel.replicas})")
    log.print(f" Learning Rate: {cfg.optim.learning_rate:.6g} ({cfg.optim.lr_schedule}, {cfg.optim.summary})")
    log.print(f"Total Parameters:{c.total_parameters or count_parameters(model)}")
    if c.sources.decoding:
        log.print(c.sources.decoding)
    if c.stage is not None:  # what this process holds of the model (each stage's log with --log-all-instances)
        names = c.stage.stage_parameter_names
        log.print(f" Pipeline stage {c.world.stage + 1} of {c.world.shards}: {count_parameters(c.stage.module.model)} "
                  f"parameters, {len(names)} tensors ({names[0]} ... {names[-1]})")


# Ctrl-C (SIGINT) ends with 130 wherever it lands, as a shell expects of an interrupted command (so that
# `train.py ... && next` stops); SIGTERM is a scheduler's request to save and stop, which ends cleanly (0).
INTERRUPTED_EXIT_CODES = {"SIGINT": 130}


def divergence_line(diverged: Diverged, checkpointer: Checkpointer, cfg: RunConfig) -> str:
    """The one line a diverged run ends with: where, the last finite checkpoint, and what to try."""
    last = checkpointer.last_saved
    kept = f"the last finite checkpoint is {last}" if last is not None else "no checkpoint was written before it"
    o, p = cfg.optim, cfg.precision
    tries = [f"a smaller learning rate (this run's is {o.learning_rate:g}: --abs-learning-rate or "
             f"--base-learning-rate-exponent)",
             f"a longer warm-up (--warmup-epochs, this run's is {o.warmup_epochs:g})"]
    if p.precision != "32.32" and p.half_dtype == "float16" and not p.auto_loss_scaling:
        tries.append("dynamic loss scaling (--auto-loss-scaling)")  # float16's overflows; bfloat16 has none
    return f"{diverged}; {kept}. Try {', '.join(tries[:-1])} or {tries[-1]}"


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

    def run_to_the_end(self, restore: RestorePoint | None = None) -> int:
        """`run`, then the log closed and, once the run succeeded, every process waited for before the
        process groups go (`World.settle`; on a failure a peer may be gone)."""
        try:
            code = self.run(restore)
        finally:
            self.log.close()
        self.world.settle()
        return code

    def run(self, restore: RestorePoint | None = None) -> int:
        cfg, log = self.cfg, self.log
        c = build_components(cfg, self.world, need_eval=cfg.train.validation)
        starts_from_weights = restore is None and self.initial is not None
        if starts_from_weights:  # before the training parts: the moving average starts from them too
            self.initial.load_into(c.plain_model)
        parts = build_training_parts(cfg, c)
        checkpointer = Checkpointer(c, parts, log, self.folder, self.instance_folder, cfg.train.global_batch_size,
                                    every_instance=cfg.log.ckpt_all_instances, sharded_optimiser=cfg.parallel.rts)
        # Apply a restored state before the first printed line: a checkpoint that does not fit this
        # run fails with the run folder untouched.
        start_iteration, notes = checkpointer.restore(restore) if restore is not None else (0, [])
        if restore is not None:
            log.print(f"Restoring training from latest checkpoint: {restore.path}")
            for note in notes:  # what could not be carried over
                log.notice(note)
            for line in log.continue_after(start_iteration):  # rows logged past the checkpoint, set apart
                log.notice(line)
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
        cadence = checkpoint_cadence_notice(parts.length, cfg.train.ckpts_per_epoch)
        if cadence is not None:
            log.notice(cadence)
        try:
            result = self._train(c, parts, checkpointer, start_iteration)
        except Diverged as diverged:
            raise CnnsError(divergence_line(diverged, checkpointer, cfg)) from None
        log.print(f"Training loop completed in {result.seconds:.3f}s.")
        if c.stage is not None:
            self._report_stage_times(parts)
        if result.interrupted_by:
            log.print(f"Training interrupted by {result.interrupted_by} at iteration {result.final_iteration}; "
                      f"checkpoint saved. Continue with: python restore.py --restore-path {self.folder}")
            return INTERRUPTED_EXIT_CODES.get(result.interrupted_by, 0)
        start = time.perf_counter()
        self._after_training(c, checkpointer, (result.final_iteration - start_iteration) * cfg.train.global_batch_size)
        self._report_skipped_images(c)
        log.print(f"Time to train: {round(result.seconds + time.perf_counter() - start, 3)}s.")
        if self.world.is_writer:
            from cnns.plots import plot_training

            plot_training(self.folder)  # training.png: loss, accuracy, learning rate, throughput
        return 0

    def _train(self, c: Components, parts: TrainingParts, checkpointer: Checkpointer,
               start_iteration: int) -> LoopResult:
        cfg = self.cfg
        train_source = c.sources.train

        def after_update() -> None:
            parts.ema.update(c.plain_model)

        loop = TrainingLoop(parts.step, c.feed, train_source, parts.schedule, parts.length, cfg.train.grad_accum,
                            cfg.train.global_batch_size, train_source.num_samples, self.log,
                            checkpointer.save, start_iteration,
                            after_update=after_update if parts.ema is not None else None, world=self.world)
        c.model.train()
        with StopRequest().installed() as stop, self._profiler(cfg, c.device):
            if start_iteration == 0 and cfg.train.ckpts_per_epoch:
                checkpointer.save(0)  # the initial weights; a restored run has it already
            result = loop.run(stop)
        if result.interrupted_by is None and self.world.any(bool(stop)):
            # The signal came after the loop's last look (during the final checkpoint): the run is
            # complete and saved, but it was asked to stop, so it stops before validation (every process).
            result.interrupted_by = stop.signal_name or "a signal to another process"
        return result

    def _report_stage_times(self, parts: TrainingParts) -> None:
        """Where a pipelined run's time went, stage by stage (replica 0's stages)."""
        from cnns.parallel.pipeline import time_report

        every = self.world.gather_to_writer(parts.step.clock.totals())
        if every is not None:
            for line in time_report(every[:self.world.shards], self.cfg.parallel.schedule, self.cfg.train.grad_accum):
                self.log.print(line)

    def _after_training(self, c: Components, checkpointer: Checkpointer, trained_images: int) -> None:
        """Graphcore's application's end of training: weight averages (rank 0), then validation of what is not
        validated yet (every process validates its share of the images; of generated data, as many
        images as this run trained on)."""
        cfg = self.cfg
        if self.world.is_writer:
            training_time_averages(self.folder, cfg.train.weight_avg_N, cfg.train.weight_avg_exp,
                                   checkpointer.epoch_of, self.log)
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
