"""Divergence stops the run: a NaN or Inf loss (read back with the step lines' metrics, no read-back of its own)
or NaN or Inf weights at a checkpoint end training with one line naming the update, the last finite checkpoint
and what to try, exit 2, and no checkpoint of non-finite weights. An update that dynamic loss scaling skips and
backs off from (float16's overflows) is not divergence."""

from __future__ import annotations

import math
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from torch import nn

import scripts
from cnns.engine.cadence import Every, RunLength
from cnns.engine.loop import Diverged, StopRequest, TrainingLoop
from cnns.engine.step import StepMetrics, TrainStep
from cnns.optim import HalfPrecisionOptimiser, OptimiserSpec, build_optimiser, parameter_groups
from cnns.precision import LossScaler, PrecisionPolicy
from cnns.runfolder.log import RunLog
from cnns.lr_schedules import ScheduleSpec


@pytest.fixture(scope="module")
def data_dir(shapes_cifar10) -> Path:
    return shapes_cifar10("divergence", train=32, test=16, seed=5)


def checkpoints(folder: Path) -> dict[int, dict]:
    return {int(path.stem.split("-")[1]): torch.load(path, weights_only=True) for path in folder.glob("ckpt-*.pt")}


def all_finite(state: dict) -> bool:
    return all(torch.isfinite(t).all() for t in state["model"].values() if t.is_floating_point())


@pytest.mark.parametrize("cadence, found_by", [
    (["--ckpts-per-epoch", "0"], "its loss is nan"),  # no checkpoint on the way: the read-back loss finds it
    (["--ckpts-per-epoch", "4"], "the weights after it are NaN or Inf"),  # a checkpoint every update: its check
])
def test_a_huge_learning_rate_ends_the_run_with_one_line_and_only_finite_checkpoints(data_dir, tmp_path, capfd,
                                                                                   cadence, found_by):
    folder = tmp_path / "run"
    out = scripts.run_here(capfd, "train.py", "--dataset", "cifar-10", "--data-dir", str(data_dir), "--model-size",
                           "8", "--precision", "32.32", "--micro-batch-size", "8", "--iterations", "12", "--log-freq",
                           "1", "--abs-learning-rate", "1e6", "--warmup-epochs", "0", "--seed", "2", *cadence,
                           "--logs-path", str(folder), expect=2)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    line = lines[0]
    assert line.startswith("error: training diverged at update ") and found_by in line, line
    assert "a smaller learning rate (this run's is 1e+06" in line and "--warmup-epochs" in line
    assert "--auto-loss-scaling" not in line  # float32: loss scaling would not help
    saved = checkpoints(folder)
    assert all(all_finite(state) for state in saved.values())
    update = int(line.split("update ")[1].split(":")[0])
    assert 1 < update < 12 and all(i < update for i in saved)
    if saved:
        assert f"the last finite checkpoint is {folder / f'ckpt-{max(saved)}.pt'}." in line
    else:
        assert "no checkpoint was written before it" in line
    assert not (folder / "validation.csv").exists()  # nothing validated, nothing averaged
    assert "Training loop completed" not in out.stdout


def test_a_float16_run_that_diverges_is_told_of_dynamic_loss_scaling(data_dir, tmp_path, capfd):
    folder = tmp_path / "run"
    out = scripts.run_here(capfd, "train.py", "--dataset", "cifar-10", "--data-dir", str(data_dir), "--model-size",
                           "8", "--precision", "16.32", "--half-dtype", "float16", "--loss-scaling", "1",
                           "--micro-batch-size", "8", "--iterations", "12", "--log-freq", "4", "--abs-learning-rate",
                           "1e6", "--warmup-epochs", "0", "--seed", "2", "--ckpts-per-epoch", "0",
                           "--logs-path", str(folder), expect=2)
    assert "or dynamic loss scaling (--auto-loss-scaling)" in out.stderr.strip().splitlines()[-1]


class Batches:
    num_samples = 8

    def __len__(self) -> int:
        return 4

    def epoch(self, epoch: int, start_batch: int = 0):
        for _ in range(start_batch, 4):
            yield torch.zeros(2, 1), torch.zeros(1, dtype=torch.long)


def loop_of(losses: dict[int, tuple[float, bool]], saved: list[int]) -> TrainingLoop:
    """A loop over 8 updates whose step reports `losses[update] = (loss, backed_off)` (1.0 elsewhere)."""
    updates = iter(range(1, 9))

    def step(micro, lr):
        loss, backed_off = losses.get(next(updates), (1.0, False))
        return StepMetrics(torch.tensor(loss), torch.tensor(1), 1, backed_off)

    # The host syncs every 2 updates, where a checkpoint is due too; a step line every 4.
    length = RunLength(total_iterations=8, iterations_per_epoch=4, epochs=2.0, device_iterations=2,
                       lines=Every(Fraction(4)), checkpoints=Every(Fraction(2)))
    return TrainingLoop(step, lambda batches: batches, Batches(), ScheduleSpec("cosine", 0.1, 8), length,
                        grad_accum=1, global_batch_size=2, num_train_samples=8, log=RunLog(None, quiet=True),
                        save_checkpoint=saved.append)


@pytest.mark.parametrize("loss", [math.nan, math.inf, -math.inf])
def test_the_first_non_finite_loss_stops_the_loop_before_its_checkpoint(loss):
    saved = []
    with pytest.raises(Diverged) as raised:
        loop_of({3: (loss, False), 4: (math.nan, False)}, saved).run(StopRequest())
    assert raised.value.update == 3 and str(loss) in str(raised.value)
    assert saved == [2]  # the checkpoint of update 4, met at the same synchronisation, is not written


def test_an_update_that_dynamic_loss_scaling_skipped_is_not_divergence():
    saved = []
    result = loop_of({1: (math.inf, True), 2: (math.nan, True)}, saved).run(StopRequest())
    assert result.final_iteration == 8 and saved == [2, 4, 6, 8]


def _linear_step(scaler: LossScaler, factor: float) -> TrainStep:
    """A float32 step whose loss is the logits' sum times `factor`: inf overflows every gradient."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimiser = HalfPrecisionOptimiser(parameter_groups(model, 0.0),
                                       lambda groups: build_optimiser(groups, OptimiserSpec("SGD", lr=0.1)),
                                       stochastic_rounding=False, seed=0)
    policy = PrecisionPolicy.resolve("32.32", "bfloat16", torch.device("cpu"))
    return TrainStep(model, optimiser, policy, scaler, lambda logits, _: logits.sum() * factor, 1,
                     accumulate_in_float32=False)


def test_the_step_says_when_loss_scaling_backed_off_and_not_when_it_had_no_room_left():
    batch = [(torch.ones(3, 4), torch.zeros(3, dtype=torch.long))]
    scaler = LossScaler(4.0, dynamic=True)
    step = _linear_step(scaler, math.inf)
    weights = step.model.weight.detach().clone()
    assert [step(batch, 0.1).backed_off for _ in range(3)] == [True, True, False]  # 4 -> 2 -> 1, then none left
    assert scaler.scale == 1.0 and torch.equal(step.model.weight, weights)  # all three skipped
    assert _linear_step(LossScaler(4.0, dynamic=True), 1.0)(batch, 0.1).backed_off is False  # a clean update
    assert _linear_step(LossScaler(4.0, dynamic=False), math.inf)(batch, 0.1).backed_off is False  # static
