"""Weight averaging (weight_avg.py, --weight-avg-N, --weight-avg-exp) and the moving average (--ema-decay)."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest

import scripts
import torch
from torch import nn

from cnns.cli import run_script as run_command
from cnns.data.drawn_shapes import draw_shapes
from cnns.data.cifar_records import write_cifar10
from cnns.engine.averaging import average_state_dicts
from cnns.engine.ema import WeightEma
from model_kinds import MODELS
from test_cli import graphcore_command_lines


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def load(path: Path) -> dict:
    return torch.load(path, weights_only=True)


def closed_form_mean(states: list[dict]) -> dict[str, torch.Tensor]:
    return {k: (sum(s[k].double() for s in states) / len(states)).to(v.dtype)
            for k, v in states[-1].items() if v.is_floating_point()}


def closed_form_exponential(states: list[dict], decay: float) -> dict[str, torch.Tensor]:
    """decay^(n-1) C_0 + sum over i >= 1 of (1 - decay) decay^(n-1-i) C_i."""
    n = len(states)
    weights = [decay ** (n - 1)] + [(1 - decay) * decay ** (n - 1 - i) for i in range(1, n)]
    return {k: sum(w * s[k].double() for w, s in zip(weights, states)).to(v.dtype)
            for k, v in states[-1].items() if v.is_floating_point()}


def assert_equals_closed_form(averaged: dict, expected: dict, last: dict) -> None:
    for key, tensor in averaged.items():
        assert tensor.dtype == last[key].dtype, key
        if key in expected:
            # A float32 average of a few checkpoints against the float64 closed form: one rounding
            # (2^-24) per checkpoint added, a few 1e-7 relative.
            torch.testing.assert_close(tensor, expected[key], rtol=1e-6, atol=1e-7)
        else:  # integer buffers: the last checkpoint's value
            assert torch.equal(tensor, last[key]), key


def random_states(count: int) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    return [{"conv.weight": torch.randn(4, 3, generator=generator),
             "fc.weight": torch.randn(5, generator=generator).to(torch.bfloat16),
             "bn.num_batches_tracked": torch.tensor(10 * (i + 1))} for i in range(count)]


@pytest.mark.parametrize("mode", ["mean", "exponential"])
def test_averages_are_the_closed_forms_in_each_tensors_dtype(mode):
    states = random_states(4)
    averaged = average_state_dicts(iter(states), len(states), mode, decay=0.8)
    expected = closed_form_mean(states) if mode == "mean" else closed_form_exponential(states, 0.8)
    assert_equals_closed_form(averaged, expected, states[-1])
    assert averaged["bn.num_batches_tracked"].item() == 40


def test_the_moving_average_of_half_weights_is_kept_in_float32():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).to(torch.bfloat16)
    ema = WeightEma(model, decay=0.9)
    expected = {k: v.double() for k, v in model.state_dict().items() if v.is_floating_point()}
    for step in range(5):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * (step + 1))
        model.get_submodule("1").num_batches_tracked += 1
        ema.update(model)
        for k, v in model.state_dict().items():
            if v.is_floating_point():
                expected[k] = 0.9 * expected[k] + 0.1 * v.double()
    state = ema.state_dict()
    for key, value in expected.items():
        assert state[key].dtype == torch.float32
        # Five float32 updates (a multiply and an add each) against float64: at most 5 x 2 x 2^-24 = 6e-7
        # of the largest value averaged (weights below 1 here).
        torch.testing.assert_close(state[key].double(), value, rtol=1e-6, atol=1e-6)
    assert state["1.num_batches_tracked"].item() == 5


@pytest.fixture(scope="module")
def averaged_runs(tmp_path_factory):
    """model (tests/model_kinds.py) -> its run of 2 epochs of 8 updates, a checkpoint every half epoch, a moving
    average, and both averages after training; each made once, when a test first asks for it.

    Trained in this process (a new interpreter costs seconds of start-up on two busy cores).
    """
    data = tmp_path_factory.mktemp("cifar-10-avg")
    images, labels = draw_shapes(128 + 32, seed=9)
    write_cifar10(data, (images[:128], labels[:128]), (images[128:], labels[128:]))
    made: dict[str, Path] = {}

    def run(model: str) -> Path:
        if model not in made:
            folder = data.parent / f"averaged-run-{model}"
            scripts.train_here(
                "--dataset", "cifar-10", "--data-dir", str(data), *MODELS[model], "--micro-batch-size", "16",
                "--epochs", "2", "--warmup-epochs", "0", "--ckpts-per-epoch", "2", "--optimiser", "momentum",
                "--seed", "3", "--ema-decay", "0.9", "--weight-avg-N", "1", "--weight-avg-exp", "0.9",
                "--logs-path", str(folder))
            made[model] = folder
        return made[model]

    return run


@pytest.fixture(scope="module")
def averaged_run(averaged_runs) -> Path:
    """The seed's ResNet-8's averaged run."""
    return averaged_runs("resnet-8")


def checkpoints(folder: Path, iterations: list[int]) -> list[dict]:
    return [load(folder / f"ckpt-{it}.pt")["model"] for it in iterations]


@pytest.mark.parametrize("model", MODELS)
def test_training_time_averages_and_moving_average_are_saved_and_validated(averaged_runs, model):
    averaged_run = averaged_runs(model)
    # --weight-avg-N 1: the checkpoints of the last epoch (epochs 1.0, 1.5 and 2.0), each once.
    mean = load(averaged_run / "weight_avg_N_1.pt")
    assert mean["averaged_iterations"] == [8, 12, 16]
    trained = checkpoints(averaged_run, [8, 12, 16])
    assert_equals_closed_form(mean["model"], closed_form_mean(trained), trained[-1])
    # --weight-avg-exp 0.9: every checkpoint but the initial weights.
    exponential = load(averaged_run / "weight_avg_exp_0.9.pt")
    assert exponential["averaged_iterations"] == [4, 8, 12, 16]
    trained = checkpoints(averaged_run, [4, 8, 12, 16])
    assert_equals_closed_form(exponential["model"], closed_form_exponential(trained, 0.9), trained[-1])

    final = load(averaged_run / "ckpt-16.pt")
    assert final["ema"].keys() == final["model"].keys()
    assert all(t.dtype == torch.float32 for t in final["ema"].values() if t.is_floating_point())  # 16.16's too
    assert not torch.equal(final["ema"][classifier(final)], final["model"][classifier(final)])
    names = [row["name"] for row in read_csv(averaged_run / "validation.csv")]
    assert names == ["ckpt-4", "ckpt-4_ema", "ckpt-8", "ckpt-8_ema", "ckpt-12", "ckpt-12_ema", "ckpt-16",
                     "ckpt-16_ema", "weight_avg_N_1", "weight_avg_exp_0.9"]


def classifier(checkpoint: dict) -> str:
    """The weight of the model's classifier, its last tensor of two dimensions (fc.weight, timm's classifier.weight)."""
    return [key for key, tensor in checkpoint["model"].items() if tensor.dim() == 2][-1]


@pytest.fixture
def run_copy(averaged_run, tmp_path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(averaged_run, copy)
    return copy


@pytest.mark.parametrize("model", MODELS)
def test_weight_avg_py_mean_of_the_last_checkpoints_is_saved_and_validated(averaged_runs, model, tmp_path, capfd):
    run_copy = tmp_path / "run"
    shutil.copytree(averaged_runs(model), run_copy)
    out = scripts.run_here(capfd, "weight_avg.py", "--restore-path", str(run_copy), "--mode", "mean", "-N", "2",
                           "--discard-last", "1", cwd=tmp_path)
    averaged = load(run_copy / "weight_avg_mean_last2_discard1.pt")
    assert averaged["averaged_iterations"] == [8, 12]
    trained = checkpoints(run_copy, [8, 12])
    assert_equals_closed_form(averaged["model"], closed_form_mean(trained), trained[-1])
    assert "Validation top-1 accuracy" in out.stdout and "[weight_avg_mean_last2_discard1]" in out.stdout
    row = read_csv(run_copy / "validation.csv")[-1]
    assert (row["name"], row["iteration"]) == ("weight_avg_mean_last2_discard1", "12")


def test_weight_avg_py_exponential_over_all_checkpoints_without_validation(run_copy, capsys):
    rows = len(read_csv(run_copy / "validation.csv"))
    assert run_command("weight-avg", ["--restore-path", str(run_copy), "--mode", "exponential", "--decay", "0.8",
                                      "--no-validation"]) == 0
    averaged = load(run_copy / "weight_avg_exp_0.8_last4.pt")
    trained = checkpoints(run_copy, [4, 8, 12, 16])
    assert_equals_closed_form(averaged["model"], closed_form_exponential(trained, 0.8), trained[-1])
    assert len(read_csv(run_copy / "validation.csv")) == rows
    assert "Averaged 4 checkpoints (exponential, decay 0.8" in capsys.readouterr().out


def test_weight_avg_py_with_nothing_left_to_average_is_one_clear_error(run_copy, capsys):
    assert run_command("weight-avg", ["--restore-path", str(run_copy), "--discard-last", "4"]) == 2
    assert capsys.readouterr().err.strip() == "error: --discard-last 4 leaves none of the 4 checkpoints"


VALIDATION_LINES = graphcore_command_lines("validation.py")


@pytest.mark.parametrize("argv", VALIDATION_LINES, ids=lambda a: " ".join(a)[:80])
def test_weight_avg_py_accepts_graphcores_validation_options_and_prints_its_config(argv, capsys):
    from cnns.cli.runs import weight_avg_main

    assert weight_avg_main(argv + ["--mode", "exponential", "--decay", "0.97", "-N", "3", "--print-config"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["micro_batch_size"] >= 1 and printed["mode"] == "exponential" and printed["N"] == 3


def test_weight_avg_py_print_config_reads_the_run_arguments(averaged_run, capsys):
    assert run_command("weight-avg", ["--restore-path", str(averaged_run), "--print-config"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert (printed["model_size"], printed["micro_batch_size"], printed["global_batch_size"]) == ("8", 16, 16)
