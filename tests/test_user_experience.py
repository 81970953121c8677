"""What a user sees: Graphcore's application's printed lines in order, a progress bar only on a terminal, lines that
reach a pipe as they are printed, training.png, and validation of random data that stays bounded.

A run whose output goes to a terminal or a pipe, and Graphcore's own test lines, run train.py and restore.py
in a child process; the others run the command in this process (tests/scripts.py)."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import processes
import scripts

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 240
# ResNet-8 on generated CIFAR-sized data: no dataset to write, a few seconds of training.
QUICK = ("--generated-data", "--dataset", "cifar-10", "--model-size", "8", "--micro-batch-size", "16",
         "--log-freq", "10", "--seed", "1")


def run(cwd: Path, script: str, *args: str) -> str:
    """The root script in a child process, its stdout a pipe."""
    return scripts.run_child(script, *args, cwd=cwd, timeout=TIMEOUT_S).stdout


def run_folder(stdout: str) -> Path:
    return Path(re.search(r"^ Saving to (.+)$", stdout, re.MULTILINE).group(1))


def test_graphcores_lines_in_their_order_and_training_png(tmp_path, capfd):
    # Generated CIFAR has 3125 updates of 16 an epoch: a checkpoint asked every 10 updates, more often than the
    # host syncs (--device-iterations 1000), so saved at the next sync, the run's last update and step line (20).
    out = scripts.run_here(capfd, "train.py", *QUICK, "--iterations", "20", "--ckpts-per-epoch", "312.5",
                           cwd=tmp_path).stdout
    folder = tmp_path / run_folder(out)
    lines = out.splitlines()

    def first(prefix: str) -> int:
        return next(i for i, line in enumerate(lines) if line.startswith(prefix))

    assert first("Total Parameters:") < first("Saved initial checkpoint to ") < first("Compilation time: ") \
        < first("step: ") < first("Saved checkpoint to ") < first("Validation top-1 accuracy:") \
        < first("Time to train: ")
    assert re.search(r"^Saved checkpoint to \S+ckpt-20\.pt in [\d.]+s$", out, re.MULTILINE)
    assert re.search(r"^Compilation time: [\d.]+s\.$", out, re.MULTILINE)
    png = (folder / "training.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")


def test_compile_only_says_the_graph_is_compiled_and_trains_nothing(tmp_path, capfd):
    out = scripts.run_here(capfd, "train.py", *QUICK, "--iterations", "5", "--compile-only", cwd=tmp_path).stdout
    assert "Training graph successfully compiled" in out and "Total Parameters:" in out
    assert "step:" not in out and not (tmp_path / "logs").exists()


def test_a_progress_bar_on_a_terminal(tmp_path):
    args = [sys.executable, str(ROOT / "train.py"), *QUICK, "--iterations", "30", "--no-validation",
            "--ckpts-per-epoch", "0"]
    master, slave = pty.openpty()
    # A new pseudo-terminal is 0 x 0 characters; a real one has a size, and tqdm fits the bar to it.
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    process = processes.start(args, cwd=tmp_path, stdin=slave, stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    seen = b""
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 1.0)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the terminal closed: the process ended
                break
            if not chunk:
                break
            seen += chunk
        elif process.poll() is not None:
            break
    os.close(master)
    processes.communicate(process, timeout=30)
    assert process.returncode == 0, seen[-2000:]
    terminal = seen.decode(errors="replace")
    assert "update/s" in terminal or "s/update" in terminal, terminal[-2000:]  # tqdm's rate
    assert "step:     30" in terminal  # Graphcore's lines still printed, above the bar


def test_lines_reach_a_pipe_while_the_run_goes_on_and_no_progress_bar_does(tmp_path):
    process = processes.start([sys.executable, str(ROOT / "train.py"), *QUICK, "--iterations", "400",
                               "--no-validation", "--ckpts-per-epoch", "0"], cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        line = ""
        while not line.startswith("step:"):
            line = processes.read_line(process.stdout, deadline)  # fails the test at the deadline
            assert line, "the run ended without a step line"
        assert process.poll() is None  # the first step line arrived while training went on
    finally:
        processes.kill_tree(process)
    # Training had started, so a bar would have been drawn by now: none in either pipe (tqdm draws on stderr).
    # What the pipes still hold, read to their end under the deadline like every read from a child here.
    piped = "".join(line for stream in (process.stdout, process.stderr)
                    for line in iter(lambda: processes.read_line(stream, deadline), ""))
    assert "update/s" not in piped and "s/update" not in piped and "\r" not in piped, piped[-2000:]


def test_graphcores_resnet50_line_validates_a_bounded_number_of_generated_images(tmp_path):
    # Graphcore's application's own test line, as written: 10 updates of one image, then validation of the run.
    out = run(tmp_path, "train.py", "--generated-data", "--dataset", "ImageNet", "--model-size", "50",
              "--micro-batch-size", "1", "--iterations", "10", "--device-iterations", "10")
    assert "Validating 10 of the 50000 generated images per checkpoint (as many as the run trained on)" in out
    import csv

    with open(tmp_path / run_folder(out) / "validation.csv") as f:
        assert [int(row["val_size"]) for row in csv.DictReader(f)] == [10]


def test_graphcores_restore_test_as_written(tmp_path):
    out = run(tmp_path, "train.py", *QUICK, "--iterations", "10", "--device-iterations", "10")
    assert "Saved initial checkpoint to" in out and "ckpt" in out
    restored = run(tmp_path, "restore.py", "--restore-path", str(tmp_path / run_folder(out)))
    assert "Restoring training from latest checkpoint:" in restored


def test_fp_exceptions_names_the_iteration_and_the_first_parameter_that_is_not_finite():
    import pytest
    import torch
    from torch import nn

    from cnns.engine.step import NonFiniteError, TrainStep, cross_entropy_loss
    from cnns.optim import HalfPrecisionOptimiser, OptimiserSpec, build_optimiser, parameter_groups
    from cnns.precision import LossScaler, PrecisionPolicy

    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 8), nn.ReLU(), nn.Linear(8, 3))
    model[3].bias.register_hook(lambda grad: grad * float("nan"))  # the loss stays finite
    optimiser = HalfPrecisionOptimiser(parameter_groups(model, 0.0),
                                       lambda groups: build_optimiser(groups, OptimiserSpec("SGD", lr=0.1)),
                                       stochastic_rounding=False, seed=0)
    policy = PrecisionPolicy.resolve("32.32", "bfloat16", torch.device("cpu"))
    step = TrainStep(model, optimiser, policy, LossScaler(1.0, dynamic=False), cross_entropy_loss(0.0), 1,
                     accumulate_in_float32=True, fp_exceptions=True)
    batch = [(torch.randn(4, 3, 2, 2), torch.tensor([0, 1, 2, 0]))]
    with pytest.raises(NonFiniteError, match=r"the gradient of 3\.bias is NaN or Inf"):
        step(batch, 0.1)


def test_fp_exceptions_in_a_run_is_one_line_with_the_iteration(tmp_path, capfd):
    out = scripts.run_here(capfd, "train.py", *QUICK, "--iterations", "5", "--precision", "32.32",
                           "--abs-learning-rate", "1e30", "--fp-exceptions", "--no-validation", cwd=tmp_path,
                           expect=None)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "error: floating-point exception at iteration 2: the loss is NaN or Inf (--fp-exceptions)"], out.stderr
