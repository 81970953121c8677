"""validation.py: validate a run's checkpoints, one checkpoint, or a random model for throughput."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from cnns.checkpoint import iteration_of, list_checkpoints, load_checkpoint
from cnns.config import RunConfig
from cnns.engine.build import unwrap
from cnns.engine.evaluate import EvalResult, evaluate
from cnns.engine.session import build_components, count_parameters, log_validation
from cnns.errors import CheckpointError
from cnns.runlog import RunLog, validated_names


def latency_line(latencies_ms: list[float]) -> str:
    values = np.asarray(latencies_ms, dtype=np.float64)
    return (f"latency avg: {values.mean():.4f} ms, latency 99p: {np.percentile(values, 99):.4f} ms, "
            f"latency 99p9: {np.percentile(values, 99.9):.4f} ms, latency max: {values.max():.4f} ms")


def checkpoints_to_validate(restore_path: Path) -> tuple[Path, list[tuple[int, Path]]]:
    """(run folder, [(iteration, checkpoint)]) for a run folder or a single checkpoint file."""
    if restore_path.is_dir():
        found = list_checkpoints(restore_path)
        extra = sorted(p for p in restore_path.glob("weight_avg*.pt"))
        return restore_path, found + [(-1, p) for p in extra]
    if restore_path.is_file():
        return restore_path.parent, [(iteration_of(restore_path), restore_path)]
    raise CheckpointError(f"--restore-path {restore_path} is neither a run folder nor a checkpoint file")


def validate_command(cfg: RunConfig, restore_path: Path | None, repeat: int, notices: list[str]) -> int:
    if restore_path is None:
        return _validate_random_model(cfg, repeat, notices)
    folder, checkpoints = checkpoints_to_validate(restore_path)
    if not checkpoints:
        raise CheckpointError(f"no checkpoints (ckpt-<iteration>.pt) found in {restore_path}")
    # Read every checkpoint before writing anything, so a corrupt one leaves the run folder untouched.
    states = [(iteration, path, load_checkpoint(path)) for iteration, path in checkpoints]
    done = validated_names(folder) if restore_path.is_dir() else set()
    log = RunLog(folder)
    for notice in notices:
        log.notice(notice)
    c = build_components(cfg, need_train=False)
    log.print(f"Total Parameters:{count_parameters(c.plain_model)}")
    num_train = _nominal_train_images(cfg)
    for iteration, path, state in states:
        if path.stem in done:
            log.print(f"Skipping validation run on checkpoint: {path.stem} (already in validation.csv)")
            continue
        try:
            unwrap(c.model).load_state_dict(state["model"])
        except RuntimeError as exc:
            raise CheckpointError(f"{path} does not match the model {cfg.model.arch}-{cfg.model.size}: "
                                  f"{str(exc).splitlines()[0][:160]}") from None
        for _ in range(repeat):
            result = evaluate(c.model, c.sources.eval.epoch(0), c.feed, c.policy)
            epoch = cfg.train.global_batch_size * max(iteration, 0) / num_train
            log_validation(log, path.stem, iteration, epoch, result)
    log.close()
    return 0


def _nominal_train_images(cfg: RunConfig) -> int:
    from cnns.data.pipeline import NOMINAL_TRAIN_IMAGES

    return NOMINAL_TRAIN_IMAGES.get(cfg.data.dataset or "cifar-10", 50000)


def _validate_random_model(cfg: RunConfig, repeat: int, notices: list[str]) -> int:
    """The seed's inference benchmark: no checkpoint, `--repeat` passes over generated data."""
    log = RunLog(None)
    for notice in notices:
        log.notice(notice)
    c = build_components(cfg, need_train=False)
    log.print(f"Total Parameters:{count_parameters(c.plain_model)}")
    total: EvalResult | None = None
    for r in range(repeat):
        result = evaluate(c.model, _limited(c.sources.eval, cfg), c.feed, c.policy)
        log_validation(log, "random_init", -1, 0.0, result)
        total = result if total is None else total.merged(result)
    if total is not None and total.latencies_ms:
        # Drop the first pass's first batch: it includes one-off warm-up.
        log.print(latency_line(total.latencies_ms[1:] or total.latencies_ms))
    return 0


def _limited(source, cfg: RunConfig):
    """Generated/synthetic data: a bounded number of batches per pass (an epoch of 50k is not needed)."""
    if cfg.data.source == "files":
        return source.epoch(0)
    limit = min(len(source), 20)
    return (batch for _, batch in zip(range(limit), source.epoch(0)))
