"""Ctrl-C (SIGINT) ends a command with 130 wherever it lands: during training after the checkpoint it saves
(and says how to continue), during validation at once. SIGTERM, a scheduler's request to save and stop, still
ends training cleanly (tests/test_restore.py). Real processes and real signals, each wait bounded."""

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


def started(tmp_path: Path, data_dir: Path, folder: Path, *options: str) -> subprocess.Popen:
    return processes.start([sys.executable, str(scripts.ROOT / "train.py"), "--dataset", "cifar-10", "--data-dir",
                            str(data_dir), "--model-size", "8", "--micro-batch-size", "4", "--seed", "1",
                            "--logs-path", str(folder), *options],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})


def interrupt_once(process: subprocess.Popen, ready) -> tuple[str, str]:
    """SIGINT as soon as `ready()` holds; what the process printed once it has ended."""
    deadline = time.monotonic() + DEADLINE_S
    while process.poll() is None and not ready():
        assert time.monotonic() < deadline, "the run never got there"
        time.sleep(0.005)
    assert process.poll() is None, "the run ended before the signal"
    process.send_signal(signal.SIGINT)
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
    process = started(tmp_path, data_dir, folder, "--iterations", "16", "--ckpts-per-epoch", "16")
    out, err = interrupt_once(process, lambda: (folder / "validation.csv").exists())
    assert process.returncode == 130, out[-2000:] + err[-2000:]
    assert err.strip().splitlines() == ["error: interrupted"]
    assert "Training loop completed" in out and len(list(folder.glob("ckpt-*.pt"))) == 17
