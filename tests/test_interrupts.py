"""A signal ends a command with 128 + its number wherever it lands (SPEC §8): during training after the
checkpoint it saves (and says how to continue), elsewhere at once with one line. SIGINT here, SIGTERM in
training in tests/test_restore.py and here in validation. Real processes and real signals, each wait bounded."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import processes
import scripts

DEADLINE_S = 240


@pytest.fixture(scope="module")
def data_dir(shapes_cifar10) -> Path:
    return shapes_cifar10("interrupts", train=64, test=512, seed=8)


TRAINING = ("--dataset", "cifar-10", "--model-size", "8", "--micro-batch-size", "4", "--seed", "1")


def started(tmp_path: Path, data_dir: Path, folder: Path, *options: str) -> subprocess.Popen:
    return processes.start([sys.executable, str(scripts.ROOT / "train.py"), *TRAINING, "--data-dir", str(data_dir),
                            "--logs-path", str(folder), *options],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})


def interrupt_once(process: subprocess.Popen, ready, signum: int = signal.SIGINT) -> tuple[str, str]:
    """`signum` as soon as `ready()` holds; what the process printed once it has ended."""
    deadline = time.monotonic() + DEADLINE_S
    while process.poll() is None and not ready():
        assert time.monotonic() < deadline, "the run never got there"
        time.sleep(0.005)
    assert process.poll() is None, "the run ended before the signal"
    process.send_signal(signum)
    return processes.communicate(process, timeout=DEADLINE_S)


def test_ctrl_c_during_training_saves_a_checkpoint_says_how_to_continue_and_exits_130(data_dir, tmp_path):
    folder = tmp_path / "run"
    process = started(tmp_path, data_dir, folder, "--iterations", "5000", "--log-freq", "1", "--ckpts-per-epoch", "0")
    out, err = interrupt_once(process, lambda: (folder / "training.csv").exists())
    assert process.returncode == 130, out[-2000:] + err[-2000:]
    stopped = int(out.split("Training interrupted by SIGINT at iteration ")[1].split(";")[0])
    assert f"checkpoint saved. Continue with: python restore.py --restore-path {folder}" in out
    assert [path.name for path in folder.glob("ckpt-*.pt")] == [f"ckpt-{stopped}.pt"]
    assert torch.load(folder / f"ckpt-{stopped}.pt", weights_only=True)["iteration"] == stopped
    assert not (folder / "validation.csv").exists() and err == ""


def test_ctrl_c_during_validation_exits_130(data_dir, tmp_path):
    folder = tmp_path / "run"
    # 17 checkpoints of 512 test images each to validate after 16 quick updates.
    process = started(tmp_path, data_dir, folder, "--iterations", "16", "--ckpts-per-epoch", "16",
                      "--device-iterations", "1")  # the host meets the device, and so a checkpoint can be, every update
    out, err = interrupt_once(process, lambda: (folder / "validation.csv").exists())
    assert process.returncode == 130, out[-2000:] + err[-2000:]
    assert err.strip().splitlines() == [f"error: interrupted; the run is trained; validation.py --restore-path "
                                        f"{folder} validates its checkpoints"]
    assert "Training loop completed" in out and len(list(folder.glob("ckpt-*.pt"))) == 17


def test_sigterm_during_validation_py_exits_143_with_one_line_and_leaves_whole_rows(data_dir, tmp_path, capfd):
    """validation.py has no update to finish: SIGTERM ends it where it is, with one line; the rows it wrote are
    whole, and running it again validates the rest. The interrupted validation.py is a real process with a real
    signal; the training before it and the second validation run their commands in this process (tests/scripts.py)."""
    folder = tmp_path / "run"
    scripts.train_here(*TRAINING, "--data-dir", str(data_dir), "--logs-path", str(folder), "--iterations", "16",
                       "--ckpts-per-epoch", "4", "--no-validation", "--device-iterations", "1", cwd=tmp_path)
    validation = processes.start([sys.executable, str(scripts.ROOT / "validation.py"), "--restore-path", str(folder)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                                 env={**os.environ, "OMP_NUM_THREADS": "1"})
    out, err = interrupt_once(validation, lambda: (folder / "validation.csv").exists(), signal.SIGTERM)
    assert validation.returncode == 128 + signal.SIGTERM, out[-2000:] + err[-2000:]
    assert err.strip().splitlines() == [f"error: interrupted by SIGTERM; validation.py --restore-path {folder} "
                                        "validates the checkpoints not yet in validation.csv"]
    rows = (folder / "validation.csv").read_text().splitlines()
    assert 2 <= len(rows) < 6 and all(len(row.split(",")) == len(rows[0].split(",")) for row in rows)
    scripts.run_here(capfd, "validation.py", "--restore-path", str(folder), cwd=tmp_path)  # exit 0, or fails
    assert len((folder / "validation.csv").read_text().splitlines()) == 6  # a header and each of 5 checkpoints once
