"""validation.py: a run's checkpoints (or one checkpoint) validated, or a random model timed on generated data.

The configuration is the run's arguments.json overridden by the command line (`cnns.runfolder.options.evaluation_options`),
resolved once by `cnns.cli`, which reads --restore-path once for the process as every command reads it
(`cnns.runfolder.run_folder.open_restore_path`) and hands it over (`run`); the run folder is locked while
validation.csv is written (`cnns.runfolder.lock`). With replicas every process validates its share of the
images and rank 0 writes; each process reads the checkpoints itself, each once (the run folder is on a shared
file system). Everything that can fail (unreadable or foreign checkpoints, a model that does not match, missing
data) is checked before the first line is written to the run folder.
"""

from __future__ import annotations

import itertools
from pathlib import Path

from cnns.commands.checks import (check_data_before_writing, check_holds_no_run, check_no_sinks_without_a_folder,
                                  check_supported, check_writable)
from cnns.commands.splits import model_to_plan
from cnns.config import RunConfig
from cnns.engine.evaluate import EvalResult, evaluate
from cnns.engine.setup import set_up
from cnns.engine.checkpoint_validation import (check_targets_match, checkpoint_files, generated_validation_limit,
                                               latency_line, log_validation, readable_targets, row_names,
                                               still_to_validate, summed_over_processes, targets_of,
                                               validate_targets)
from cnns.errors import CheckpointError, continue_with
from cnns.models import count_parameters
from cnns.parallel.launch import checked_by_the_launcher, join_run, needs_local_workers, spawn_local_workers
from cnns.parallel.world import World
from cnns.profiling import profiled
from cnns.runfolder.run_folder import RestoreTarget, trace_folder, writer_log
from cnns.runfolder.lock import run_folder_lock
from cnns.runfolder.log import RunLog, validated_names


def validate(cfg: RunConfig, restore_path: str | None, run: RestoreTarget | None, repeat: int, notices: list[str],
             relaunch: list[str]) -> int:
    """`run`: what --restore-path (`restore_path`, as given) names, read by the command line (None without one)."""
    folder = _checked_folder(cfg, restore_path, run)  # validation.csv's run folder (a random model's: --logs-path's)
    with run_folder_lock(folder):  # this process, or the workers it starts, write the folder from here
        if needs_local_workers(cfg.parallel.replicas, cfg.parallel.shards):
            return spawn_local_workers("validate", relaunch, cfg.parallel.replicas * cfg.parallel.shards,
                                       timeout_s=cfg.parallel.dist_timeout)
        world, cfg, _ = join_run(cfg, model_to_plan)
        try:
            if run is None:
                return validate_random_model(cfg, repeat, notices, world)
            return validate_checkpoints(cfg, run, repeat, notices, world)
        finally:
            world.close()


def _checked_folder(cfg: RunConfig, restore_path: str | None, run: RestoreTarget | None) -> Path | None:
    """The run folder validation.csv is added to, checked once a run (a worker cnns started was checked by its
    launcher, which made a random model's new folder)."""
    checks = not checked_by_the_launcher()
    if checks:
        check_supported(cfg, trains=False)
    if run is not None:
        if checks:
            run.checkpoints()  # a run without any is one line before the data is looked at
            check_data_before_writing(cfg, train=False, evaluation=True)
            check_writable(run.run.path, f"--restore-path {restore_path}")
        return run.run.path
    if not cfg.log.logs_path:
        if checks:
            check_no_sinks_without_a_folder(cfg, "validation.py without --restore-path or --logs-path writes no run "
                                                 "folder")
        return None
    folder = Path(cfg.log.logs_path)  # a random model's lines and validation.csv go to a new folder, as a run's
    if checks:
        check_holds_no_run(folder, "--logs-path", continue_with="validation.py")
        folder.mkdir(parents=True, exist_ok=True)
    return folder


