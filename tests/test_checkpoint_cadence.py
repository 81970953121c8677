"""Where step lines, checkpoints and the host's synchronisations fall: real tiny runs read back (training.csv's
iteration column, the checkpoints' names, the updates each read-back brings) and compared with the rule's closed
form, as this file states it from the rule's words (`cnns.config.table.CADENCE_RULE`), not from the code under test;
the defaults of CIFAR-10 and ImageNet computed, not trained; and the rule said in the same words by --help and
docs/outputs.md.

The closed form, U the updates per epoch (training images // global batch), D the device iterations:
- a cadence of s updates is the updates floor(k * s), k = 1, 2, ...: s = F for --log-freq F, s = U / N for
  --logs-per-epoch N and --ckpts-per-epoch N;
- lines: the cadence and the run's last update;
- the syncs: the multiples of D, the multiples of U (epochs' ends), the lines and the checkpoints;
- checkpoints: 0 and the run's last update (0 not with --ckpts-per-epoch 0), and from the offset on the cadence
  where s >= D; where s < D, for each asked update the first of the other syncs at or after it.
"""

from __future__ import annotations

import csv
import math
import re
from fractions import Fraction
from pathlib import Path

import pytest

import scripts
from cnns.cli import run_script as run_command
from cnns.config import RunConfig, resolve
from cnns.config.table import CADENCE_RULE, option_defaults
from cnns.engine.cadence import RunLength

ROOT = Path(__file__).resolve().parents[1]


def cadence(s: Fraction, total: int) -> set[int]:
    """The updates floor(k * s), k = 1, 2, ..., up to the run's last."""
    if s <= 1:  # consecutive floors differ by at most one: every update
        return set(range(1, total + 1))
    return {math.floor(k * s) for k in range(1, math.floor(total / s) + 1)}


def closed_form(total: int, per_epoch: int, device_iterations: int, line_every: Fraction | None,
                ckpt_every: Fraction | None, offset: int = 0) -> tuple[list[int], list[int], list[int]]:
    """(lines, checkpoints, syncs) as the rule states them."""
    lines = (cadence(line_every, total) if line_every else set()) | {total}
    others = {p for p in range(1, total + 1) if p % device_iterations == 0 or p % per_epoch == 0} | lines
    if ckpt_every is None:
        ckpts = {total}
    elif ckpt_every >= device_iterations:
        ckpts = {0, total} | {p for p in cadence(ckpt_every, total) if p >= offset}
    else:
        ckpts = {0, total} | {min(q for q in others if q >= p) for p in cadence(ckpt_every, total) if p >= offset}
    return sorted(lines), sorted(ckpts), sorted(others | ckpts - {0})


def ratio(text: str) -> Fraction:
    return Fraction(text)  # the decimal as typed, exactly


# (training images, micro-batch, accumulation, length, cadence options, device iterations, ckpts per epoch (or
# epochs per ckpt), offset in epochs); `length` is ("iterations", n, log-freq) or ("epochs", E, logs per epoch).
RUNS = {
    # The issue's example on real data: every 10 of 40, host syncs every 3 and at each line.
    "log-freq 10, D 3": (48, 4, 1, ("iterations", 40, "10"), "3", ("ckpts", "4"), "0"),
    "ckpts 4 a 12-update epoch, D 1": (48, 4, 1, ("iterations", 10, "3"), "1", ("ckpts", "4"), "0"),
    "ckpts 4 from half an epoch": (48, 4, 1, ("iterations", 10, "10"), "1", ("ckpts", "4"), "0.5"),
    "epochs per ckpt 0.5": (48, 4, 1, ("iterations", 10, "10"), "1", ("epochs", "0.5"), "0"),
    "only the last": (48, 4, 1, ("iterations", 10, "10"), "1", ("ckpts", "0"), "0"),
    "ckpts 5: floor(k x 2.4)": (48, 4, 1, ("iterations", 10, "10"), "2", ("ckpts", "5"), "0"),
    "ckpts 4, D 1000: at the next sync": (48, 4, 1, ("iterations", 10, "10"), "1000", ("ckpts", "4"), "0"),
    # Graphcore's application's own test: a million an epoch, every 2 updates on the host: 0, 2, 4.
    "the seed's 0, 2, 4": (48, 4, 1, ("iterations", 4, "500"), "2", ("ckpts", "1000000"), "0"),
    # --epochs: 10 updates an epoch (40 // 4), three lines an epoch at floor(k x 10/3), 2 checkpoints exactly.
    "epochs, 3 lines an epoch": (40, 4, 1, ("epochs", "2", "3"), "4", ("ckpts", "2"), "0"),
    # Accumulation 2: 6 updates an epoch; 2.5 checkpoints an epoch (every 2.4 updates) under D 5: the next syncs.
    "epochs, accumulation, 0.4 epochs per ckpt": (48, 4, 2, ("epochs", "2", "4"), "5", ("epochs", "0.4"), "0"),
}


@pytest.fixture(scope="module")
def data(shapes_cifar10) -> dict[int, Path]:
    return {n: shapes_cifar10(f"cadence{n}", train=n, test=8, seed=6) for n in (40, 48)}


