"""What train.py, restore.py, validation.py and weight_avg.py do once their options are resolved.

`cnns.cli` parses a command line into options (and, for a finished run, merges them with the run's
own through `cnns.runs`); each function here takes those options and runs the command: the checks
made before anything is written, the worker processes started when several are asked for and no
launcher started them, this process's place among them, the run folder, and the engine.
`relaunch` is the command line a worker process is started with (the same one, on every worker).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cnns.config import RunConfig
from cnns.errors import CheckpointError, ConfigError
from cnns.parallel.world import World, join_world, launched
from cnns.runs import (RunFolder, agree_on_run_folder, check_pipeline_splits, newest_restore_point, run_log_for)
from cnns.weights import initial_weights


def check_supported(options: dict[str, Any]) -> None:
    """Combinations that cannot run, found before any worker starts: one clear line each."""
    if options["shards"] > 1 or (options["pipeline"] and options.get("pipeline_splits")
                                 and options["enable_recomputation"]):  # stages, or recomputation points
        check_pipeline_splits(options)
    if options["shards"] > 1 and options.get("compile"):
        raise ConfigError("--compile with pipeline stages (--shards > 1) is not supported yet; "
                          "leave out --compile (it measured no faster on a CPU)")
    if options["BN_span"] > 1 and options["replicas"] == 1:
        raise ConfigError(f"--BN-span {options['BN_span']} spans replicas: give --replicas (a multiple of it)")


def print_split_points(options: dict[str, Any]) -> int:
    """train.py --pipeline-splits with no names (or --shards without them): the names it takes."""
    from cnns.models import build_model, describe_split_points, split_points

    cfg = RunConfig.from_options(options)
    points = split_points(cfg.model, build_model(cfg.model))
    print(f"--pipeline-splits needs {max(1, options['shards'] - 1)} of these split names for "
          f"{cfg.model.arch}-{cfg.model.size} (aliases in brackets):")
    print(describe_split_points(points))
    return 0


def check_data_before_writing(cfg: RunConfig) -> None:
    """Fail on missing data, or data with more classes than the model has outputs, before a run folder
    is created, so a bad command leaves nothing behind."""
    from cnns.data.pipeline import classes_in_data

    found = classes_in_data(cfg.data)
    if found is not None and found[0] > cfg.model.num_classes:
        raise ConfigError(f"the data in {found[1]} has {found[0]} classes, more than the model's "
                          f"{cfg.model.num_classes} outputs (--num-classes {cfg.model.num_classes})")


def needs_workers(options: dict[str, Any]) -> bool:
    """Several processes asked for and none started by a launcher: start them here."""
    return options["replicas"] * options["shards"] > 1 and not launched()


def start_workers(command: str, relaunch: list[str], options: dict[str, Any]) -> int:
    from cnns.parallel.launch import spawn_local_workers

    return spawn_local_workers(command, relaunch, options["replicas"] * options["shards"])


def join(options: dict[str, Any], notices: list[str] | None = None) -> World:
    """This process's world on the run's device; rank 0 settles --pipeline-splits auto for all."""
    from cnns.bench.splits import settle_auto_splits
    from cnns.engine.build import resolve_device

    device = resolve_device(options.get("device"), options.get("select_ipus"))
    notices = notices if notices is not None else []
    return join_world(options, device, settle=lambda world: settle_auto_splits(options, world, notices, device))


# ----------------------------------------------------------------------------------------------
# train.py and restore.py


def train(options: dict[str, Any], notices: list[str], relaunch: list[str]) -> int:
    """train.py: a new run folder, trained (or the split names, or the input pipeline's speed alone)."""
    from cnns.engine.session import TrainingSession

    if options.get("pipeline_splits") == [] or (options["shards"] > 1 and not options.get("pipeline_splits")):
        return print_split_points(options)
    check_supported(options)
    cfg = RunConfig.from_options(options)
    check_data_before_writing(cfg)
    if options["dataset_benchmark"]:
        from cnns.bench.data import dataset_benchmark

        for notice in notices:
            print(notice)
        dataset_benchmark(cfg)  # the input pipeline alone: no model, no run folder
        return 0
    initial = initial_weights(options["init_path"], cfg.model) if options.get("init_path") else None
    if needs_workers(options):
        return start_workers("train", relaunch, options)
    world = join(options, notices)
    try:
        cfg = RunConfig.from_options(options)  # with the seed every process agreed on
        folder = agree_on_run_folder(cfg, world)
        # After the launcher restarted the workers (one was lost): continue from the first attempt's
        # newest checkpoint, if it wrote one.
        restore = newest_restore_point(folder, world) if world.restart > 0 and folder is not None else None
        log, instance_folder = run_log_for(cfg, world, folder)
        if folder is not None:
            log.print(f" Saving to {folder}")
        for notice in notices + parallel_notices(options):
            log.notice(notice)
        log.write_arguments(options)
        if cfg.log.wandb and world.is_writer:
            log.start_wandb(cfg.log.wandb_project, cfg.log.name, options)
        try:
            code = TrainingSession(cfg, log, folder, world, instance_folder, initial).run(restore=restore)
        finally:
            log.close()
        world.settle()
        return code
    finally:
        world.close()


def restore(run: RunFolder, options: dict[str, Any], relaunch: list[str]) -> int:
    """restore.py: the run continued from its newest checkpoint, in its own folder (`options` from
    `cnns.runs.restore_options`)."""
    from cnns.engine.session import TrainingSession

    # Read the checkpoint before anything is written: a corrupt one leaves the run folder as it was.
    point = newest_restore_point(run.path, World())
    if point is None:
        raise CheckpointError(f"no checkpoints (ckpt-<iteration>.pt) found in {run.path}")
    if options.get("seed") is None and "seed" in point.state:
        options["seed"] = int(point.state["seed"])  # the data order of the run being continued
    cfg = RunConfig.from_options(options)
    check_data_before_writing(cfg)
    if needs_workers(options):
        return start_workers("restore", relaunch, options)
    world = join(options)
    try:
        if world.distributed:  # every process continues from the checkpoint rank 0 chose
            point = newest_restore_point(run.path, world)
        log, instance_folder = run_log_for(cfg, world, run.path)
        try:
            code = TrainingSession(cfg, log, run.path, world, instance_folder).run(restore=point)
        finally:
            log.close()
        world.settle()
        return code
    finally:
        world.close()


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def parallel_notices(options: dict[str, Any]) -> list[str]:
    """What a training run's parallel options mean here, where that is not what a reader expects."""
    notices = []
    if options["offload_optimiser"] and not str(options.get("device") or _default_device()).startswith("cuda"):
        notices.append("--offload-optimiser has no effect on a CPU: the optimiser state is already in host memory")
    if options["pipeline"] and options["shards"] == 1:
        if options.get("pipeline_splits") and options["enable_recomputation"]:
            notices.append("--pipeline with --shards 1: one stage; its --pipeline-splits are the recomputation "
                           "points (only the input of each segment between them is kept for the backward pass)")
        else:
            notices.append("--pipeline with --shards 1: one stage, nothing to pipeline; the whole model runs in "
                           "each process (the --pipeline-splits are not used)")
    if options["shards"] > 1 and options.get("ckpt_all_instances"):
        notices.append("--ckpt-all-instances with pipeline stages: each process holds a part of the model, so only "
                       "rank 0 writes checkpoints (of the whole model, gathered from the stages)")
    if options["rts"] and options["replicas"] == 1:
        notices.append("--rts shards the optimiser state over replicas: with one replica it changes nothing")
    return notices


# ----------------------------------------------------------------------------------------------
# validation.py and weight_avg.py


def validate(options: dict[str, Any], restore_path: str | None, repeat: int, notices: list[str],
             relaunch: list[str]) -> int:
    """validation.py: a run's checkpoints (or generated data) validated (`options` from
    `cnns.runs.evaluation_options`)."""
    from cnns.engine.validation import validate_command

    check_supported(options)
    cfg = RunConfig.from_options(options)
    if restore_path:
        check_data_before_writing(cfg)
    if needs_workers(options):
        return start_workers("validate", relaunch, options)
    world = join(options)
    try:
        return validate_command(cfg, Path(restore_path) if restore_path else None, repeat=repeat, notices=notices,
                                world=world)
    finally:
        world.close()


def weight_average(options: dict[str, Any], restore_path: str | None, mode: str, last: int | None, decay: float | None,
                   discard_last: int, validate: bool, notices: list[str]) -> int:
    """weight_avg.py: the run's last checkpoints averaged, written beside them, and validated unless the
    command line said --no-validation (the training run's does not carry over)."""
    from cnns.engine.averaging import weight_avg_command

    if not restore_path:
        raise ConfigError("weight_avg.py needs --restore-path <run folder>")
    options["replicas"] = 1  # averaging is file work; its one validation runs in this process
    options["BN_span"] = 1
    check_supported(options)
    cfg = RunConfig.from_options(options)
    if validate:
        check_data_before_writing(cfg)
    return weight_avg_command(cfg, Path(restore_path), mode, last, decay, discard_last, validate, notices)


# ----------------------------------------------------------------------------------------------
# cnns splits


def propose_splits(options: dict[str, Any]) -> int:
    """`cnns splits`: every cut of the model with what lies before it and the cuts that balance
    --shards stages (at least 2)."""
    from cnns.bench.splits import format_report, split_proposal
    from cnns.engine.build import resolve_device

    cfg = RunConfig.from_options(options)
    device = resolve_device(cfg.device, options.get("select_ipus"))
    print(format_report(split_proposal(cfg, max(2, options["shards"]), device)))
    return 0
