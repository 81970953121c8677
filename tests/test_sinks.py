"""Every sink tells the story the CSV files tell: TensorBoard's events and W&B's rows are training.csv's and
validation.csv's rows at their iterations, for every command that takes the options, a run killed and continued
too; an optional sink or decode device that cannot work is one line before any run folder; and what the commands
write stays in the run folder (or the folder typed for that command).

W&B is an external service (and its package is not installed here): a small stand-in `wandb` module on the path
records each call to a JSON-lines file, as W&B's client would send them."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import processes
import scripts
from cnns.commands.checks import OPTIONAL_SINKS, SINK_FLAGS
from cnns.runfolder.log import TRAINED_SCALARS, WANDB_STEP, validation_series

# The commands whose run folder the sinks log (restore.py takes its run's own, and may leave them out); and those
# that accept the options (they share train.py's parser) but write no run folder, which refuse them.
LOGGING = {"train", "restore", "validate", "weight-avg"}
SINKS_OFF = ("--no-tensorboard", "--no-wandb")
REFUSING = {"infer": ("--model-size", "8", "--dataset", "cifar-10"), "splits": ("--model-size", "8", "--dataset", "cifar-10")}

FAKE_WANDB = '''\
"""A stand-in for the wandb client: each call, as JSON, a line of $FAKE_WANDB_CALLS."""
import json, os

def _record(call, **fields):
    with open(os.environ["FAKE_WANDB_CALLS"], "a") as f:
        f.write(json.dumps({"pid": os.getpid(), "call": call, **fields}) + "\\n")

class _Run:
    def define_metric(self, name, step_metric=None, **_):
        _record("define_metric", name=name, step_metric=step_metric)

    def log(self, data, step=None, commit=None):
        _record("log", data=data, step=step)

    def finish(self, *args, **kwargs):
        _record("finish")

def init(**kwargs):
    _record("init", **{key: kwargs.get(key) for key in ("name", "group", "job_type", "dir")},
            env={key: value for key, value in os.environ.items() if key.startswith("WANDB_")})
    return _Run()
'''


@pytest.fixture(scope="module")
def data_dir(shapes_cifar10) -> Path:
    return shapes_cifar10("sinks", train=320, test=32, seed=3)


@pytest.fixture
def fake_wandb(tmp_path, monkeypatch) -> Path:
    """The stand-in on this process's path (and $PYTHONPATH for a child); returns the file its calls go to."""
    folder = tmp_path / "fake_wandb"
    folder.mkdir()
    (folder / "wandb.py").write_text(FAKE_WANDB)
    calls = tmp_path / "wandb_calls.jsonl"
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    monkeypatch.setenv("FAKE_WANDB_CALLS", str(calls))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")])))
    return calls


def sink_accepting_commands() -> dict[str, set[str]]:
    """Each command whose parser takes one of the sink options, with those it takes (`cnns.cli.command_parsers`,
    so that a new command is caught)."""
    from cnns.cli import command_parsers

    found = {}
    for command, parser in command_parsers().items():
        flags = {flag for action in parser._actions for flag in action.option_strings} & {*SINK_FLAGS.values(),
                                                                                          *SINKS_OFF}
        if flags:
            found[command] = flags
    return found


