"""A run's setup, in the order it happens, and a training run from that setup to its end.

`set_up` is to a run what `cnns.engine.assembly.assemble` is to its model: its body is the order (this
process's place in the world, the data, the model built and assembled, then for training the optimiser and the
step). `train` sets a run up, continues it from a checkpoint where there is one, runs the loop, then averages
and validates. train.py and restore.py end in `train`; validation.py, weight_avg.py and the validation after a
pipelined run call `set_up(..., train=False)`, so every command builds the same model the same way.
"""

from __future__ import annotations

import contextlib
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from cnns import kernels
from cnns.config import RunConfig
from cnns.data.sources import DataSources, build_sources
from cnns.engine.assembly import AssembledModel, assemble
from cnns.engine.averaging import training_time_averages
from cnns.engine.build import (build_loss_scaler, build_lr_schedule, build_mixer, build_optimiser_for,
                               build_step, keep_freed_host_memory, seed_everything)
from cnns.engine.cadence import RunLength
from cnns.engine.checkpointer import Checkpointer
from cnns.engine.ema import WeightEma, build_ema
from cnns.engine.feed import DeviceFeed
from cnns.engine.fusion import fused_norms
from cnns.engine.loop import Diverged, LoopResult, StopRequest, TrainingLoop
from cnns.engine.stages import Stage
from cnns.engine.step import PipelinedTrainStep, TrainStep
from cnns.engine.step_rate import estimated_step_rate
from cnns.engine.checkpoint_validation import validate_run_folder
from cnns.errors import CnnsError, continue_with
from cnns.models import build_model, count_parameters
from cnns.optim import HalfPrecisionOptimiser
from cnns.parallel.world import World
from cnns.precision import LossScaler, PrecisionPolicy
from cnns.profiling import profiled
from cnns.runfolder.run_folder import RestorePoint, trace_folder
from cnns.runfolder.log import RunLog
from cnns.lr_schedules import ScheduleSpec
from cnns.init_weights import InitialWeights


@dataclass
class Setup:
    """A run as `set_up` made it, field by field in the order they are made. The training fields are None
    when the run is set up to evaluate only."""

    world: World
    device: torch.device
    policy: PrecisionPolicy
    seed: int
    sources: DataSources
    feed: DeviceFeed
    assembled: AssembledModel  # the model as the run runs it, and the plain model a checkpoint holds
    total_parameters: int  # of the whole model, whatever part of it this process holds
    length: RunLength | None = None
    schedule: ScheduleSpec | None = None
    optimiser: HalfPrecisionOptimiser | None = None
    scaler: LossScaler | None = None
    step: TrainStep | PipelinedTrainStep | None = None
    ema: WeightEma | None = None
    generators: dict[str, torch.Generator] = field(default_factory=dict)  # random streams saved by name

    @property
    def model(self) -> nn.Module:
        """What runs: this process's pipeline stage, or the (replicated, compiled) model."""
        return self.assembled.model

    @property
    def plain_model(self) -> nn.Module:
        """What is saved and loaded: the model, or the part of it this stage holds."""
        return self.assembled.plain

    @property
    def stage(self) -> Stage | None:
        return self.assembled.stage

    def process_seed(self, offset: int, identical_replicas: bool) -> int:
        """A seed for a per-process random stream: the same on every replica only when asked
        (--identical-replica-seeding), so replicas mix or drop out differently by default."""
        return self.seed + offset + (0 if identical_replicas else self.world.replica_rank)


