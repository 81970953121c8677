"""Interrupts and restore.py: a run stopped by SIGTERM and continued ends bitwise where an uninterrupted one does."""

from __future__ import annotations

import csv
import os
import re
import signal
import subprocess
import sys
import threading
import time
from fractions import Fraction
from pathlib import Path

import pytest

import processes
import scripts
from model_kinds import MODELS, TIMM_BATCH_NORM
import torch

from cnns.cli import run_script as run_command
from cnns.engine.cadence import Every, RunLength
from cnns.engine.loop import StopRequest, TrainingLoop
from cnns.engine.step import StepMetrics
from cnns.runfolder.log import RunLog
from cnns.lr_schedules import ScheduleSpec

TRAIN_IMAGES = 640


@pytest.fixture(scope="module")
def data_dir(shapes_cifar10) -> Path:
    return shapes_cifar10("restore", train=TRAIN_IMAGES, test=32, seed=8)


def script(name: str, *args: str) -> list[str]:
    """The root script's command line for a child, where the test signals or kills the process."""
    return [sys.executable, str(scripts.ROOT / name), *args]


def logged_iterations(folder: Path) -> list[int]:
    path = folder / "training.csv"
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return [int(row["iteration"]) for row in csv.DictReader(f) if row.get("total_time")]


def interrupt_after(command: list[str], folder: Path, iteration: int, cwd: Path) -> subprocess.CompletedProcess:
    """Start training, send SIGTERM once training.csv shows `iteration`, and wait for its exit: 143, 128 + SIGTERM
    (SPEC §8), after the checkpoint, so a scheduler sees a run that did not finish."""
    process = processes.start(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd)
    deadline = time.monotonic() + 120
    while process.poll() is None and time.monotonic() < deadline:
        if any(it >= iteration for it in logged_iterations(folder)):
            process.send_signal(signal.SIGTERM)
            break
        time.sleep(0.005)
    stdout, stderr = processes.communicate(process, timeout=120)  # kills the run and fails on expiry
    assert process.returncode == 128 + signal.SIGTERM, stdout[-3000:] + stderr[-3000:]
    assert stderr == "", stderr[-3000:]
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def flatten(value, prefix: str = ""):
    """(path, leaf) pairs of a nested checkpoint, for an entry-by-entry comparison."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from flatten(item, f"{prefix}/{key}")
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from flatten(item, f"{prefix}/{index}")
    else:
        yield prefix, value


def assert_identical_checkpoints(a: Path, b: Path) -> None:
    left = dict(flatten(torch.load(a, weights_only=True)))
    right = dict(flatten(torch.load(b, weights_only=True)))
    assert left.keys() == right.keys()
    different = [key for key in left if not (
        torch.equal(left[key], right[key]) if torch.is_tensor(left[key]) else left[key] == right[key])]
    assert not different, different[:10]


@pytest.mark.parametrize("model, precision, optimiser, extra, per_epoch", [
    ("resnet-8", "32.32", "momentum", ["--micro-batch-size", "16", "--epochs", "2"], 40),
    # 16.16: stochastic rounding, accumulation, mixup and the moving average all carry random or running state.
    # --half-dtype bfloat16: real bfloat16 weights even on a CPU that only emulates it.
    ("resnet-8", "16.16", "momentum", ["--half-dtype", "bfloat16", "--micro-batch-size", "16",
                                       "--gradient-accumulation-count", "2", "--epochs", "3", "--ema-decay", "0.9",
                                       "--mixup-alpha", "0.2"], 20),
    # Each optimiser added to the registry: its state (and the update's stochastic rounding) continued, in one epoch.
    ("resnet-8", "16.16", "AdamW", ["--half-dtype", "bfloat16", "--micro-batch-size", "16", "--epochs", "1"], 40),
    ("resnet-8", "16.16", "LAMB", ["--half-dtype", "bfloat16", "--micro-batch-size", "16", "--epochs", "1"], 40),
    # A timm model by its timm name (tests/model_kinds.py): timm's norm + activation layers and their running
    # statistics, in 16.16 with accumulation and the moving average, in one epoch.
    (TIMM_BATCH_NORM, "16.16", "momentum", ["--half-dtype", "bfloat16", "--micro-batch-size", "16",
                                            "--gradient-accumulation-count", "2", "--epochs", "1", "--ema-decay",
                                            "0.9"], 20),
], ids=lambda value: value if isinstance(value, str) else None)
def test_sigterm_mid_epoch_then_restore_ends_bitwise_like_an_uninterrupted_run(data_dir, tmp_path, capfd, model,
                                                                              precision, optimiser, extra, per_epoch):
    total = per_epoch * int(extra[extra.index("--epochs") + 1])
    options = ["--dataset", "cifar-10", "--data-dir", str(data_dir), *MODELS[model], "--precision", precision,
               "--seed", "11", "--optimiser", optimiser, "--warmup-epochs", "1", "--device-iterations", "1",
               "--logs-per-epoch", str(per_epoch), "--ckpts-per-epoch", "1", "--no-validation", *extra]
    whole, parted = tmp_path / "whole", tmp_path / "parted"
    scripts.train_here(*options, "--logs-path", str(whole))

    out = interrupt_after(script("train.py", *options, "--logs-path", str(parted)), parted, 3, cwd=tmp_path)
    match = re.search(r"Training interrupted by SIGTERM at iteration (\d+); checkpoint saved", out.stdout)
    assert match, out.stdout[-2000:]
    stopped = int(match.group(1))
    assert 3 <= stopped < total and stopped % per_epoch != 0  # in the middle of an epoch
    assert (parted / f"ckpt-{stopped}.pt").is_file() and not (parted / "validation.csv").exists()
    arguments = (parted / "arguments.json").read_bytes()
    first = (parted / "ckpt-0.pt").stat().st_mtime_ns

    restored = scripts.run_here(capfd, "restore.py", "--restore-path", str(parted), cwd=tmp_path)
    assert f"Restoring training from latest checkpoint: {parted / f'ckpt-{stopped}.pt'}" in restored.stdout
    assert " Saving to" not in restored.stdout
    assert (parted / "arguments.json").read_bytes() == arguments
    assert (parted / "ckpt-0.pt").stat().st_mtime_ns == first  # the initial checkpoint is not written again
    iterations = logged_iterations(parted)
    assert iterations == sorted(set(iterations)) and iterations[-1] == total  # rows continue, appended
    assert iterations == logged_iterations(whole)

    assert_identical_checkpoints(whole / f"ckpt-{total}.pt", parted / f"ckpt-{total}.pt")
    model = torch.load(parted / f"ckpt-{total}.pt", weights_only=True)["model"]
    assert any(t.dtype == (torch.bfloat16 if precision == "16.16" else torch.float32) for t in model.values())


def test_restoring_a_finished_run_trains_nothing_more(data_dir, tmp_path, capsys):
    folder = tmp_path / "run"
    scripts.train_here("--dataset", "cifar-10", "--data-dir", str(data_dir), "--model-size", "8", "--iterations", "2",
                       "--micro-batch-size", "16", "--no-validation", "--logs-path", str(folder))
    before = {p.name: p.stat().st_mtime_ns for p in folder.glob("ckpt-*.pt")}
    assert run_command("restore", ["--restore-path", str(folder)]) == 0
    assert "Training already complete at iteration 2." in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in folder.glob("ckpt-*.pt")} == before


def test_a_checkpoint_written_on_gpus_restores_validates_and_predicts_on_a_cpu(data_dir, tmp_path, capsys):
    """A 16.16 run's checkpoint with its random-state section as a 2-GPU CUDA run writes it: torch's
    CUDA streams (one Philox state of 16 bytes per GPU) and the stochastic-rounding generator on the GPU."""
    from cnns.runfolder.checkpoint import load_checkpoint, save_checkpoint
    from cnns.cli.inference import predict_main

    folder = tmp_path / "run"
    scripts.train_here("--dataset", "cifar-10", "--data-dir", str(data_dir), "--model-size", "8", "--iterations", "2",
                       "--micro-batch-size", "16", "--no-validation", "--ckpts-per-epoch", "0", "--seed", "3",
                       "--logs-path", str(folder))
    state = load_checkpoint(folder / "ckpt-2.pt")
    philox = torch.arange(16, dtype=torch.uint8)  # what torch.cuda.get_rng_state() returns: seed and offset
    state["rng"]["cuda"] = [philox, philox + 1]
    state["optimiser"]["rounding_generator"] = philox + 2
    save_checkpoint(folder / "ckpt-2.pt", state)
    options = (folder / "arguments.json").read_text().replace('"iterations": 2', '"iterations": 4')
    (folder / "arguments.json").write_text(options)
    capsys.readouterr()
    assert run_command("restore", ["--restore-path", str(folder)]) == 0
    out = capsys.readouterr().out
    assert out.count("notice: the stochastic-rounding stream was written on another kind of device") == 1
    assert (folder / "ckpt-4.pt").is_file()
    assert run_command("validate", ["--restore-path", str(folder / "ckpt-2.pt")]) == 0
    from PIL import Image

    Image.new("RGB", (32, 32), (200, 30, 30)).save(tmp_path / "red.png")
    assert predict_main(["--restore-path", str(folder / "ckpt-2.pt"), str(tmp_path / "red.png")]) == 0


def test_a_run_killed_with_sigkill_and_restored_logs_each_iteration_once(data_dir, tmp_path, capfd):
    """SIGKILL leaves no checkpoint at the last logged iteration: the restored run starts again from the newest
    checkpoint, and the rows logged past it are set apart in training.abandoned.csv, not repeated."""
    folder = tmp_path / "run"
    # 320 images (50 %) in micro-batches of 16: 20 updates an epoch, checkpoints at 0, 20 and 30 (the last).
    options = ["--dataset", "cifar-10", "--data-dir", str(data_dir), "--model-size", "8", "--micro-batch-size", "16",
               "--dataset-percentage-to-use", "50", "--iterations", "30", "--log-freq", "1", "--ckpts-per-epoch", "1",
               "--seed", "5", "--no-validation", "--logs-path", str(folder)]
    process = processes.start(script("train.py", *options), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 180
    while process.poll() is None and time.monotonic() < deadline:
        if (folder / "ckpt-20.pt").is_file() and max(logged_iterations(folder), default=0) >= 23:
            break
        time.sleep(0.005)
    alive = process.poll() is None
    processes.kill_tree(process)  # SIGKILL, to it and anything it started
    assert alive, f"the run ended (exit {process.returncode}) before it could be killed: {process.stderr.read()[-2000:]}"
    newest = max(int(path.stem.split("-")[1]) for path in folder.glob("ckpt-*.pt"))
    killed = lines_of(folder / "training.csv")
    header, rows = killed[0], killed[1:]
    kept = [row for row in rows if int(row.split(",")[1]) <= newest]
    past = rows[len(kept):]
    assert newest == 20 and past, f"killed at iteration {logged_iterations(folder)[-1]} with checkpoint {newest}: " \
                                  "the test needs rows past the checkpoint"

    restored = scripts.run_here(capfd, "restore.py", "--restore-path", str(folder), cwd=tmp_path)
    assert (f"notice: training.csv held {len(past)} row{'s' if len(past) > 1 else ''} past iteration 20, the "
            "checkpoint this run continues from: moved to training.abandoned.csv") in restored.stdout
    iterations = logged_iterations(folder)
    assert iterations == list(range(1, 31))  # each once, in order: what training.png draws
    after = lines_of(folder / "training.csv")
    assert after[:1 + len(kept)] == [header, *kept]  # the rows up to the checkpoint are the killed run's own
    aside = lines_of(folder / "training.abandoned.csv")
    assert aside == [header, *past]
    assert (folder / "training.png").is_file() and (folder / "ckpt-30.pt").is_file()


def lines_of(path: Path) -> list[str]:
    """A CSV file's lines with their own endings (the csv module ends rows with \\r\\n)."""
    with open(path, newline="") as f:
        return f.readlines()


