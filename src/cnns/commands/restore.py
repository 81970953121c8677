"""restore.py: a run continued from its newest readable checkpoint, in its own folder.

The configuration is the run's own arguments.json with the stage layout the command line gives
(`cnns.runfolder.options.restore_options`), resolved once by `cnns.cli`. The run folder is locked (`cnns.runfolder.lock`) from before
its newest checkpoint is read until the run has ended: a second command on it ends in one line.
"""

from __future__ import annotations

from pathlib import Path

from cnns.commands.checks import check_data_before_writing, check_supported, check_writable
from cnns.config import RunConfig
from cnns.errors import CheckpointError
from cnns.parallel.launch import checked_by_the_launcher, join_run, needs_local_workers, spawn_local_workers
from cnns.parallel.world import World, launched
from cnns.runfolder.run_folder import RestorePoint, RunFolder, newest_restore_point, run_log_for
from cnns.runfolder.lock import run_folder_lock
from cnns.runfolder.log import check_logs_readable


def restore(run: RunFolder, cfg: RunConfig, relaunch: list[str]) -> int:
    if not checked_by_the_launcher():
        run.require_checkpoints()
        check_writable(run.path, f"--restore-path {run.path}")
    with run_folder_lock(run.path):  # this process, or the workers it starts, write the folder from here
        return _continue(run, cfg, relaunch)


def _continue(run: RunFolder, cfg: RunConfig, relaunch: list[str]) -> int:
    """The checks, once a run (a worker cnns started was checked by its launcher), the workers when several are
    asked for, then this process's part: the checkpoint read once per process, before anything is written (a
    corrupt one leaves the run folder as it was), by rank 0's choice where there are several."""
    point = None
    if not checked_by_the_launcher():
        if not launched():  # one process, or the launcher: read here (torchrun's workers read it together below)
            point = _newest_point(run, World())
        check_logs_readable(run.path)
        check_supported(cfg)
        check_data_before_writing(cfg, train=True, evaluation=cfg.train.validation)
    if needs_local_workers(cfg.parallel.replicas, cfg.parallel.shards):
        point = None  # read here only as a check: each worker reads its own; this process holds none as it waits
        return spawn_local_workers("restore", relaunch, cfg.parallel.replicas * cfg.parallel.shards,
                                   timeout_s=cfg.parallel.dist_timeout)
    from cnns.commands.splits import model_to_plan
    from cnns.engine import setup  # as train.py: not in a process that only starts workers

    world, cfg, _ = join_run(cfg, model_to_plan)
    try:
        if point is None:  # every process continues from the checkpoint rank 0 chose
            point = _newest_point(run, world)
        if not cfg.train.seed_specified and "seed" in point.state:
            cfg = cfg.with_seed(int(point.state["seed"]))  # the data order of the run being continued
        log, instance_folder = run_log_for(cfg, world, run.path, "restore")
        if world.is_writer:
            for path, reason in point.skipped:
                log.notice(f"skipped the unreadable checkpoint {path}, kept as {set_aside(path).name}: {reason}")
        return setup.train(cfg, world, log, run.path, instance_folder, restore=point)
    finally:
        world.close()


def _newest_point(run: RunFolder, world: World) -> RestorePoint:
    point = newest_restore_point(run.path, world)
    if point is None:
        raise CheckpointError(f"no checkpoints (ckpt-<iteration>.pt) found in {run.path}")
    return point


def set_aside(path: Path) -> Path:
    """An unreadable checkpoint renamed out of the run's way (its bytes kept, for whoever can recover them), so
    that training, which writes that iteration's checkpoint again, does not overwrite it."""
    aside = path.with_name(path.name + ".unreadable")
    path.replace(aside)
    return aside
