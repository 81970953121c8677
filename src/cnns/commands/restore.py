"""restore.py: a run continued from its newest readable checkpoint, in its own folder.

The configuration is the run's own arguments.json with the stage layout the command line gives
(`cnns.runs.restore_options`), resolved once by `cnns.cli`. The run folder is locked (`cnns.runlock`) from before
its newest checkpoint is read until the run has ended: a second command on it ends in one line.
"""

from __future__ import annotations

from pathlib import Path

from cnns.commands.checks import check_data_before_writing, check_supported, check_writable
from cnns.config import RunConfig
from cnns.errors import CheckpointError
from cnns.parallel.launch import join_run, needs_local_workers, spawn_local_workers
from cnns.parallel.world import World
from cnns.runlock import run_folder_lock
from cnns.runlog import check_logs_readable
from cnns.runs import RunFolder, newest_restore_point, run_log_for


def restore(run: RunFolder, cfg: RunConfig, relaunch: list[str]) -> int:
    run.require_checkpoints()
    check_writable(run.path, f"--restore-path {run.path}")
    with run_folder_lock(run.path):  # this process, or the workers it starts, write the folder from here
        return _continue(run, cfg, relaunch)


def _continue(run: RunFolder, cfg: RunConfig, relaunch: list[str]) -> int:
    # Read the checkpoint before anything is written: a corrupt one leaves the run folder as it was.
    point = newest_restore_point(run.path, World())
    if point is None:
        raise CheckpointError(f"no checkpoints (ckpt-<iteration>.pt) found in {run.path}")
    check_logs_readable(run.path)
    if cfg.train.seed is None and "seed" in point.state:
        cfg = cfg.with_seed(int(point.state["seed"]))  # the data order of the run being continued
    check_supported(cfg)
    check_data_before_writing(cfg, train=True, evaluation=cfg.train.validation)
    if needs_local_workers(cfg.parallel.replicas, cfg.parallel.shards):
        return spawn_local_workers("restore", relaunch, cfg.parallel.replicas * cfg.parallel.shards)
    from cnns.commands.splits import model_to_plan
    from cnns.engine import setup  # as train.py: not in a process that only starts workers

    world, cfg, _ = join_run(cfg, model_to_plan)
    try:
        if world.distributed:  # every process continues from the checkpoint rank 0 chose
            point = newest_restore_point(run.path, world)
        log, instance_folder = run_log_for(cfg, world, run.path)
        if world.is_writer:
            for path, reason in point.skipped:
                log.notice(f"skipped the unreadable checkpoint {path}, kept as {set_aside(path).name}: {reason}")
        return setup.train(cfg, world, log, run.path, instance_folder, restore=point)
    finally:
        world.close()


def set_aside(path: Path) -> Path:
    """An unreadable checkpoint renamed out of the run's way (its bytes kept, for whoever can recover them), so
    that training, which writes that iteration's checkpoint again, does not overwrite it."""
    aside = path.with_name(path.name + ".unreadable")
    path.replace(aside)
    return aside
