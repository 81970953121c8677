"""End-to-end training through the root scripts, on CIFAR-format data the tests write."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest

import scripts
import torch


def run_folder(stdout: str) -> Path:
    match = re.search(r"^ Saving to (.+)$", stdout, re.MULTILINE)
    assert match, stdout
    return Path(match.group(1))


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def small_cifar(shapes_cifar10) -> Path:
    """A learnable CIFAR-10 folder: 640 training and 200 test images of drawn shapes."""
    return shapes_cifar10("small", train=640, test=200, seed=3)


def test_resnet8_test_config_runs_ten_epochs_and_writes_the_run_folder(small_cifar, tmp_path, capfd):
    out = scripts.run_here(capfd, "train.py", "--config", "resnet8_test", "--data-dir", str(small_cifar),
                           "--log-dir", str(tmp_path / "logs"), cwd=tmp_path)
    folder = run_folder(out.stdout)
    assert folder.name.startswith("RN8_bs32_BN_16.16_")
    assert re.search(r"^Total Parameters:\d+$", out.stdout, re.MULTILINE)
    step_lines = re.findall(r"^step: .*throughput: +[\d.]+ samples/sec.*$", out.stdout, re.MULTILINE)
    assert len(step_lines) >= 10
    for name in ("arguments.json", "log.txt", "training.csv"):
        assert (folder / name).is_file(), name
    rows = read_csv(folder / "training.csv")
    assert float(rows[-1]["epoch"]) == pytest.approx(10.0)
    assert int(rows[-1]["iteration"]) == 10 * (640 // 32)
    # One checkpoint per epoch plus the initial one; resnet8_test turns validation off.
    checkpoints = sorted(int(p.stem.split("-")[1]) for p in folder.glob("ckpt-*.pt"))
    assert checkpoints == [20 * e for e in range(11)]
    assert not (folder / "validation.csv").exists()
    assert "Time to train:" in out.stdout


def test_stepped_schedule_logs_graphcores_learning_rates(small_cifar, tmp_path, capfd):
    out = scripts.run_here(capfd, "train.py", "--dataset", "cifar-10", "--data-dir", str(small_cifar), "--model-size",
                           "8", "--micro-batch-size", "32", "--epochs", "10", "--warmup-epochs", "0",
                           "--learning-rate-decay", "0.1", "--learning-rate-schedule", "0.5,0.75,0.875",
                           "--no-validation", "--ckpts-per-epoch", "0", "--log-dir", str(tmp_path / "logs"),
                           cwd=tmp_path)
    rows = read_csv(run_folder(out.stdout) / "training.csv")
    assert float(rows[0]["lr"]) == pytest.approx(0.5)
    assert float(rows[-1]["lr"]) == pytest.approx(0.0005)


def test_checkpoint_holds_a_plain_state_dict_loadable_weights_only(small_cifar, tmp_path, capfd):
    from cnns.models import ModelSpec, build_model

    out = scripts.run_here(capfd, "train.py", "--dataset", "cifar-10", "--data-dir", str(small_cifar), "--model-size",
                           "8", "--iterations", "3", "--no-validation", "--log-dir", str(tmp_path / "logs"),
                           cwd=tmp_path)
    folder = run_folder(out.stdout)
    state = torch.load(folder / "ckpt-3.pt", weights_only=True)
    plain = build_model(ModelSpec(arch="resnet", size="8", num_classes=10, image_size=32))
    assert set(state["model"]) == set(plain.state_dict())
    assert state["iteration"] == 3


@pytest.mark.parametrize("optimiser", ["AdamW", "LAMB"])
def test_the_quick_start_learns_with_an_added_optimiser_at_its_own_learning_rate(optimiser, small_cifar, tmp_path,
                                                                                capfd):
    """configs.yml's quick start (ResNet-8, 16.16, 6 epochs, cosine) with an optimiser added to the registry, at the
    optimiser's own CIFAR learning-rate exponent (the quick start names momentum's), on 640 drawn shapes: a falling
    loss. Measured (seed 1): epoch losses 2.35 to 2.10 for AdamW, 2.35 to 2.07 for LAMB, each below the one before."""
    from cnns.optim import OPTIMISERS

    exponent = OPTIMISERS[optimiser].defaults["base_learning_rate_exponent"]["cifar"]
    folder = tmp_path / "run"
    scripts.run_here(capfd, "train.py", "--config", "quickstart", "--dataset", "cifar-10", "--data-dir",
                     str(small_cifar), "--optimiser", optimiser.lower(), "--base-learning-rate-exponent", str(exponent),
                     "--logs-per-epoch", "1", "--no-validation", "--logs-path", str(folder), cwd=tmp_path)
    assert json.loads((folder / "arguments.json").read_text())["optimiser"] == optimiser
    losses = [float(row["loss_avg"]) for row in read_csv(folder / "training.csv")]
    assert len(losses) == 6 and losses[-1] < 0.95 * losses[0], losses


@pytest.mark.parametrize("argv, parameters", [
    (["--model", "resnet", "--model-size", "20", "--dataset", "cifar-10"], 269_722),
    (["--model", "resnet", "--model-size", "50", "--dataset", "imagenet", "--image-size", "64"], 25_557_032),
    (["--model", "resnext", "--model-size", "101", "--dataset", "imagenet", "--image-size", "64"], 44_177_704),
    (["--model", "efficientnet", "--model-size", "B0", "--dataset", "imagenet", "--image-size", "64"], 5_288_548),
    (["--model", "efficientnet", "--model-size", "4", "--dataset", "imagenet", "--image-size", "64"], 19_341_616),
])
def test_compile_only_prints_the_standard_parameter_counts(argv, parameters, tmp_path, capfd):
    out = scripts.run_here(capfd, "train.py", *argv, "--synthetic-data", "--micro-batch-size", "2", "--compile-only",
                           cwd=tmp_path)
    assert f"Total Parameters:{parameters}\n" in out.stdout
    assert not (tmp_path / "logs").exists()  # nothing written
