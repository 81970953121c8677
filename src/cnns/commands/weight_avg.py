"""weight_avg.py: a run's last checkpoints averaged (the mean or exponential average of Graphcore's
application), written beside them as weight_avg_*.pt, and validated unless the command line says
--no-validation (the training run's does not carry over). --restore-path is a run folder, read once by the command
line as every command reads it (`cnns.runfolder.run_folder.open_restore_path`) and handed over; each checkpoint averaged
is read once; everything is read and checked before the run folder is written, under its lock
(`cnns.runfolder.lock`)."""

from __future__ import annotations

from pathlib import Path

from cnns.commands.checks import check_data_before_writing, check_supported, check_writable
from cnns.config import RunConfig
from cnns.engine.averaging import average_name, last_checkpoints, trained_checkpoints, write_average
from cnns.engine.setup import set_up
from cnns.engine.checkpoint_validation import Target, check_targets_match, targets_of, validate_targets
from cnns.errors import CheckpointError, ConfigError
from cnns.devices import resolve_device
from cnns.parallel.world import World, process_device
from cnns.profiling import profiled
from cnns.runfolder.run_folder import RestoreTarget, trace_folder, writer_log
from cnns.runfolder.lock import run_folder_lock

DEFAULT_DECAY = 0.97  # Graphcore's application's exponential averaging decay (--decay)


def weight_average(cfg: RunConfig, restore_path: str | None, target: RestoreTarget | None, mode: str,
                   count: int | None, decay: float | None, discard_last: int, validate: bool,
                   notices: list[str]) -> int:
    """Averaging is file work: one process, and its one validation runs in it (`cnns.cli` resolves the
    configuration with one replica, and reads the run --restore-path names: `target`)."""
    if target is None:
        raise ConfigError("weight_avg.py needs --restore-path <run folder>")
    run = target.whole_run(restore_path)
    run.require_checkpoints()
    decay = DEFAULT_DECAY if decay is None else decay
    _check_averaging_options(mode, count, decay, discard_last)
    check_supported(cfg, trains=False)
    if validate:  # the averages are validated, never trained: only the validation data must be there
        check_data_before_writing(cfg, train=False, evaluation=True)
    check_writable(run.path, f"--restore-path {restore_path}")
    with run_folder_lock(run.path):
        return _average(cfg, run.path, mode, count, decay, discard_last, validate, notices)


def _average(cfg: RunConfig, folder: Path, mode: str, count: int | None, decay: float, discard_last: int,
             validate: bool, notices: list[str]) -> int:
    checkpoints = trained_checkpoints(folder)
    if not checkpoints:
        raise CheckpointError(f"no trained checkpoints (ckpt-<iteration>.pt, iteration > 0) in {folder}")
    chosen = last_checkpoints(checkpoints, count, discard_last)
    if not chosen:
        raise CheckpointError(f"--discard-last {discard_last} leaves none of the {len(checkpoints)} checkpoints")
    # Read and check everything before writing to the run folder.
    probes = [target for target in targets_of([path for _, path in chosen]) if not target.use_ema]
    _check_same_model(probes)
    here = World(device=process_device(resolve_device(cfg.device)))  # the averaging process alone
    evaluation = set_up(cfg, here, train=False) if validate else None
    if evaluation is not None:
        check_targets_match(probes[:1], evaluation.plain_model, cfg.model.tag)
    log = writer_log(cfg, folder, "weight-avg")
    for notice in notices:
        log.notice(notice)
    path = write_average(folder, average_name(mode, len(chosen), decay, discard_last), chosen, mode, decay, log,
                         states=[probe.state for probe in probes])  # read once: here, as they were checked
    if evaluation is not None:
        with profiled(cfg.train.profile, evaluation.device, trace_folder(cfg, folder), log):
            validate_targets(targets_of([path]), evaluation, log, cfg, 1)
    log.close()
    return 0


def _check_averaging_options(mode: str, count: int | None, decay: float, discard_last: int) -> None:
    if mode not in ("mean", "exponential"):
        raise ConfigError(f"--mode must be mean or exponential, got {mode!r}")
    if count is not None and count < 1:
        raise ConfigError(f"-N must be at least 1, got {count}")
    if discard_last < 0:
        raise ConfigError(f"--discard-last must not be negative, got {discard_last}")
    if not 0.0 <= decay <= 1.0:
        raise ConfigError(f"--decay must be between 0 and 1, got {decay}")


def _check_same_model(probes: list[Target]) -> None:
    first = probes[0]
    for probe in probes[1:]:
        if probe.weights.keys() != first.weights.keys() or any(
                probe.weights[k].shape != first.weights[k].shape for k in first.weights):
            raise CheckpointError(f"{probe.path} and {first.path} do not hold the same model: cannot average them")
