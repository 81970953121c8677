"""Validating checkpoints: what validation.py (`cnns.commands.validate`) and the validation after training
(`validate_run_folder`) share, so that both print the same lines and skip what validation.csv already holds.

Everything that can fail (unreadable or foreign checkpoints, a model that does not match, missing
data) is checked before the first line is written to the run folder: a failed command leaves the
folder as it was. `setup` is the run as `cnns.engine.setup.set_up` made it to evaluate (its world, data,
feed, precision and assembled model), which imports this module: hence no annotation.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cnns.config import RunConfig
from cnns.engine.assembly import unwrap
from cnns.engine.evaluate import EvalResult, evaluate
from cnns.errors import CheckpointError
from cnns.runfolder.checkpoint import (check_matches_model, iteration_of, list_checkpoints, list_weight_averages,
                                       load_checkpoint)
from cnns.runfolder.run_folder import RestoreTarget
from cnns.runfolder.log import RunLog, validated_names

EMA_SUFFIX = "_ema"


@dataclass
class Target:
    """One row of validation.csv to produce: a checkpoint's weights, or its moving average."""

    name: str
    path: Path
    state: dict[str, Any]  # memory-mapped: tensors are read when loaded into the model
    use_ema: bool

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        return self.state["ema"] if self.use_ema else self.state["model"]

    @property
    def iteration(self) -> int:
        return int(self.state.get("iteration", iteration_of(self.path)))

    def epoch(self, global_batch_size: int, num_train_samples: int) -> float:
        if "epoch" in self.state:
            return float(self.state["epoch"])
        return global_batch_size * max(self.iteration, 0) / num_train_samples


def latency_line(latencies_ms: list[float]) -> str:
    values = np.asarray(latencies_ms, dtype=np.float64)
    return (f"latency avg: {values.mean():.4f} ms, latency 99p: {np.percentile(values, 99):.4f} ms, "
            f"latency 99p9: {np.percentile(values, 99.9):.4f} ms, latency max: {values.max():.4f} ms")


def checkpoint_files(target: RestoreTarget) -> tuple[Path, list[Path]]:
    """(run folder, files): the checkpoint file --restore-path names, or its run's checkpoints by iteration then
    its weight averages (`cnns.runfolder.run_folder.open_restore_path`'s reading and lines)."""
    if target.file is not None:
        return target.run.path, [target.file]
    run = target.run
    averages = run.weight_averages()
    return run.path, (run.checkpoints() if averages else run.require_checkpoints()) + averages


def targets_of(files: list[Path]) -> list[Target]:
    """Every row the files can give, raw weights then the moving average; unreadable files raise here."""
    targets = []
    for path in files:
        state = load_checkpoint(path, mmap=True)
        targets.append(Target(path.stem, path, state, use_ema=False))
        if isinstance(state.get("ema"), dict):
            targets.append(Target(path.stem + EMA_SUFFIX, path, state, use_ema=True))
    return targets


def row_names(path: Path, with_ema: bool) -> list[str]:
    """The rows of validation.csv a file gives, known without reading it: its name, and with a moving average in
    the run's checkpoints (--ema-decay; never in a weight average) its average's."""
    averaged = path.name.startswith("ckpt-") and with_ema
    return [path.stem] + ([path.stem + EMA_SUFFIX] if averaged else [])


def still_to_validate(files: list[Path], done: set[str], with_ema: bool) -> list[Path]:
    """The files that give a row validation.csv does not hold yet: the only ones a rerun reads (each
    checkpoint's read checks every byte of it)."""
    return [path for path in files if not set(row_names(path, with_ema)) <= done]


def readable_targets(files: list[Path]) -> tuple[list[Target], list[tuple[Path, str]]]:
    """`targets_of` for every file that can be read, and the others with the reason (path, reason)."""
    targets, unreadable = [], []
    for path in files:
        try:
            targets += targets_of([path])
        except CheckpointError as exc:
            unreadable.append((path, str(exc)))
    return targets, unreadable


def check_targets_match(targets: list[Target], model: torch.nn.Module, description: str) -> None:
    model_state = unwrap(model).state_dict()
    for target in targets:
        check_matches_model(target.path, target.weights, model_state, description)


# validation.py on generated or synthetic data, without --validation-images: batches per pass (of one process:
# replicas share them, so that a checkpoint's row counts the same images whatever the replica count).
DEFAULT_GENERATED_BATCHES = 20