def validate_checkpoints(cfg: RunConfig, run: RestoreTarget, repeat: int, notices: list[str], world: World) -> int:
    """Every checkpoint of a run folder not yet in its validation.csv, or the one file given. A checkpoint of
    the folder that cannot be read is named and the others are validated (exit code 1); a single file that
    cannot be read is an error. Each is read once, memory-mapped (`Target`)."""
    folder, files = checkpoint_files(run)
    whole_run = run.file is None
    done = validated_names(folder) if whole_run else set()
    if whole_run:  # only the files with a row still to give are read
        to_read = still_to_validate(files, done, bool(cfg.train.ema_decay))
        targets, unreadable = readable_targets(to_read)
        if to_read and not targets and len(to_read) == len(files):
            raise CheckpointError(f"no readable checkpoint in {folder}: {unreadable[-1][1]}")
    else:
        targets, unreadable = targets_of(files), []
    todo = [t for t in targets if t.name not in done]
    c = set_up(cfg, world, train=False)
    check_targets_match(todo, c.plain_model, cfg.model.tag)
    # Nothing was written so far; from here on the checks have passed.
    log = writer_log(cfg, folder, "validate") if world.is_writer else RunLog(None, quiet=True)
    for notice in notices:
        log.notice(notice)
    for path, reason in unreadable:
        log.notice(f"not validated, unreadable: {reason}")
    if c.policy.note:
        log.print(c.policy.note)
    log.print(f"Total Parameters:{count_parameters(c.plain_model)}")
    for path in files:
        for name in row_names(path, bool(cfg.train.ema_decay)):
            if name in done:
                log.print(f"Skipping validation run on checkpoint: {name} (already in validation.csv)")
    continue_with(f"validation.py --restore-path {folder} validates the checkpoints not yet in validation.csv")
    with profiled(cfg.train.profile, c.device, trace_folder(cfg, folder), log):
        validate_targets(todo, c, log, cfg, _nominal_train_images(cfg), repeat)
    if unreadable:
        log.print(f"Not validated ({len(unreadable)} unreadable): {', '.join(str(path) for path, _ in unreadable)}")
    log.close()
    return 1 if unreadable else 0


def _nominal_train_images(cfg: RunConfig) -> int:
    """Only for checkpoints that do not record their epoch (Graphcore's application's rule: the dataset's size)."""
    from cnns.data.formats import dataset_facts

    return dataset_facts(cfg.data.dataset).train_images


def validate_random_model(cfg: RunConfig, repeat: int, notices: list[str], world: World) -> int:
    """Graphcore's application's inference benchmark: no checkpoint, `--repeat` passes over generated data.
    With --logs-path the writer keeps its lines and validation.csv there, which `cnns benchmark` reads."""
    folder = Path(cfg.log.logs_path) if cfg.log.logs_path and world.is_writer else None  # locked by validate()
    log = writer_log(cfg, folder, "validate") if world.is_writer else RunLog(None, quiet=True)
    for notice in notices:
        log.notice(notice)
    c = set_up(cfg, world, train=False)
    if c.policy.note:
        log.print(c.policy.note)
    log.print(f"Total Parameters:{count_parameters(c.plain_model)}")
    total: EvalResult | None = None
    batches = generated_validation_limit(cfg, c, log, None)
    with profiled(cfg.train.profile and folder is not None, c.device, trace_folder(cfg, folder or Path()), log):
        for _ in range(repeat):
            data = c.sources.eval.epoch(0)
            if batches is not None:
                data = itertools.islice(data, batches)
            result = summed_over_processes(evaluate(c.model, data, c.feed, c.policy), c)
            log_validation(log, "random_init", -1, 0.0, result)
            total = result if total is None else total.merged(result)
    if total is not None and total.latencies_ms:
        # Drop the first pass's first batch: it includes one-off warm-up.
        log.print(latency_line(total.latencies_ms[1:] or total.latencies_ms))
    log.close()
    return 0
