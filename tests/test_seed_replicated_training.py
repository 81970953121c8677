"""Graphcore's own replicated-training test (TestReplicatedTraining: `--replicas 2`, the stepped schedule, 20 epochs,
training accuracy above 85 %), run as written on real images (scikit-learn's digits as CIFAR-10 binaries), in the
default precision of each CPU kind (issue 70).

The default precision depends on the CPU (`cnns.precision.cpu_half_is_emulated`): 16.16 in bfloat16 where the CPU
has bfloat16 arithmetic (AVX512-BF16 or AMX), float32 where bfloat16 would only be emulated. The emulated kind is
simulated on every CPU, the native kind runs where the hardware is (tests/cpu_kinds.py).

Before the fix of the 16.16 replicas' all-reduce (tests/test_precision_parallel.py says what it was), the native
kind's run ended at 80.1 % training accuracy (46.7 % validation); after it, 98.4 %.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from cpu_kinds import simulate_emulated_bfloat16, skip_unless_native
from digit_records import held_out_accuracy, write_digits_cifar10
from scripts import train_here

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

SEED_COMMAND = ("--replicas", "2", "--lr-schedule", "stepped", "--learning-rate-decay", "0.5",
                "--learning-rate-schedule", "0.5,0.9", "--epochs", "20")


def last_training_accuracy(run: Path) -> float:
    with open(run / "training.csv", newline="") as rows:
        return float(list(csv.DictReader(rows))[-1]["train_acc_avg"])


@pytest.mark.parametrize("cpu_kind", ["bfloat16 native", "bfloat16 emulated"])
def test_graphcores_replicated_training_reaches_85_percent(cpu_kind, tmp_path, monkeypatch):
    if cpu_kind == "bfloat16 native":
        skip_unless_native()
    else:
        simulate_emulated_bfloat16(tmp_path / "probes", monkeypatch)
    digits = write_digits_cifar10(tmp_path / "digits")
    run = tmp_path / "run"
    train_here(*SEED_COMMAND, "--data-dir", str(digits), "--logs-path", str(run), "--seed", "1", "--ckpts-per-epoch", "0",
               cwd=tmp_path)
    assert '"replicas": 2' in (run / "arguments.json").read_text()
    # the precision the header says ran is the kind's default (cnns.precision: the note of the float32 fallback)
    emulated_note = "would be emulated, slower than float32; running in float32"
    assert (emulated_note in (run / "log.txt").read_text()) == (cpu_kind == "bfloat16 emulated")
    accuracy = last_training_accuracy(run)
    assert accuracy > 85.0, f"{cpu_kind}: the last training accuracy {accuracy} % is not above Graphcore's 85 %"
    # Graphcore's bar alone let the broken all-reduce through (85.9 % training accuracy, 70.4 % held out): the
    # held-out 297 digits are held to 32.32's one-process accuracy (98.65 %, docs/performance.md) less 8 points, far
    # beyond its spread over seeds (standard deviation 2.3 points on a smaller recipe) and far above the 46.7-70.4 %
    # of the broken runs
    held_out = held_out_accuracy(run)
    assert held_out > 90.0, f"{cpu_kind}: {held_out} % of the held-out digits, where one 32.32 process gets 98.65 %"