@pytest.mark.parametrize("name", RUNS)
def test_the_checkpoints_are_exactly_those_asked(data, tmp_path, monkeypatch, name):
    from cnns.engine.loop import Outfeed

    images, micro, accumulation, length, device_iterations, (ckpt_kind, ckpt_value), offset = RUNS[name]
    syncs: list[int] = []
    drain = Outfeed.drain

    def counted(self):
        rows = drain(self)
        syncs.extend(row["iteration"] + 1 for row in rows[-1:])  # the update this read-back ends at
        return rows

    monkeypatch.setattr(Outfeed, "drain", counted)
    kind, amount, per = length
    cadence_options = ["--log-freq", per] if kind == "iterations" else ["--logs-per-epoch", per]
    ckpt_option = "--ckpts-per-epoch" if ckpt_kind == "ckpts" else "--epochs-per-ckpt"
    folder = tmp_path / "run"
    assert run_command("train", [
        "--dataset", "cifar-10", "--data-dir", str(data[images]), "--model-size", "8", "--precision", "32.32",
        "--micro-batch-size", str(micro), "--gradient-accumulation-count", str(accumulation),
        f"--{kind}", str(amount), *cadence_options, "--device-iterations", device_iterations,
        ckpt_option, ckpt_value, "--ckpt-epochs-offset", offset, "--no-validation", "--seed", "3",
        "--logs-path", str(folder)]) == 0

    per_epoch = images // (micro * accumulation)
    total = amount if kind == "iterations" else math.floor(images * ratio(amount) / (micro * accumulation))
    line_every = ratio(per) if kind == "iterations" else per_epoch / ratio(per)
    asked = ratio(ckpt_value) if ckpt_kind == "ckpts" else 1 / ratio(ckpt_value)
    ckpt_every = per_epoch / asked if asked else None
    lines, ckpts, expected_syncs = closed_form(total, per_epoch, int(device_iterations), line_every, ckpt_every,
                                               math.floor(ratio(offset) * per_epoch))
    with open(folder / "training.csv", newline="") as f:
        assert [int(row["iteration"]) for row in csv.DictReader(f)] == lines
    assert sorted(int(path.stem.split("-")[1]) for path in folder.glob("ckpt-*.pt")) == ckpts
    assert syncs == expected_syncs
    # The header says the cadence that ran, and no notice is left over from the rule this one replaced.
    log = (folder / "log.txt").read_text()
    assert f" Length: {total} updates, {per_epoch} per epoch;" in log
    assert "notice: --ckpts-per-epoch" not in log


def test_the_issue_example_writes_rows_at_10_20_30_40(tmp_path):
    """`--synthetic-data --iterations 40 --log-freq 10 --device-iterations 3`: rows at the multiples of 10."""
    folder = tmp_path / "run"
    assert run_command("train", ["--synthetic-data", "--dataset", "cifar-10", "--model-size", "8", "--micro-batch-size",
                                 "8", "--iterations", "40", "--log-freq", "10", "--device-iterations", "3",
                                 "--no-validation", "--logs-path", str(folder)]) == 0
    with open(folder / "training.csv", newline="") as f:
        assert [int(row["iteration"]) for row in csv.DictReader(f)] == list(range(10, 41, 10))


@pytest.mark.parametrize("dataset, images", [("cifar-10", 50_000), ("imagenet", 1_281_167)])
def test_the_default_cadence_of_cifar10_and_imagenet(dataset, images):
    """The defaults (16 step lines and one checkpoint an epoch, 1000 device iterations) over the first epoch and a
    little more, computed as the run computes them and compared with the closed form: exact fractions of the epoch,
    the checkpoint at the epoch's last update."""
    o = resolve({**option_defaults("train"), "dataset": dataset, "synthetic_data": True, "seed": 1})
    cfg = RunConfig.from_options(o)
    length = RunLength.resolve(cfg, images)
    per_epoch = images // o["global_batch_size"]
    assert length.iterations_per_epoch == per_epoch
    assert length.total_iterations == math.floor(images * Fraction(o["epochs"]) / o["global_batch_size"])
    span = per_epoch + per_epoch // 8  # the first epoch and an eighth of the next
    lines, ckpts, syncs = closed_form(span, per_epoch, o["device_iterations"],
                                      per_epoch / ratio(str(o["logs_per_epoch"])),
                                      per_epoch / ratio(str(o["ckpts_per_epoch"])))
    updates = range(1, span)  # before `span`, which the closed form takes as the run's last
    assert [p for p in updates if length.line_due(p)] == lines[:-1]
    assert [p for p in range(span) if length.checkpoint_due(p)] == ckpts[:-1]
    assert [p for p in updates if length.sync_due(p)] == syncs[:-1]
    assert per_epoch in ckpts  # one checkpoint an epoch, at its last update


def _words(text: str) -> str:
    return " ".join(text.replace("\n>", " ").split())


def test_help_and_docs_outputs_say_the_rule_in_the_same_words(capfd, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # argparse breaks no word at a hyphen
    help_text = scripts.run_here(capfd, "train.py", "--help").stdout
    assert _words(CADENCE_RULE) in _words(help_text)
    assert _words(CADENCE_RULE) in _words((ROOT / "docs" / "outputs.md").read_text())
    # The options' own help points to it, and says nothing of its own about where they fall.
    for flag in ("--ckpts-per-epoch", "--device-iterations"):
        entry = re.search(rf"^  {flag} \S+\s+(.*)$", help_text, re.MULTILINE)  # its help, on this line or the next
        assert entry and "the rule under Logging" in entry.group(1), flag