def write_rows(folder: Path, iterations: list[int], validated: dict[str, int]) -> None:
    """training.csv and validation.csv as a run writes them."""
    log = RunLog(folder, quiet=True)
    for iteration in iterations:
        log.training_step({"step": iteration, "iteration": iteration, "epoch": iteration / 10, "lr": 0.1,
                           "loss_batch": 2.0, "loss_avg": 2.0, "train_acc_batch": 10.0, "train_acc_avg": 10.0,
                           "it_time": 0.01, "img_per_sec": 100.0, "total_time": iteration / 100})
    for name, iteration in validated.items():
        log.validation_result({"name": name, "iteration": iteration, "epoch": iteration / 10, "val_acc": 50.0,
                               "raw_acc": 50.0, "val_time": 1.0, "val_size": 10, "img_per_sec": 10.0, "latency": 1.0,
                               "val_top5": 90.0})


def test_continue_after_sets_apart_the_rows_past_the_checkpoint_and_a_row_cut_short(tmp_path):
    from cnns.runfolder.log import validated_names

    write_rows(tmp_path, [1, 2, 3, 4, 5, 6], {"ckpt-2": 2, "ckpt-6": 6})
    training = tmp_path / "training.csv"
    with open(training, "a") as f:
        f.write("7,7,0.7,0.1,2.0")  # a row the kill cut short
    lines = lines_of(training)

    notices = RunLog(tmp_path, quiet=True).continue_after(4)
    assert notices == [
        "training.csv held 3 rows past iteration 4, the checkpoint this run continues from: moved to "
        "training.abandoned.csv, so that training.csv logs each iteration once",
        "validation.csv held 1 row past iteration 4, the checkpoint this run continues from: moved to "
        "validation.abandoned.csv, so that validation.csv logs each iteration once"]
    assert "".join(lines_of(training)) == "".join(lines[:5])  # header and iterations 1-4, as they were
    assert "".join(lines_of(tmp_path / "training.abandoned.csv")) == "".join([lines[0], *lines[5:7]]) + \
        "7,7,0.7,0.1,2.0\n"
    assert validated_names(tmp_path) == {"ckpt-2"}  # ckpt-6 is written again, and validated again

    # The continued run is killed too, and continued from iteration 2: set apart after the first ones.
    write_rows(tmp_path, [5], {})
    assert len(RunLog(tmp_path, quiet=True).continue_after(2)) == 1  # validation.csv holds nothing past 2
    assert logged_iterations(tmp_path) == [1, 2]
    with open(tmp_path / "training.abandoned.csv", newline="") as f:
        assert [row["iteration"] for row in csv.DictReader(f)] == ["5", "6", "7", "3", "4", "5"]

    # Nothing past the checkpoint: the files are left as they are.
    before = {path.name: path.read_bytes() for path in tmp_path.iterdir()}
    assert RunLog(tmp_path, quiet=True).continue_after(2) == []
    assert {path.name: path.read_bytes() for path in tmp_path.iterdir()} == before