def test_every_command_taking_a_sink_logs_a_run_folder_or_refuses_it(capfd, tmp_path):
    accepting = sink_accepting_commands()
    assert set(accepting) == LOGGING | set(REFUSING), "a new command takes a sink option: log it or refuse it"
    for command, options in REFUSING.items():
        for flag in sorted(accepting[command] - set(SINKS_OFF)):
            out = scripts.run_here(capfd, command, *options, flag, cwd=tmp_path, expect=2)
            assert out.stderr.count("\n") == 1 and flag in out.stderr and "nothing to log" in out.stderr, out.stderr
    # validation.py of a random model writes a run folder only with --logs-path
    out = scripts.run_here(capfd, "validation.py", "--generated-data", "--dataset", "cifar-10", "--model-size", "8",
                           "--tensorboard", cwd=tmp_path, expect=2)
    assert "--tensorboard: validation.py without --restore-path or --logs-path" in out.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_sink_or_decode_device_that_cannot_work_is_refused_before_any_folder(capfd, tmp_path, data_dir,
                                                                               monkeypatch):
    run = tmp_path / "run"
    scripts.train_here("--dataset", "cifar-10", "--data-dir", str(data_dir), "--model-size", "8", "--micro-batch-size",
                       "16", "--iterations", "1", "--no-validation", "--logs-path", str(run), cwd=tmp_path)
    before = sorted(path.name for path in run.iterdir())
    asked_in_the_run = run / "arguments.json"
    options = json.loads(asked_in_the_run.read_text())
    train = ("train.py", "--dataset", "cifar-10", "--data-dir", str(data_dir), "--model-size", "8", "--iterations",
             "1", "--log-dir", str(tmp_path / "logs"))
    for dest, (module, line) in OPTIONAL_SINKS.items():
        monkeypatch.setitem(sys.modules, module, None)  # as if not installed: importing it raises ImportError
        flag = SINK_FLAGS[dest]
        for command in (train, ("validation.py", "--restore-path", str(run), flag),
                        ("weight_avg.py", "--restore-path", str(run), flag),
                        ("validation.py", "--generated-data", "--dataset", "cifar-10", "--model-size", "8",
                         "--logs-path", str(tmp_path / "random"), flag)):
            argv = (*command, flag) if command is train else command
            out = scripts.run_here(capfd, *argv, cwd=tmp_path, expect=2)
            assert out.stderr == f"error: {line}\n", out.stderr
        asked_in_the_run.write_text(json.dumps({**options, dest: True}))  # restore.py takes the run's options
        out = scripts.run_here(capfd, "restore.py", "--restore-path", str(run), cwd=tmp_path, expect=2)
        assert out.stderr == f"error: {line}\n", out.stderr
        asked_in_the_run.write_text(json.dumps(options))
    out = scripts.run_here(capfd, *train, "--decode-device", "cuda", "--device", "cpu", cwd=tmp_path, expect=2)
    assert out.stderr == "error: --decode-device cuda needs a run on a CUDA GPU; this run is on cpu\n"
    assert not (tmp_path / "logs").exists() and not (tmp_path / "random").exists()
    assert sorted(path.name for path in run.iterdir()) == before  # nothing written, no lock left

    # A run's own sinks are left out where the package is missing: --no-wandb, --no-tensorboard.
    from cnns.cli.parsing import resolve_command_line

    asked_in_the_run.write_text(json.dumps({**options, **{dest: True for dest in OPTIONAL_SINKS}}))
    restored = resolve_command_line("restore", ["--restore-path", str(run), *SINKS_OFF]).config
    assert not restored.log.wandb and not restored.log.tensorboard
    scripts.run_here(capfd, "validation.py", "--restore-path", str(run), *SINKS_OFF, cwd=tmp_path)
    assert [row["name"] for row in csv_rows(run / "validation.csv")] == ["ckpt-0", "ckpt-1"]