def set_up(cfg: RunConfig, world: World, *, train: bool = True, evaluate: bool = True,
           initial: InitialWeights | None = None) -> Setup:
    """The run's setup from its configuration, in this order (a pipeline stage's too: `assemble` cuts it):

    1. this process in the world: its device, its random state, its precision
    2. the data: the sources (training ones only with `train`, evaluation ones only with `evaluate`) and the
       device feed
    3. the model, built (`cnns.models.build_model`) and assembled (`assemble`); --init-path's weights
    4. with `train`: the run's length and schedule, the optimiser, the loss scaler, the step, the moving average
    """
    device = world.device  # resolved once, as the process joined the run (`cnns.parallel.launch.join_run`)
    # Replica 0 draws what a single process would (its initial weights are broadcast to the others).
    seed_everything(cfg.train.seed if cfg.parallel.identical_replica_seeding else cfg.train.seed + world.replica_rank)
    policy = cfg.precision.policy(device)
    if cfg.precision.enable_half_partials and device.type == "cuda":
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = True
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True

    sources = build_sources(cfg.data, micro_batch_size=cfg.train.micro_batch_size,
                            eval_batch_size=cfg.train.eval_batch_size, seed=cfg.train.seed, device=device,
                            shard=world.shard, need_train=train, need_eval=evaluate,
                            global_batch_size=cfg.train.global_batch_size,
                            step_rate=lambda: estimated_step_rate(cfg.model, device, policy.compute_dtype))
    feed = DeviceFeed(device, policy.weight_dtype, imagenet_normalisation=cfg.data.normalise_input,
                      host_normalisation=cfg.data.hostside_norm)

    keep_freed_host_memory(device, cfg.train.malloc_tuning)  # before the model allocates anything large
    model = build_model(cfg.model)
    total_parameters = count_parameters(model)
    assembled = assemble(model, cfg, world, device, policy)
    setup = Setup(world, device, policy, cfg.train.seed, sources, feed, assembled, total_parameters)
    if not train:
        return setup
    if initial is not None:  # before the optimiser and the moving average, which start from these weights
        initial.load_into(assembled.plain)

    setup.length = RunLength.resolve(cfg, sources.train.num_samples)
    setup.schedule = build_lr_schedule(cfg, setup.length.total_iterations, setup.length.epochs)
    setup.optimiser = build_optimiser_for(assembled.plain, cfg, policy, setup.seed,
                                          shard_state=cfg.parallel.rts and world.replicas > 1,
                                          replica_group=world.replica_group)
    setup.scaler = build_loss_scaler(cfg, policy)
    mixer = build_mixer(cfg, sources.num_classes, setup.process_seed(11, cfg.parallel.identical_replica_seeding))
    setup.generators = {"mix": mixer.generator} if mixer is not None else {}
    setup.ema = build_ema(assembled.plain, cfg.train.ema_decay)
    setup.step = build_step(cfg, assembled, setup.optimiser, policy, setup.scaler, mixer, world, device)
    return setup


def interrupted_exit_code(signal_name: str) -> int:
    """128 + the signal's number (130 for SIGINT, 143 for SIGTERM; SPEC §8), after the checkpoint and the line saying
    how to continue: a scheduler or launcher sees a run that did not finish, and `train.py ... && next` stops. A
    process stopped because another process of its run got the signal ends as for SIGTERM."""
    number = signal.Signals[signal_name] if signal_name in signal.Signals.__members__ else signal.SIGTERM
    return 128 + int(number)


def train(cfg: RunConfig, world: World, log: RunLog, folder: Path, instance_folder: Path | None = None,
          initial: InitialWeights | None = None, restore: RestorePoint | None = None) -> int:
    """One training run in this process (with replicas or stages every process runs one; rank 0 writes
    `folder`, another rank its `instance_folder` with --log-all-instances or --ckpt-all-instances): set up,
    continued from `restore` if given (else started from `initial`, --init-path's weights), trained, then
    averaged and validated. The log is closed at the end, and once the run succeeded every process waits for
    the others before the process groups go (`World.settle`; on a failure a peer may be gone)."""
    with _closed_then_settled(log, world):
        initial = initial if restore is None else None
        setup = set_up(cfg, world, evaluate=cfg.train.validation, initial=initial)
        checkpointer = Checkpointer(setup, log, folder, instance_folder, cfg.train.global_batch_size,
                                    every_instance=cfg.log.ckpt_all_instances, sharded_optimiser=cfg.parallel.rts)
        # Apply a restored state before the first printed line: a checkpoint that does not fit this
        # run fails with the run folder untouched.
        start_iteration = _continue_from(restore, checkpointer, log) if restore is not None else 0
        print_startup(log, cfg, setup, initial.notes if initial is not None else [])
        if cfg.train.compile_only:
            log.print("Training graph successfully compiled")
            log.print("Model, data pipeline and optimiser built (--compile-only): exiting without training.")
            return 0
        if start_iteration >= setup.length.total_iterations:
            log.print(f"Training already complete at iteration {start_iteration}.")
        try:
            result = _run_loop(cfg, setup, checkpointer, log, folder, start_iteration)
        except Diverged as diverged:
            raise CnnsError(divergence_line(diverged, checkpointer, cfg, setup.policy)) from None
        log.print(f"Training loop completed in {result.seconds:.3f}s.")
        if setup.stage is not None:
            _report_stage_times(cfg, setup, log)
        if result.interrupted_by:
            log.print(f"Training interrupted by {result.interrupted_by} at iteration {result.final_iteration}; "
                      f"checkpoint saved. Continue with: python restore.py --restore-path {folder}")
            return interrupted_exit_code(result.interrupted_by)
        start = time.perf_counter()
        trained_images = (result.final_iteration - start_iteration) * cfg.train.global_batch_size
        _after_training(cfg, setup, checkpointer, log, folder, trained_images)
        _report_skipped_images(setup, log)
        log.print(f"Time to train: {round(result.seconds + time.perf_counter() - start, 3)}s.")
        if world.is_writer:
            from cnns.runfolder.plots import plot_training

            plot_training(folder)  # training.png: loss, accuracy, learning rate, throughput
        return 0