class CountingSource:
    """Micro-batches whose label is their global position, so the test can see the data order."""

    num_samples = 16

    def __len__(self) -> int:
        return 8

    def epoch(self, epoch: int, start_batch: int = 0):
        for batch in range(start_batch, 8):
            yield torch.zeros(2, 1), torch.tensor([epoch * 8 + batch])


def counting_loop(seen: list, saved: list, start: int, signal_at: int | None = None) -> TrainingLoop:
    def step(micro, lr):
        seen.append(tuple(int(labels) for _, labels in micro))
        if len(seen) == signal_at:
            os.kill(os.getpid(), signal.SIGTERM)  # a real signal, in the middle of the run
        return StepMetrics(torch.tensor(1.0), torch.tensor(1), 2)

    length = RunLength(total_iterations=10, iterations_per_epoch=4, epochs=2.5, device_iterations=4,
                       lines=Every(Fraction(5)), checkpoints=Every(Fraction(4)))
    return TrainingLoop(step, lambda batches: batches, CountingSource(), ScheduleSpec("cosine", 0.1, 10), length,
                        grad_accum=2, global_batch_size=4, num_train_samples=16, log=RunLog(None, quiet=True),
                        save_checkpoint=saved.append, start_iteration=start)


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals need the main thread")
def test_a_signal_finishes_the_update_checkpoints_and_the_restart_sees_the_same_data():
    whole, whole_saved = [], []
    counting_loop(whole, whole_saved, 0).run(StopRequest())
    assert whole_saved == [4, 8, 10]  # every 4 updates (the loop meets the host there too) and at the end

    seen, saved = [], []
    stop = StopRequest()
    with stop.installed():
        result = counting_loop(seen, saved, 0, signal_at=3).run(stop)
    assert (result.interrupted_by, result.final_iteration, saved) == ("SIGTERM", 3, [3])
    counting_loop(seen, saved, 3).run(StopRequest())
    assert seen == whole  # the same micro-batches, in the same order
    assert saved == [3, 4, 8, 10]  # the restarted loop keeps the checkpoints of the whole run
    assert signal.getsignal(signal.SIGTERM) != stop._handle


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals need the main thread")
def test_a_second_signal_stops_at_once():
    stop = StopRequest()
    with stop.installed():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)
        assert stop.signal_name == "SIGINT"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)