@pytest.mark.slow
def test_sinks_hold_the_csv_rows_after_sigkill_and_restore_and_write_only_in_the_run_folder(
        capfd, tmp_path, data_dir, fake_wandb, monkeypatch):
    """train.py --tensorboard --wandb killed (SIGKILL) past its checkpoint at 20, restore.py (with a profiler trace
    its arguments.json sends to a folder elsewhere), then validation.py and weight_avg.py on the run: TensorBoard
    holds each training.csv and validation.csv row once, at its iteration, with its values (the killed run's
    events past the checkpoint purged); each command's W&B run holds the rows it logged, at their iterations; and
    with the working folder and HOME empty, nothing lands outside the run folder."""
    home, folder, elsewhere = tmp_path / "home", tmp_path / "run", tmp_path / "elsewhere"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    # The one write allowed outside: matplotlib's per-user font list, which its first use builds (the plot's).
    monkeypatch.setenv("MPLCONFIGDIR", str(tmp_path / "library-caches" / "matplotlib"))
    # 320 images in micro-batches of 16: 20 updates an epoch, checkpoints at 0, 20 and 30 (the last).
    options = ["--dataset", "cifar-10", "--data-dir", str(data_dir), "--model-size", "8", "--micro-batch-size", "16",
               "--iterations", "30", "--log-freq", "1", "--ckpts-per-epoch", "1", "--seed", "5", "--no-validation",
               "--logs-path", str(folder), "--tensorboard", "--wandb"]
    killed = kill_past_checkpoint(options, folder, home)
    arguments = folder / "arguments.json"  # as if it had been started with --profile --profile-dir elsewhere
    arguments.write_text(json.dumps({**json.loads(arguments.read_text()), "profile": True,
                                     "profile_dir": str(elsewhere)}))

    scripts.run_here(capfd, "restore.py", "--restore-path", str(folder), cwd=home)
    training = csv_rows(folder / "training.csv")
    assert [int(row["iteration"]) for row in training] == list(range(1, 31))
    scripts.run_here(capfd, "validation.py", "--restore-path", str(folder), cwd=home)  # the run's sinks
    scripts.run_here(capfd, "weight_avg.py", "--restore-path", str(folder), "-N", "2", "--tensorboard", "--wandb",
                     cwd=home)
    validation = csv_rows(folder / "validation.csv")
    assert [(row["name"], int(row["iteration"])) for row in validation] == [
        ("ckpt-0", 0), ("ckpt-20", 20), ("ckpt-30", 30), ("weight_avg_mean_last2", 30)]

    check_tensorboard(folder / "tensorboard", training, validation, killed)
    runs = wandb_runs(fake_wandb)
    assert [run["init"]["job_type"] for run in runs] == ["train", "restore", "validate", "weight-avg"]
    assert all(run["init"]["dir"] == str(folder) and run["init"]["group"] == folder.name for run in runs)
    assert all(run["init"]["env"]["WANDB_CACHE_DIR"] == str(folder / "wandb") for run in runs)
    logged = wandb_rows(runs[0], "train/")  # the killed run's, as it logged them (its last row's may be cut off)
    assert logged == csv_points(killed, training_scalars)[:len(logged)] and len(logged) >= len(killed) - 1
    assert wandb_rows(runs[1], "train/") == csv_points(training[20:], training_scalars)  # from the checkpoint on
    assert wandb_rows(runs[2], "validation") == csv_points(validation[:3], validation_scalars)
    assert wandb_rows(runs[3], "validation") == csv_points(validation[3:], validation_scalars)

    traces = list((folder / "profile").glob("*.pt.trace.json*"))
    assert len(traces) == 3, traces  # restore.py's training loop, validation.py's and weight_avg.py's validations
    assert not elsewhere.exists()
    assert sorted(str(path.relative_to(home)) for path in home.rglob("*")) == []