@contextlib.contextmanager
def _closed_then_settled(log: RunLog, world: World):
    """The log closed however the run ends; the processes settled only when it succeeded."""
    try:
        yield
    finally:
        log.close()
    world.settle()


def _continue_from(restore: RestorePoint, checkpointer: Checkpointer, log: RunLog) -> int:
    """The checkpoint's state applied to the run; the iteration it continues from."""
    start_iteration, notes = checkpointer.restore(restore)
    restore.release()  # in the model and optimiser now
    log.print(f"Restoring training from latest checkpoint: {restore.path}")
    for note in notes:  # what could not be carried over
        log.notice(note)
    for line in log.continue_after(start_iteration):  # rows logged past the checkpoint, set apart
        log.notice(line)
    return start_iteration


def fused_passes_line(fused: int, norms: tuple) -> str:
    """How many of the model's layers train with the fused CPU passes (norm + activation, + residual, and
    squeeze-excitation: `cnns.engine.fusion`), and why none where none does."""
    if fused:
        return f" Fused passes: {fused} layers (norm + activation, residual units, squeeze-excitation)"
    if not norms:
        return " Fused passes: none (--fused-norm off, or not measured faster on this CPU's build)"
    return " Fused passes: none (the model has no norm + activation pattern they take)"


def print_startup(log: RunLog, cfg: RunConfig, setup: Setup, initial_notes: list[str]) -> None:
    """The run's header: what trains on what, its batch and learning rate, its cadence, what this process holds.

    Written from what the run set up (the policy applied, the optimiser's rounding, the device, the decoder, the
    run's length), never from an option as typed: where the hardware changed the precision, the header says what
    runs and the policy's note says why."""
    t = cfg.train
    log.print(f"Command line: {cfg.log.command}")
    log.print(f"{cfg.model.tag} on {cfg.data.dataset}, device {setup.device}, precision "
              f"{precision_words(setup.policy, setup.optimiser)}")
    if setup.policy.note:
        log.print(setup.policy.note)
    log.print(f" Batch Size: {t.global_batch_size} (micro-batch {t.micro_batch_size}"
              f" x accumulation {t.gradient_accumulation_count} x replicas {setup.world.replicas})")
    log.print(f" Learning Rate: {cfg.optim.learning_rate:.6g} ({cfg.optim.lr_schedule}, {cfg.optim.summary})")
    log.print(setup.length.describe())
    log.print(f"Total Parameters:{setup.total_parameters}")
    if setup.device.type == "cpu":  # the C++ kernels this CPU runs, or torch's where they were not built
        log.print(kernels.describe())
        log.print(fused_passes_line(setup.assembled.fused, fused_norms(setup.device, cfg.train.fused_norm)))
    if setup.sources.decoding:
        log.print(setup.sources.decoding)
    if setup.stage is not None:  # what this process holds of the model (each stage's log with --log-all-instances)
        names = setup.stage.stage_parameter_names
        log.print(f" Pipeline stage {setup.world.stage + 1} of {setup.world.shards}: "
                  f"{count_parameters(setup.stage.module.model)} parameters, {len(names)} tensors "
                  f"({names[0]} ... {names[-1]})")
    for line in initial_notes:  # how --init-path's weights were taken
        log.print(line)
    mine, total = setup.optimiser.owned_elements()
    if mine != total:
        log.print(f" Optimiser state sharded over {setup.world.replicas} replicas (--rts): this process "
                  f"owns {mine} of {total} optimiser state elements")


def precision_words(policy: PrecisionPolicy, optimiser: HalfPrecisionOptimiser) -> str:
    """"16.16 (bfloat16 weights and compute, stochastic rounding)", "32.32 (float32)": the precision that runs, and
    how updates are rounded only where the weights are half (float32 weights are updated in place, unrounded)."""
    rounding = ""
    if policy.half_weights:
        rounding = ", stochastic rounding" if optimiser.stochastic_rounding else ", round to nearest"
    return f"{policy.name} ({policy.describe()}{rounding})"


