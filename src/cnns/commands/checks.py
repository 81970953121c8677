"""The checks every command makes before it writes anything or starts a process, and the notices that say
what a run's parallel options mean here. A command that fails one leaves no run folder behind."""

from __future__ import annotations

from cnns.config import RunConfig
from cnns.devices import default_device_name
from cnns.errors import ConfigError


def check_supported(cfg: RunConfig) -> None:
    """Combinations that cannot run, found before any worker starts: one clear line each."""
    p = cfg.parallel
    if p.shards > 1 or (p.pipeline and p.splits and p.recomputation):  # stages, or recomputation points
        check_pipeline_splits(cfg)
    if p.shards > 1 and cfg.train.compile:
        raise ConfigError("--compile with pipeline stages (--shards > 1) is not supported yet; "
                          "leave out --compile (it measured no faster on a CPU)")
    if p.bn_span > 1 and p.replicas == 1:
        raise ConfigError(f"--BN-span {p.bn_span} spans replicas: give --replicas (a multiple of it)")


def check_pipeline_splits(cfg: RunConfig) -> None:
    """--pipeline-splits name shards - 1 known cuts in the model's order (the stages check again), or
    `auto` for more than one stage."""
    from cnns.models import ModelError, build_model, describe_split_points, resolve_splits, split_points

    splits, shards = list(cfg.parallel.splits or ()), cfg.parallel.shards
    if splits == ["auto"]:
        if shards < 2:
            raise ConfigError("--pipeline-splits auto chooses where to cut stages: it needs --shards 2 or more")
        return
    model = build_model(cfg.model)
    try:
        resolve_splits(cfg.model, model, splits)
    except ModelError as error:
        raise ConfigError(str(error)) from None
    if shards > 1 and len(splits) != shards - 1:
        raise ConfigError(f"--shards {shards} needs {shards - 1} --pipeline-splits, got {len(splits)} "
                          f"({' '.join(splits)}); valid splits: {describe_split_points(split_points(cfg.model, model))}")


def wants_split_names(cfg: RunConfig) -> bool:
    """train.py --pipeline-splits with no names, or --shards without them: print the names it takes."""
    p = cfg.parallel
    return p.splits == () or (p.shards > 1 and not p.splits)


def print_split_points(cfg: RunConfig) -> int:
    from cnns.models import build_model, describe_split_points, split_points

    points = split_points(cfg.model, build_model(cfg.model))
    print(f"--pipeline-splits needs {max(1, cfg.parallel.shards - 1)} of these split names for "
          f"{cfg.model.arch}-{cfg.model.size} (aliases in brackets):")
    print(describe_split_points(points))
    return 0


def check_data_before_writing(cfg: RunConfig) -> None:
    """Fail on missing data, or data with more classes than the model has outputs, before a run folder
    is created, so a bad command leaves nothing behind."""
    from cnns.data.sources import classes_in_data

    found = classes_in_data(cfg.data)
    if found is not None and found[0] > cfg.model.num_classes:
        raise ConfigError(f"the data in {found[1]} has {found[0]} classes, more than the model's "
                          f"{cfg.model.num_classes} outputs (--num-classes {cfg.model.num_classes})")


def parallel_notices(cfg: RunConfig) -> list[str]:
    """What a training run's parallel options mean here, where that is not what a reader expects."""
    p, notices = cfg.parallel, []
    if p.offload_optimiser and not (cfg.device or default_device_name()).startswith("cuda"):
        notices.append("--offload-optimiser has no effect on a CPU: the optimiser state is already in host memory")
    if p.pipeline and p.shards == 1:
        if p.splits and p.recomputation:
            notices.append("--pipeline with --shards 1: one stage; its --pipeline-splits are the recomputation "
                           "points (only the input of each segment between them is kept for the backward pass)")
        else:
            notices.append("--pipeline with --shards 1: one stage, nothing to pipeline; the whole model runs in "
                           "each process (the --pipeline-splits are not used)")
    if p.shards > 1 and cfg.log.ckpt_all_instances:
        notices.append("--ckpt-all-instances with pipeline stages: each process holds a part of the model, so only "
                       "rank 0 writes checkpoints (of the whole model, gathered from the stages)")
    if p.rts and p.replicas == 1:
        notices.append("--rts shards the optimiser state over replicas: with one replica it changes nothing")
    return notices
