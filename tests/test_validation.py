"""validation.py on a run's checkpoints, and the safety of every command that reads a run folder."""

from __future__ import annotations

import csv
import re
import shutil
import subprocess
from pathlib import Path

import pytest

import scripts
import torch

from cnns.cli import run_script as run_command
from model_kinds import MODELS

TEST_IMAGES = 48


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def snapshot(folder: Path) -> dict[str, tuple[int, bytes]]:
    """Every file of a folder with its modification time and content."""
    return {str(p.relative_to(folder)): (p.stat().st_mtime_ns, p.read_bytes()) for p in folder.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def data_dir(shapes_cifar10) -> Path:
    return shapes_cifar10("tiny", train=128, test=TEST_IMAGES, seed=6)


@pytest.fixture(scope="module")
def trained_runs(data_dir, tmp_path_factory):
    """model (tests/model_kinds.py) -> its run as Graphcore's application tests it: 4 updates, 2 device iterations,
    a million checkpoints an epoch asked (so one at every synchronisation: the host holds the weights only there),
    no validation; each made once, when a test first asks for it.

    Trained in this process (a new interpreter would import torch again).
    """
    made: dict[str, Path] = {}

    def run(model: str) -> Path:
        if model not in made:
            folder = tmp_path_factory.mktemp("runs") / "run"
            scripts.train_here("--dataset", "cifar-10", "--data-dir", str(data_dir), *MODELS[model],
                               "--micro-batch-size", "16", "--iterations", "4", "--device-iterations", "2",
                               "--no-validation", "--ckpts-per-epoch", "1000000", "--seed", "2", "--logs-path",
                               str(folder))
            made[model] = folder
        return made[model]

    return run


@pytest.fixture(scope="module")
def trained_run(trained_runs) -> Path:
    """The seed's ResNet-8's run."""
    return trained_runs("resnet-8")


@pytest.fixture
def run_copy(trained_run, tmp_path) -> Path:
    copy = tmp_path / trained_run.name
    shutil.copytree(trained_run, copy)
    return copy


@pytest.mark.parametrize("model", MODELS)
def test_validation_validates_every_checkpoint_once(trained_runs, model, tmp_path, capfd):
    run_copy = tmp_path / "run"
    shutil.copytree(trained_runs(model), run_copy)
    assert sorted(p.name for p in run_copy.glob("ckpt-*.pt")) == ["ckpt-0.pt", "ckpt-2.pt", "ckpt-4.pt"]
    out = scripts.run_here(capfd, "validation.py", "--restore-path", str(run_copy), cwd=tmp_path)
    lines = re.findall(r"^Validation top-1 accuracy: +[\d.]+% \[(ckpt-\d+)\] \(iteration: +(\d+), epoch: +([\d.]+),",
                       out.stdout, re.MULTILINE)
    assert [(name, int(it)) for name, it, _ in lines] == [("ckpt-0", 0), ("ckpt-2", 2), ("ckpt-4", 4)]
    assert float(lines[-1][2]) == pytest.approx(4 * 16 / 128, abs=0.01)  # the run's epochs, not a nominal size
    rows = read_csv(run_copy / "validation.csv")
    assert [(r["name"], int(r["iteration"])) for r in rows] == [("ckpt-0", 0), ("ckpt-2", 2), ("ckpt-4", 4)]
    for row in rows:
        assert int(row["val_size"]) == TEST_IMAGES
        assert 0.0 <= float(row["val_acc"]) <= float(row["val_top5"]) <= 100.0

    again = scripts.run_here(capfd, "validation.py", "--restore-path", str(run_copy)).stdout  # again: nothing new
    assert "Validation top-1 accuracy" not in again
    assert again.count("Skipping validation run on checkpoint") == 3
    assert len(read_csv(run_copy / "validation.csv")) == 3


def test_validation_of_one_checkpoint_file(run_copy, capsys):
    assert run_command("validate", ["--restore-path", str(run_copy / "ckpt-2.pt")]) == 0
    assert "[ckpt-2] (iteration:      2," in capsys.readouterr().out
    assert [r["name"] for r in read_csv(run_copy / "validation.csv")] == ["ckpt-2"]


def test_global_batch_size_places_a_checkpoint_without_its_epoch(run_copy, capsys):
    # Checkpoints written here record their epoch (4 updates of 16 of the run's 128 images: 0.5) ...
    assert run_command("validate", ["--restore-path", str(run_copy / "ckpt-4.pt"), "--global-batch-size", "64"]) == 0
    assert "[ckpt-4] (iteration:      4, epoch:   0.50," in capsys.readouterr().out
    # ... one that does not is placed as Graphcore's application placed every one: iterations x the global batch over
    # the dataset's size (CIFAR-10: 50,000 images).
    state = torch.load(run_copy / "ckpt-4.pt", weights_only=True)
    del state["epoch"]
    foreign = run_copy / "foreign"
    foreign.mkdir()
    shutil.copy(run_copy / "arguments.json", foreign)
    torch.save(state, foreign / "ckpt-4.pt")
    assert run_command("validate", ["--restore-path", str(foreign / "ckpt-4.pt"), "--global-batch-size", "25000"]) == 0
    assert "[ckpt-4] (iteration:      4, epoch:   2.00," in capsys.readouterr().out


def test_repeat_passes_over_generated_data_then_a_latency_line(capsys):
    assert run_command("validate", ["--model", "resnet", "--model-size", "8", "--dataset", "cifar-10",
                                    "--generated-data", "--repeat", "3", "--micro-batch-size", "4",
                                    "--validation-images", "8"]) == 0
    out = capsys.readouterr().out
    passes = re.findall(r"^Validation top-1 accuracy: .*throughput: ([\d.]+) samples/sec, time: ([\d.]+),", out,
                        re.MULTILINE)
    assert len(passes) == 3  # --repeat 3
    for throughput, seconds in passes:  # --validation-images 8: each pass is 8 images
        assert float(throughput) * float(seconds) == pytest.approx(8, rel=0.02)
    assert re.search(r"^latency avg: [\d.]+ ms, latency 99p: [\d.]+ ms, latency 99p9: [\d.]+ ms, latency max: [\d.]+ ms$",
                     out, re.MULTILINE)


def test_a_validated_run_validates_the_moving_average_beside_the_weights(run_copy, capsys):
    state = torch.load(run_copy / "ckpt-4.pt", weights_only=True)
    state["ema"] = {k: v.clone() for k, v in state["model"].items()}
    torch.save(state, run_copy / "ckpt-4.pt")
    assert run_command("validate", ["--restore-path", str(run_copy)]) == 0
    names = [r["name"] for r in read_csv(run_copy / "validation.csv")]
    assert names == ["ckpt-0", "ckpt-2", "ckpt-4", "ckpt-4_ema"]
    rows = read_csv(run_copy / "validation.csv")
    assert rows[2]["val_acc"] == rows[3]["val_acc"]  # the same weights give the same accuracy


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def foreign(path: Path) -> None:
    """A pickle that would run code if it were loaded without weights_only."""
    import collections

    torch.save({"model": collections.OrderedDict(), "payload": subprocess.CompletedProcess(["x"], 0)}, path)


@pytest.mark.parametrize("damage, message", [(truncate, "truncated"), (foreign, "weights_only")])
@pytest.mark.parametrize("command", ["validate-file", "weight-avg"])
def test_a_damaged_checkpoint_a_command_must_read_stops_it_before_anything_is_written(run_copy, capsys, damage,
                                                                                       message, command):
    """validation.py given the file itself, and weight_avg.py, whose average needs every chosen checkpoint."""
    damage(run_copy / "ckpt-4.pt")
    before = snapshot(run_copy)
    argv = (["validate", "--restore-path", str(run_copy / "ckpt-4.pt")] if command == "validate-file" else
            ["weight-avg", "--restore-path", str(run_copy), "--mode", "mean"])
    assert run_command(argv[0], argv[1:]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: cannot read checkpoint") and "ckpt-4.pt" in err[0]
    assert message in err[0]
    assert snapshot(run_copy) == before


def test_a_checkpoint_of_another_model_is_one_clear_error(run_copy, capsys):
    before = snapshot(run_copy)
    assert run_command("validate", ["--restore-path", str(run_copy), "--model-size", "14"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not match the model resnet-14" in err[0]
    assert snapshot(run_copy) == before


@pytest.mark.parametrize("damage", [truncate, foreign], ids=["truncated", "foreign"])
def test_validation_names_an_unreadable_checkpoint_and_validates_the_others(run_copy, tmp_path, capfd, damage):
    damage(run_copy / "ckpt-4.pt")
    out = scripts.run_here(capfd, "validation.py", "--restore-path", str(run_copy), cwd=tmp_path, expect=1)
    validated = re.findall(r"^Validation top-1 accuracy: .*\[(ckpt-\d+)\]", out.stdout, re.MULTILINE)
    assert validated == ["ckpt-0", "ckpt-2"]
    assert "ckpt-4.pt" in out.stdout.splitlines()[-1] and "unreadable" in out.stdout.splitlines()[-1]
    assert "Traceback" not in out.stderr
    assert [r["name"] for r in read_csv(run_copy / "validation.csv")] == ["ckpt-0", "ckpt-2"]


@pytest.mark.parametrize("damage", [truncate, foreign], ids=["truncated", "foreign"])
def test_restore_skips_an_unreadable_newest_checkpoint_and_ends_where_the_run_ended(trained_run, run_copy, tmp_path,
                                                                                    capfd, damage):
    """The newest checkpoint unreadable (a copy cut short, another program's file): restore.py continues from the
    one before it, says which it skipped, keeps its bytes aside, and (seeded, on the CPU) trains to the same
    weights as the uninterrupted run."""
    damage(run_copy / "ckpt-4.pt")
    damaged = (run_copy / "ckpt-4.pt").read_bytes()
    out = scripts.run_here(capfd, "restore.py", "--restore-path", str(run_copy), cwd=tmp_path)
    assert "skipped the unreadable checkpoint" in out.stdout and "kept as ckpt-4.pt.unreadable" in out.stdout
    assert (run_copy / "ckpt-4.pt.unreadable").read_bytes() == damaged
    assert f"Restoring training from latest checkpoint: {run_copy / 'ckpt-2.pt'}" in out.stdout
    restored = torch.load(run_copy / "ckpt-4.pt", weights_only=True)["model"]
    uninterrupted = torch.load(trained_run / "ckpt-4.pt", weights_only=True)["model"]
    assert restored.keys() == uninterrupted.keys()
    assert all(torch.equal(restored[k], uninterrupted[k]) for k in restored)


def test_restore_with_no_readable_checkpoint_is_one_line_and_leaves_the_folder(run_copy, tmp_path, capfd):
    for path in run_copy.glob("ckpt-*.pt"):
        truncate(path)
    before = snapshot(run_copy)
    out = scripts.run_here(capfd, "restore.py", "--restore-path", str(run_copy), cwd=tmp_path, expect=2)
    assert out.stderr.startswith("error: no readable checkpoint in") and out.stderr.count("\n") == 1
    assert snapshot(run_copy) == before
