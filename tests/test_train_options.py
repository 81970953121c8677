"""Options observed on real runs of train.py (in this process: no interpreter start-up per run).

The learning rate of every update under each schedule and warm-up, read back from training.csv and
compared with Graphcore's application's closed forms; device iterations as the number of metric read-backs;
generated data through the host pipeline against synthetic data made once on the device; the
profiler's trace.
"""

from __future__ import annotations

import csv
import gzip
import json
import math
import re
from pathlib import Path

import pytest
import torch

from cnns.cli import run_script as run_command

TRAIN_IMAGES, MICRO_BATCH = 32, 8  # 4 updates per epoch
EXPONENT = -8
LR0 = 2.0**EXPONENT * MICRO_BATCH  # Graphcore's application's rule: 2^exponent x global batch


@pytest.fixture(scope="module")
def data_dir(shapes_cifar10) -> Path:
    return shapes_cifar10("options", train=TRAIN_IMAGES, test=16, seed=21)


def train(data_dir: Path, logs: Path, *args: str) -> Path:
    """A seeded ResNet-8 run in float32 with no validation; its run folder."""
    folder = logs / "run"
    assert run_command("train", ["--dataset", "cifar-10", "--data-dir", str(data_dir), "--model-size", "8",
                                 "--micro-batch-size", str(MICRO_BATCH), "--precision", "32.32",
                                 "--base-learning-rate-exponent", str(EXPONENT), "--no-validation",
                                 "--ckpts-per-epoch", "0", "--seed", "3", "--logs-path", str(folder), *args]) == 0
    return folder