def generated_validation_limit(cfg: RunConfig, setup, log: RunLog, trained_images: int | None) -> int | None:
    """How many batches each process validates per checkpoint: all of real data; of generated or
    synthetic data (random pixels: the accuracy is chance whatever the count) --validation-images,
    else as many images as the run trained on, else DEFAULT_GENERATED_BATCHES batches' images, shared out over
    the replicas (the same first images of the evaluation order whatever their count). Says so. The one count of
    every command that validates: validation.py, weight_avg.py and the validation after training."""
    if cfg.data.source == "files":
        return None
    source, replicas = setup.sources.eval, setup.world.replicas
    batch = len(next(iter(source.epoch(0)))[1])
    asked = cfg.train.validation_images
    images = asked or trained_images or DEFAULT_GENERATED_BATCHES * batch
    batches = max(1, min(len(source), -(-images // (batch * replicas))))
    why = ("--validation-images" if asked else "as many as the run trained on" if trained_images
           else f"{DEFAULT_GENERATED_BATCHES} batches of {batch}")
    log.print(f"Validating {batches * batch * replicas} of the {source.num_samples} {cfg.data.source} images per "
              f"checkpoint ({why}); --validation-images N sets how many")
    return batches


def validate_targets(targets: list[Target], setup, log: RunLog, cfg: RunConfig, num_train_samples: int,
                     repeat: int = 1) -> list[EvalResult]:
    """validation.py's and weight_avg.py's rows: each target over the images `generated_validation_limit` counts
    (validation after training counts the same way: `validate_run_folder`)."""
    batches = generated_validation_limit(cfg, setup, log, None)
    rows = [(t.name, t.iteration, t.epoch(cfg.train.global_batch_size, num_train_samples)) for t in targets]
    return _validate(rows, [t.weights for t in targets], setup, log, repeat, batches)


def _validate(rows: list[tuple[str, int, float]], weights: list[dict[str, torch.Tensor] | None], setup,
              log: RunLog, repeat: int = 1, batches: int | None = None) -> list[EvalResult]:
    """Validate each row's weights over the first `batches` batches of each process (None: all).
    With replicas, rank 0 holds the weights (the others None) and sends them; each process evaluates
    its share of the images and the counts are summed, so every image is counted exactly once."""
    results = []
    model = unwrap(setup.model)
    for (name, iteration, epoch), state in zip(rows, weights):
        if state is not None:
            model.load_state_dict(state)
        setup.world.broadcast_state(model)
        for _ in range(repeat):
            data = setup.sources.eval.epoch(0)
            if batches is not None:
                data = itertools.islice(data, batches)
            with log.progress(batches or len(setup.sources.eval), description=f"validating {name}",
                              unit="batch") as bar:
                result = evaluate(setup.model, _advancing(data, bar), setup.feed, setup.policy)
                result = summed_over_processes(result, setup)
            log_validation(log, name, iteration, epoch, result)
            results.append(result)
    return results


def _advancing(batches, bar):
    """The batches, moving a terminal's progress bar (None: no bar) as each is taken."""
    for batch in batches:
        yield batch
        if bar is not None:
            bar.update(1)


def summed_over_processes(result: EvalResult, setup) -> EvalResult:
    if not setup.world.distributed:
        return result
    top1, top5, count = setup.world.sum([result.correct_top1, result.correct_top5, result.count])
    seconds = max(setup.world.gather(result.seconds))  # the pass lasts as long as its slowest process
    return EvalResult(int(top1), int(top5), int(count), seconds, result.latencies_ms)


def log_validation(log: RunLog, name: str, iteration: int, epoch: float, result: EvalResult) -> None:
    log.validation_result({
        "name": name, "iteration": iteration, "epoch": epoch, "val_acc": result.top1, "raw_acc": result.top1,
        "val_time": result.seconds, "val_size": result.count, "img_per_sec": result.throughput,
        "latency": result.latency_avg_ms, "val_top5": result.top5,
    })


def validate_run_folder(folder: Path, setup, log: RunLog, cfg: RunConfig, num_train_samples: int,
                        trained_images: int | None = None) -> list[EvalResult]:
    """After training: every checkpoint but the initial one, their moving averages and the weight
    averages, except what validation.csv already holds (a restored run validates, and reads, only the new ones),
    over the images `generated_validation_limit` counts (of generated data, as many as the run trained on).
    Rank 0 reads the run folder; with replicas the others validate what it sends."""
    batches = generated_validation_limit(cfg, setup, log, trained_images)
    targets: list[Target] = []
    if setup.world.is_writer:
        done = validated_names(folder)
        files = [path for iteration, path in list_checkpoints(folder) if iteration != 0] + list_weight_averages(folder)
        files = still_to_validate(files, done, bool(cfg.train.ema_decay))
        targets = [t for t in targets_of(files) if t.name not in done]
    rows = setup.world.broadcast([(t.name, t.iteration, t.epoch(cfg.train.global_batch_size, num_train_samples))
                                  for t in targets])
    weights = [t.weights for t in targets] if setup.world.is_writer else [None] * len(rows)
    return _validate(rows, weights, setup, log, batches=batches)
