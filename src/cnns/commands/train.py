"""train.py: a new run, trained from its resolved configuration.

`cnns.cli` parses the command line and resolves it once into a frozen `RunConfig`; this runs it: the checks
made before anything is written, the worker processes started when several are asked for and no launcher
started them, this process's place among them, the run folder, and the training session. (train.py
--dataset-benchmark times the input pipeline alone: `cnns.commands.benchmark.dataset_benchmark`.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cnns.commands.checks import (check_data_before_writing, check_no_sinks_without_a_folder, check_run_folder_place,
                                  check_supported, parallel_notices, print_split_points, wants_split_names)
from cnns.config import RunConfig
from cnns.parallel.launch import checked_by_the_launcher, join_run, needs_local_workers, spawn_local_workers
from cnns.runfolder.run_folder import open_new_run

if TYPE_CHECKING:
    from cnns.init_weights import InitialWeights


def train(cfg: RunConfig, notices: list[str], relaunch: list[str]) -> int:
    """train.py: a new run folder, trained (or the split names it takes). `relaunch` is the command line each
    worker process is started with."""
    if wants_split_names(cfg):
        check_no_sinks_without_a_folder(cfg, "train.py asked for the split names prints them and writes no run folder")
        return print_split_points(cfg)
    if not checked_by_the_launcher():  # once a run: a worker cnns started was checked by its launcher
        check_supported(cfg)
        check_run_folder_place(cfg)  # first: the built-in dataset writes its files as its data is checked
        check_data_before_writing(cfg, train=True, evaluation=cfg.train.validation)
    notices = notices + parallel_notices(cfg)
    initial = _checked_initial_weights(cfg)
    if needs_local_workers(cfg.parallel.replicas, cfg.parallel.shards):
        del initial  # read here only as a check: each worker reads its own; this process holds nothing as it waits
        return spawn_local_workers("train", relaunch, cfg.parallel.replicas * cfg.parallel.shards,
                                   timeout_s=cfg.parallel.dist_timeout)
    # The engine and the models (timm, torchvision, torch._dynamo: seconds of imports) are loaded by the
    # processes that train, not by one that only starts them.
    from cnns.commands.splits import model_to_plan
    from cnns.engine import setup

    world, cfg, agreed = join_run(cfg, model_to_plan)
    try:
        with open_new_run(cfg, world) as (folder, restore, log, instance_folder):
            if folder is not None:
                log.print(f" Saving to {folder}")
            for notice in notices + agreed:
                log.notice(notice)
            log.write_arguments(cfg.arguments)
            return setup.train(cfg, world, log, folder, instance_folder, initial, restore)
    finally:
        world.close()


def _checked_initial_weights(cfg: RunConfig) -> InitialWeights | None:
    """--init-path's weights, read and matched to the model before anything is written (None without it)."""
    if not cfg.train.init_path:
        return None
    from cnns.init_weights import initial_weights

    return initial_weights(cfg.train.init_path, cfg.model)