def logged_rates(folder: Path) -> list[float]:
    """The learning rate of every update, from training.csv (one row per update)."""
    with open(folder / "training.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["iteration"]) for r in rows] == list(range(1, len(rows) + 1)), "one row per update expected"
    return [float(r["lr"]) for r in rows]


def every_update(epochs: int) -> list[str]:
    return ["--epochs", str(epochs), "--logs-per-epoch", str(TRAIN_IMAGES // MICRO_BATCH)]


# ---------------------------------------------------------------------------------------------
# --lr-schedule and --warmup-epochs through train.py: the rate of update t (0-based) of T


def test_stepped_schedule_drops_after_half_three_quarters_and_seven_eighths_of_the_run(data_dir, tmp_path):
    rates = logged_rates(train(data_dir, tmp_path, *every_update(8), "--warmup-epochs", "0",
                               "--lr-schedule", "stepped", "--learning-rate-decay", "0.1",
                               "--learning-rate-schedule", "0.5,0.75,0.875"))
    # T = 32: Graphcore's application drops on the update after int(b x T) = 16, 24, 28.
    expected = [LR0] * 17 + [LR0 * 0.1] * 8 + [LR0 * 0.01] * 4 + [LR0 * 0.001] * 3
    assert rates == pytest.approx(expected, rel=1e-12)


def test_exponential_schedule_drops_evenly_over_the_run(data_dir, tmp_path):
    rates = logged_rates(train(data_dir, tmp_path, *every_update(4), "--warmup-epochs", "0",
                               "--lr-schedule", "exponential", "--lr-decay-rate", "0.5", "--lr-drops", "4"))
    assert rates == pytest.approx([LR0 * 0.5 ** (t * 4 // 16) for t in range(16)], rel=1e-12)


def test_polynomial_schedule_warms_up_then_decays_to_its_end_ratio(data_dir, tmp_path):
    rates = logged_rates(train(data_dir, tmp_path, *every_update(6), "--warmup-epochs", "2",
                               "--lr-schedule", "polynomial", "--poly-lr-decay-power", "2",
                               "--poly-lr-end-ratio", "0.1"))
    T, W, end = 24, 8, 0.1 * LR0
    expected = [LR0 * t / W if t <= W else (LR0 - end) * (1 - (t - W) / (T - W)) ** 2 + end for t in range(T)]
    assert rates == pytest.approx(expected, rel=1e-12)


def test_warm_up_is_five_epochs_by_default_and_none_with_iterations(data_dir, tmp_path):
    # Graphcore's application's default schedule (stepped at 0.5, 0.75) after five epochs of linear warm-up from 0.
    rates = logged_rates(train(data_dir, tmp_path / "epochs", *every_update(10)))
    T, W = 40, 20
    expected = [LR0 * min(1.0, t / W) * 0.1 ** ((t > T // 2) + (t > 3 * T // 4)) for t in range(T)]
    assert rates == pytest.approx(expected, rel=1e-12)
    # --iterations has no epochs to count a warm-up in: the run starts at the full rate.
    rates = logged_rates(train(data_dir, tmp_path / "iterations", "--iterations", "8", "--log-freq", "1",
                               "--lr-schedule", "cosine"))
    assert rates == pytest.approx([LR0 * 0.5 * (1 + math.cos(math.pi * t / 8)) for t in range(8)], rel=1e-12)
    assert rates[0] == LR0


# ---------------------------------------------------------------------------------------------
# --device-iterations: how often the per-update metrics come back to the host


@pytest.mark.parametrize("device_iterations, read_backs", [(1, [1] * 12), (4, [4, 4, 4]), (5, [4, 1, 3, 2, 2])])
def test_device_iterations_read_the_metrics_back_once_every_n_updates(data_dir, tmp_path, monkeypatch,
                                                                      device_iterations, read_backs):
    from cnns.engine.loop import Outfeed

    drained: list[int] = []
    drain = Outfeed.drain

    def counted(self):
        drained.append(len(self.pending))  # updates whose metrics this read-back brings to the host
        return drain(self)

    monkeypatch.setattr(Outfeed, "drain", counted)
    train(data_dir, tmp_path, "--iterations", "12", "--log-freq", "12",
          "--device-iterations", str(device_iterations))
    # At most N updates apart, and at every epoch's end (4 updates an epoch here) and step line (12): with 5, the
    # host meets the device after updates 4, 5, 8, 10 and 12 (the cadence rule, `cnns.engine.cadence`).
    assert drained == read_backs


# ---------------------------------------------------------------------------------------------
# --generated-data and --synthetic-data: where the random images are made


@pytest.mark.parametrize("option", ["--generated-data", "--synthetic-data"])
def test_generated_data_crosses_from_the_host_each_update_and_synthetic_data_is_made_once(tmp_path, monkeypatch,
                                                                                         option):
    from cnns.engine import feed

    arrivals: list[torch.Tensor] = []
    normalised: list[torch.Tensor] = []
    to_device, normalise = feed.DeviceFeed.to_device, feed.normalise

    def arrive(self, images, labels):
        arrivals.append(images)
        return to_device(self, images, labels)

    def count(images, *args, **kwargs):
        normalised.append(images)
        return normalise(images, *args, **kwargs)

    monkeypatch.setattr(feed.DeviceFeed, "to_device", arrive)
    monkeypatch.setattr(feed, "normalise", count)
    assert run_command("train", ["--dataset", "cifar-10", option, "--model-size", "8", "--micro-batch-size", "4",
                                 "--iterations", "5", "--no-validation", "--ckpts-per-epoch", "0",
                                 "--logs-path", str(tmp_path / "run")]) == 0
    assert len(arrivals) == 5 and all(a.dtype == torch.uint8 and a.shape == (4, 32, 32, 3) for a in arrivals)
    if option == "--generated-data":
        # Made on the host by the input pipeline, a new batch every update, normalised on arrival.
        assert len({id(a) for a in arrivals}) == 5 and len(normalised) == 5
        assert all(not torch.equal(arrivals[0], a) for a in arrivals[1:])
    else:
        # One batch made on the device before the loop, fed again every update, normalised once.
        assert all(a is arrivals[0] for a in arrivals) and len(normalised) == 1
        assert getattr(arrivals[0], "_cnns_resident", False)


# ---------------------------------------------------------------------------------------------
# --profile: a torch.profiler trace where TensorBoard's profiler plugin looks for one


def test_profile_writes_a_trace_of_the_training_steps_that_tensorboard_reads(data_dir, tmp_path):
    folder = train(data_dir, tmp_path, "--iterations", "3", "--profile")
    # TensorBoard's PyTorch profiler plugin lists every <worker>.<time>.pt.trace.json(.gz) under its log dir.
    traces = [p for p in (folder / "profile").iterdir() if re.fullmatch(r".+\.pt\.trace\.json(\.gz)?", p.name)]
    assert len(traces) == 1, list((folder / "profile").iterdir())
    opener = gzip.open if traces[0].suffix == ".gz" else open
    with opener(traces[0], "rt") as f:
        events = json.load(f)["traceEvents"]
    names = [e.get("name", "") for e in events]
    # Three updates of ResNet-8's 7 convolutions (its shortcuts have none), forward and backward.
    assert sum(n == "aten::convolution" for n in names) == 3 * 7
    assert any(n.startswith("autograd::engine::evaluate_function: ConvolutionBackward") for n in names)


# ---------------------------------------------------------------------------------------------
# --compile on a CPU: Inductor's code trains the same model as eager


def test_compile_runs_inductor_code_that_updates_the_weights_as_eager_does(data_dir, tmp_path):
    from torch._dynamo.utils import counters

    counters.clear()
    try:
        compiled = train(data_dir, tmp_path / "compiled", "--iterations", "4", "--compile")
        graphs = counters["stats"]["unique_graphs"]
    finally:
        torch._dynamo.reset()
    eager = train(data_dir, tmp_path / "eager", "--iterations", "4")
    assert graphs >= 1  # the model ran as compiled graphs
    a, b = (torch.load(f / "ckpt-4.pt", weights_only=True)["model"] for f in (compiled, eager))
    for name in b:
        if b[name].is_floating_point():
            # float32 both ways, but Inductor fuses and reorders the reductions (batch norm's sums
            # over 8 x 32 x 32 values, the convolutions' weight gradients): each differs by a few
            # float32 roundings times sqrt(terms), ~1e-6 of its scale, and 4 updates carry it on.
            # Measured here: at most 5.5e-6 of a tensor's largest value; allowed 1e-4.
            scale = b[name].abs().max()
            assert (a[name] - b[name]).abs().max() <= 1e-4 * scale, name
        else:
            assert torch.equal(a[name], b[name]), name  # the batch counters


# ---------------------------------------------------------------------------------------------
# --precision: the types the convolutions really compute in and the weights are kept in


@pytest.mark.parametrize("precision, compute, weights", [
    ("16.32", torch.bfloat16, torch.float32),
    ("16.16", torch.bfloat16, torch.bfloat16),
    ("32.32", torch.float32, torch.float32),
])
def test_precision_sets_the_type_of_the_convolutions_and_of_the_weights(data_dir, tmp_path, monkeypatch,
                                                                        precision, compute, weights):
    seen: set[tuple[torch.dtype, torch.dtype]] = set()
    forward = torch.nn.Conv2d.forward

    def recorded(self, x):
        out = forward(self, x)
        if out.device.type != "meta":  # the memory estimate's pass before the run computes nothing
            seen.add((out.dtype, self.weight.dtype))
        return out

    monkeypatch.setattr(torch.nn.Conv2d, "forward", recorded)
    # --half-dtype bfloat16: the half type even where this CPU only emulates it.
    folder = train(data_dir, tmp_path, "--iterations", "2", "--precision", precision, "--half-dtype", "bfloat16")
    assert seen == {(compute, weights)}
    state = torch.load(folder / "ckpt-2.pt", weights_only=True)["model"]
    assert state["conv1.weight"].dtype == weights
    assert state["bn1.weight"].dtype == torch.float32  # norms stay float32 in every precision