def divergence_line(diverged: Diverged, checkpointer: Checkpointer, cfg: RunConfig, policy: PrecisionPolicy) -> str:
    """The one line a diverged run ends with: where, the last finite checkpoint, and what to try."""
    last = checkpointer.last_saved
    kept = f"the last finite checkpoint is {last}" if last is not None else "no checkpoint was written before it"
    o = cfg.optim
    tries = [f"a smaller learning rate (this run's is {o.learning_rate:g}: --abs-learning-rate or "
             f"--base-learning-rate-exponent)",
             f"a longer warm-up (--warmup-epochs, this run's is {o.warmup_epochs:g})"]
    if policy.needs_loss_scaling and not cfg.precision.auto_loss_scaling:
        tries.append("dynamic loss scaling (--auto-loss-scaling)")  # float16's overflows; bfloat16 has none
    return f"{diverged}; {kept}. Try {', '.join(tries[:-1])} or {tries[-1]}"


def _run_loop(cfg: RunConfig, setup: Setup, checkpointer: Checkpointer, log: RunLog, folder: Path,
              start_iteration: int) -> LoopResult:
    """The training loop from `start_iteration`, under the stop signals and the profiler."""
    train_source = setup.sources.train

    def after_update() -> None:
        setup.ema.update(setup.plain_model)

    loop = TrainingLoop(setup.step, setup.feed, train_source, setup.schedule, setup.length,
                        cfg.train.gradient_accumulation_count, cfg.train.global_batch_size, train_source.num_samples,
                        log, checkpointer.save, start_iteration,
                        after_update=after_update if setup.ema is not None else None, world=setup.world)
    setup.model.train()
    with StopRequest().installed() as stop, profiled(cfg.train.profile, setup.device, trace_folder(cfg, folder), log):
        if start_iteration == 0 and setup.length.checkpoint_due(0):
            checkpointer.save(0)  # the initial weights; a restored run has it already
        result = loop.run(stop)
    if result.interrupted_by is None and setup.world.any(bool(stop)):
        # The signal came after the loop's last look (during the final checkpoint): the run is
        # complete and saved, but it was asked to stop, so it stops before validation (every process).
        result.interrupted_by = stop.signal_name or "a signal to another process"
    return result


def _report_stage_times(cfg: RunConfig, setup: Setup, log: RunLog) -> None:
    """Where a pipelined run's time went, stage by stage (replica 0's stages)."""
    from cnns.parallel.pipeline import time_report

    world = setup.world
    every = world.gather_to_writer(setup.step.clock.totals())
    if every is not None:
        accumulation = cfg.train.gradient_accumulation_count
        for line in time_report(every[:world.shards], cfg.parallel.pipeline_schedule, accumulation):
            log.print(line)


def _after_training(cfg: RunConfig, setup: Setup, checkpointer: Checkpointer, log: RunLog, folder: Path,
                    trained_images: int) -> None:
    """Graphcore's application's end of training: weight averages (rank 0), then validation of what is not
    validated yet (every process validates its share of the images; of generated data, as many
    images as this run trained on)."""
    if setup.world.is_writer:
        training_time_averages(folder, cfg.train.weight_avg_N, cfg.train.weight_avg_exp, checkpointer.epoch_of, log)
    if not (cfg.train.validation and setup.sources.eval is not None):
        return
    train_samples = setup.sources.train.num_samples
    if setup.stage is not None:  # every process validates its share of the images with the whole model
        setup = set_up(cfg, setup.world.without_stages(), train=False)
    if folder is not None:
        continue_with(f"the run is trained; validation.py --restore-path {folder} validates its checkpoints")
    validate_run_folder(folder, setup, log, cfg, train_samples, trained_images)


def _report_skipped_images(setup: Setup, log: RunLog) -> None:
    """--skip-corrupt-images: how many images every process dropped, and the first few by name."""
    world = setup.world
    sources = [s for s in (setup.sources.train, setup.sources.eval) if s is not None]
    skipped = sum(getattr(source, "skipped_images", 0) for source in sources)
    # Every replica's share of the data (each stage of a replica reads the same).
    skipped = int(world.sum([skipped])[0]) // world.shards
    if not skipped:
        return
    mine = [name for source in sources for name in getattr(source, "skipped_names", [])]
    every = world.gather(mine) if world.distributed else [mine]
    # A bad image is met again every epoch: the count is of images dropped, the names distinct.
    names = list(dict.fromkeys(name for names in every for name in names))[:3]
    log.print(f"Skipped {skipped} image{'' if skipped == 1 else 's'} that could not be decoded "
              f"(--skip-corrupt-images); first: {', '.join(names)}")