def kill_past_checkpoint(options: list[str], folder: Path, cwd: Path) -> list[dict[str, str]]:
    """train.py in a child, SIGKILLed once it has checkpointed iteration 20 and logged past 22; its training.csv
    rows as it left them (past the checkpoint too)."""
    process = processes.start([sys.executable, str(scripts.ROOT / "train.py"), *options], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 180
    while process.poll() is None and time.monotonic() < deadline:
        if (folder / "ckpt-20.pt").is_file() and len(csv_rows(folder / "training.csv")) >= 23:
            break
        time.sleep(0.005)
    alive = process.poll() is None
    processes.kill_tree(process)
    assert alive, f"the run ended (exit {process.returncode}) before it could be killed: {process.stderr.read()[-2000:]}"
    rows = csv_rows(folder / "training.csv")
    assert max(int(path.stem.split("-")[1]) for path in folder.glob("ckpt-*.pt")) == 20 and len(rows) > 20
    return rows


def csv_rows(path: Path) -> list[dict[str, str]]:
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return [row for row in csv.DictReader(f) if row.get("iteration") and row.get("img_per_sec")]


def training_scalars(row: dict[str, str]) -> dict[str, float]:
    return {f"train/{key}": float(row[key]) for key in TRAINED_SCALARS}


def validation_scalars(row: dict[str, str]) -> dict[str, float]:
    series = validation_series(row["name"])
    return {f"{series}/top1": float(row["val_acc"]), f"{series}/top5": float(row["val_top5"])}


def csv_points(rows: list[dict[str, str]], scalars) -> list[tuple[int, dict[str, float]]]:
    return [(int(row["iteration"]), scalars(row)) for row in rows]


def check_tensorboard(logdir: Path, training: list[dict], validation: list[dict], killed: list[dict]) -> None:
    """TensorBoard's reading of the event files (EventAccumulator) has every tag's points exactly at the CSV rows'
    iterations, once each, with their values (float32); the killed run had written past its checkpoint, and the
    continued run's file starts by purging those steps (purge_step)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    accumulator = EventAccumulator(str(logdir))
    accumulator.Reload()
    expected: dict[str, list[tuple[int, float]]] = {}
    for iteration, scalars in csv_points(training, training_scalars) + csv_points(validation, validation_scalars):
        for tag, value in scalars.items():
            expected.setdefault(tag, []).append((iteration, value))
    assert sorted(accumulator.Tags()["scalars"]) == sorted(expected)
    for tag, points in expected.items():
        got = [(event.step, event.value) for event in accumulator.Scalars(tag)]
        assert [step for step, _ in got] == [step for step, _ in points], tag
        assert all(math.isclose(a, b, rel_tol=2 ** -23, abs_tol=1e-30) for (_, a), (_, b) in zip(got, points)), tag
    files = sorted(logdir.iterdir(), key=lambda path: path.stat().st_mtime_ns)
    first = [event.step for event in EventFileLoader(str(files[0])).Load() if event.HasField("summary")]
    assert 20 < max(first) <= int(killed[-1]["iteration"])  # killed past its checkpoint (its last row cut off, maybe)
    restored = list(EventFileLoader(str(files[1])).Load())
    starts = [event.step for event in restored if event.HasField("session_log") and event.session_log.status == 1]
    assert starts == [21]  # SessionLog.START at the first step the continued run logs: TensorBoard drops later ones


def wandb_runs(calls: Path) -> list[dict]:
    """The stand-in's calls, a run per wandb.init (each ends at the next init)."""
    runs = []
    for line in calls.read_text().splitlines():
        call = json.loads(line)
        if call["call"] == "init":
            runs.append({"init": call, "calls": []})
        else:
            runs[-1]["calls"].append(call)
    return runs


def wandb_rows(run: dict, prefix: str) -> list[tuple[int, dict[str, float]]]:
    """The rows a W&B run logged under `prefix`, each at the value of its x axis, which every chart of the run is
    declared to use (define_metric's step_metric); never with W&B's own step, which refuses one that goes back."""
    declared = {call["name"]: call["step_metric"] for call in run["calls"] if call["call"] == "define_metric"}
    rows = []
    for call in run["calls"]:
        if call["call"] != "log" or not any(key.startswith(prefix) for key in call["data"]):
            continue
        assert call["step"] is None
        data = dict(call["data"])
        iteration = data.pop(WANDB_STEP)
        for key in data:
            assert any(key.startswith(glob.rstrip("*")) and step == WANDB_STEP
                       for glob, step in declared.items() if glob.endswith("*")), key
        rows.append((iteration, data))
    return rows
