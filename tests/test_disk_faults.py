"""Every write survives a failing disk (SQLite's I/O-error tests are the model): each write site in turn gets a
fault at the lowest write primitive (`os.write`, `os.fsync`, `os.replace`, which `cnns.safe_writes` alone calls), and
the run folder is then checked: one line naming the file and the cause, exit 2, no temporary or partial file,
every checkpoint readable, every CSV row once and in order, and restore.py continuing to the same final weights
as an uninterrupted run. Then a real full filesystem (a tiny tmpfs), where the machine lets the test mount one."""

from __future__ import annotations

import csv
import errno
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import processes
import scripts
from faults import DiskFault

from cnns.errors import CheckpointError, WriteError
from cnns.runfolder.checkpoint import list_checkpoints, load_checkpoint, save_checkpoint
from cnns.safe_writes import append, write_atomically
from cnns.runfolder.log import set_apart_rows_after

ITERATIONS = 8  # 64 images in micro-batches of 16: 4 updates an epoch, checkpoints at 0, 4 and 8


@pytest.fixture(scope="module")
def data_dir(shapes_cifar10) -> Path:
    return shapes_cifar10("disk-faults", train=64, test=32, seed=8)


def options(data_dir: Path, folder: Path) -> list[str]:
    return ["--dataset", "cifar-10", "--data-dir", str(data_dir), "--model-size", "8", "--micro-batch-size", "16",
            "--iterations", str(ITERATIONS), "--log-freq", "1", "--ckpts-per-epoch", "1", "--seed", "5",
            "--optimiser", "momentum", "--logs-path", str(folder)]


@pytest.fixture(scope="module")
def reference(data_dir, tmp_path_factory) -> Path:
    """The uninterrupted run, and validation.py after it (which validates the initial checkpoint too, as the
    recovery below runs it)."""
    from cnns.cli import run_script

    folder = tmp_path_factory.mktemp("reference") / "run"
    scripts.train_here(*options(data_dir, folder))
    with scripts._torch_state_kept():
        assert run_script("validate", ["--restore-path", str(folder)]) == 0
    return folder


# cnns.safe_writes' temporary names: .ckpt-4.pt.<pid>.<token>.tmp (or .onnx, .pt2 where a library wants that suffix).
TEMPORARY = re.compile(r"\.(.+)\.\d+\.[0-9a-f]{8}\.\w+")


def final_name(path: Path) -> str:
    """The name a file written under a temporary name gets: ckpt-4.pt for .ckpt-4.pt.<pid>.<token>.tmp."""
    temporary = TEMPORARY.fullmatch(path.name)
    return temporary.group(1) if temporary else path.name


# ----------------------------------------------------------------------------------------------
# The run folder's invariants


def assert_run_folder_whole(folder: Path) -> None:
    """No temporary file; every checkpoint readable; every CSV row whole, once, and in order."""
    assert not [p.name for p in folder.iterdir() if TEMPORARY.fullmatch(p.name)], sorted(os.listdir(folder))
    for _, path in list_checkpoints(folder):
        load_checkpoint(path)  # a CheckpointError fails the test
    training = csv_rows(folder / "training.csv")
    iterations = [int(row["iteration"]) for row in training]
    assert iterations == sorted(set(iterations))
    validated = [row["name"] for row in csv_rows(folder / "validation.csv")]
    assert len(validated) == len(set(validated)), validated


def csv_rows(path: Path) -> list[dict[str, str]]:
    """The rows of a CSV file, each checked whole (a row cut short by a failed write would lack its last column)."""
    if not path.exists():
        return []
    text = path.read_text()
    assert not text or text.endswith("\n"), f"{path.name} ends in a row cut short: {text[-80:]!r}"
    rows = list(csv.DictReader(text.splitlines()))
    assert all(None not in row.values() and None not in row for row in rows), f"{path.name}: a row is not whole"
    return rows


def training_rows(folder: Path) -> list[tuple[str, ...]]:
    return [(row["iteration"], row["lr"], row["loss_batch"], row["train_acc_batch"])
            for row in csv_rows(folder / "training.csv")]


def validation_rows(folder: Path) -> set[tuple[str, ...]]:
    return {(row["name"], row["iteration"], row["val_acc"]) for row in csv_rows(folder / "validation.csv")}


def assert_same_state(a: Path, b: Path) -> None:
    left, right = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    for key in ("model", "optimiser"):
        assert left[key].keys() == right[key].keys()
    assert all(torch.equal(tensor, right["model"][name]) for name, tensor in left["model"].items())
    assert left["iteration"] == right["iteration"]


def assert_one_error_line(out: subprocess.CompletedProcess, path: Path, cause: str) -> None:
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert re.fullmatch(rf"error: cannot write (checkpoint )?{re.escape(str(path))}: {re.escape(cause)}(;.*)?", last), last


# ----------------------------------------------------------------------------------------------
# A fault at each write site of a training run, then restore.py and validation.py


@pytest.mark.parametrize("name, operation, n, error", [
    ("log.txt", "write", 12, errno.ENOSPC),  # a printed line in the middle of training
    ("training.csv", "write", 1, errno.EDQUOT),  # the header and the first row, in a file the append creates
    ("training.csv", "write", 6, errno.ENOSPC),  # a row past the checkpoint at 4
    ("ckpt-4.pt", "write", 20, errno.ENOSPC),  # inside torch.save, which wraps the OSError in a RuntimeError
    ("ckpt-4.pt", "fsync", 1, errno.EIO),
    ("ckpt-8.pt", "replace", 1, errno.ENOENT),  # the last checkpoint: its folder gone at the rename
    ("validation.csv", "write", 2, errno.ENOSPC),  # the second checkpoint's result
])
def test_a_fault_at_each_write_site_ends_in_one_line_and_restore_continues_to_the_same_weights(
        data_dir, reference, tmp_path, capfd, monkeypatch, name, operation, n, error):
    folder = tmp_path / "run"
    with monkeypatch.context() as patched:
        fault = DiskFault(name, operation, n, error).install(patched)
        out = scripts.run_here(capfd, "train.py", *options(data_dir, folder), expect=None)
    assert fault.fired_on is not None, f"no {operation} of {name} went through cnns.safe_writes"
    assert_one_error_line(out, folder / final_name(fault.fired_on), fault.cause)
    assert_run_folder_whole(folder)

    scripts.run_here(capfd, "restore.py", "--restore-path", str(folder))
    scripts.run_here(capfd, "validation.py", "--restore-path", str(folder))
    assert_run_folder_whole(folder)
    assert_same_state(folder / f"ckpt-{ITERATIONS}.pt", reference / f"ckpt-{ITERATIONS}.pt")
    assert training_rows(folder) == training_rows(reference)
    assert validation_rows(folder) == validation_rows(reference)


@pytest.mark.parametrize("name", ["arguments.json", "ckpt-0.pt"])
def test_a_fault_before_the_first_checkpoint_leaves_nothing_half_written(data_dir, tmp_path, capfd, monkeypatch,
                                                                        name):
    folder = tmp_path / "run"
    with monkeypatch.context() as patched:
        fault = DiskFault(name).install(patched)
        out = scripts.run_here(capfd, "train.py", *options(data_dir, folder), expect=None)
    assert fault.fired_on is not None
    assert_one_error_line(out, folder / name, fault.cause)
    assert_run_folder_whole(folder)
    assert not (folder / name).exists() and not list_checkpoints(folder)


def test_training_png_failing_is_a_notice_and_the_run_ends_well(data_dir, tmp_path, capfd, monkeypatch):
    folder = tmp_path / "run"
    with monkeypatch.context() as patched:
        fault = DiskFault("training.png").install(patched)
        out = scripts.run_here(capfd, "train.py", *options(data_dir, folder))
    assert fault.fired_on is not None
    assert f"notice: training.png not written: cannot write {folder / 'training.png'}: {fault.cause}" in out.stderr
    assert not (folder / "training.png").exists()
    assert_run_folder_whole(folder)


@pytest.mark.parametrize("name, operation", [("training.abandoned.csv", "write"), ("training.csv", "replace")])
def test_a_fault_while_restore_sets_rows_apart_leaves_both_files_as_they_were(
        data_dir, reference, tmp_path, capfd, monkeypatch, name, operation):
    """A run stopped past its checkpoint at 4 (training.csv failed at iteration 6); restore.py moves rows 5 on to
    training.abandoned.csv and replaces training.csv: either write failing leaves both files as they were."""
    folder = tmp_path / "run"
    with monkeypatch.context() as patched:
        DiskFault("training.csv", n=6).install(patched)
        scripts.run_here(capfd, "train.py", *options(data_dir, folder), expect=2)
    before = {path.name: path.read_bytes() for path in folder.glob("*.csv")}
    assert len(csv_rows(folder / "training.csv")) == 5

    with monkeypatch.context() as patched:
        fault = DiskFault(name, operation).install(patched)
        out = scripts.run_here(capfd, "restore.py", "--restore-path", str(folder), expect=None)
    assert fault.fired_on is not None
    assert_one_error_line(out, folder / name, fault.cause)
    assert {path.name: path.read_bytes() for path in folder.glob("*.csv")} == before
    assert_run_folder_whole(folder)

    scripts.run_here(capfd, "restore.py", "--restore-path", str(folder))
    assert training_rows(folder) == training_rows(reference)
    assert [row["iteration"] for row in csv_rows(folder / "training.abandoned.csv")] == ["5"]
    assert_same_state(folder / f"ckpt-{ITERATIONS}.pt", reference / f"ckpt-{ITERATIONS}.pt")


def test_weight_avg_failing_leaves_no_average_and_succeeds_again(reference, tmp_path, capfd, monkeypatch):
    folder = tmp_path / "run"
    shutil.copytree(reference, folder)
    with monkeypatch.context() as patched:
        fault = DiskFault("weight_avg*.pt", "fsync", error=errno.EIO).install(patched)
        out = scripts.run_here(capfd, "weight_avg.py", "--restore-path", str(folder), expect=None)
    assert fault.fired_on is not None
    assert_one_error_line(out, folder / final_name(fault.fired_on), fault.cause)
    assert not list(folder.glob("weight_avg*")) and not list(folder.glob(".weight_avg*"))
    scripts.run_here(capfd, "weight_avg.py", "--restore-path", str(folder))
    (average,) = folder.glob("weight_avg*.pt")
    load_checkpoint(average)


# ----------------------------------------------------------------------------------------------
# The primitives, every operation failing in turn


@pytest.mark.parametrize("operation, n", [("write", 1), ("write", 2), ("fsync", 1), ("replace", 1)])
def test_an_atomic_write_failing_at_any_operation_keeps_the_old_file(tmp_path, monkeypatch, operation, n):
    path = tmp_path / "arguments.json"
    path.write_text("old\n")

    def two_chunks(file) -> None:
        file.write(b"new ")
        file.write(b"text\n")

    with monkeypatch.context() as patched:
        fault = DiskFault(path.name, operation, n).install(patched)
        with pytest.raises(WriteError, match=rf"^cannot write {re.escape(str(path))}: No space left on device$"):
            write_atomically(path, two_chunks)
    assert fault.fired_on is not None
    assert sorted(os.listdir(tmp_path)) == ["arguments.json"] and path.read_text() == "old\n"
    write_atomically(path, two_chunks)
    assert path.read_text() == "new text\n"


@pytest.mark.parametrize("existing", [b"header\r\nrow 1\r\n", None])
def test_a_failed_append_leaves_the_file_as_it_was(tmp_path, monkeypatch, existing):
    path = tmp_path / "training.csv"
    if existing is not None:
        path.write_bytes(existing)
    with monkeypatch.context() as patched:
        DiskFault(path.name).install(patched)
        with pytest.raises(WriteError, match="No space left on device"):
            append(path, "row 2 with enough bytes to be cut in half\r\n")
    assert (path.read_bytes() if path.exists() else None) == existing  # not even a new, empty file
    append(path, "row 2\r\n")
    assert path.read_bytes() == (existing or b"") + b"row 2\r\n"


def test_torch_saves_runtime_error_on_a_full_disk_is_one_line_naming_the_checkpoint(tmp_path, monkeypatch):
    """torch.save turns an OSError raised by its file into `RuntimeError: [enforce fail at inline_container.cc]`."""
    previous = tmp_path / "ckpt-4.pt"
    save_checkpoint(previous, {"model": {"w": torch.ones(3)}, "iteration": 4})
    with monkeypatch.context() as patched:
        DiskFault("ckpt-8.pt", n=3).install(patched)
        with pytest.raises(CheckpointError) as raised:
            save_checkpoint(tmp_path / "ckpt-8.pt", {"model": {"w": torch.zeros(1000)}, "iteration": 8})
    assert str(raised.value) == (f"cannot write checkpoint {tmp_path / 'ckpt-8.pt'}: No space left on device; "
                                 "the previous checkpoints are intact")
    assert sorted(os.listdir(tmp_path)) == ["ckpt-4.pt"] and load_checkpoint(previous)["iteration"] == 4


def test_a_failed_replace_while_setting_rows_apart_takes_the_set_apart_rows_back(tmp_path, monkeypatch):
    path = tmp_path / "training.csv"
    path.write_text("step,iteration\r\n1,1\r\n2,2\r\n3,3\r\n", newline="")
    aside = tmp_path / "training.abandoned.csv"
    aside.write_text("step,iteration\r\n9,9\r\n", newline="")
    before = path.read_bytes(), aside.read_bytes()
    with monkeypatch.context() as patched:
        DiskFault("training.csv", "replace", error=errno.EIO).install(patched)
        with pytest.raises(WriteError, match="Input/output error"):
            set_apart_rows_after(path, 1)
    assert (path.read_bytes(), aside.read_bytes()) == before


# ----------------------------------------------------------------------------------------------
# A real full filesystem


@pytest.fixture
def tiny_filesystem(tmp_path):
    """A tmpfs mounted at a new folder (root and a kernel that lets this process mount one), unmounted after."""
    if not Path("/proc/self/fd").is_dir() or os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root and mount(8)")
    place = tmp_path / "tiny"
    place.mkdir()
    mounted = processes.run(["mount", "-t", "tmpfs", "-o", "size=4k", "tmpfs", str(place)], timeout=30)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()[:200]}")

    def resize(size: int) -> None:
        processes.run(["mount", "-o", f"remount,size={size}", str(place)], timeout=30, check=True)

    try:
        yield place, resize
    finally:
        processes.run(["umount", "-l", str(place)], timeout=30)


def test_a_full_tmpfs_ends_the_run_in_one_line_and_restore_continues_once_there_is_room(
        data_dir, reference, tiny_filesystem, capfd):
    place, resize = tiny_filesystem
    checkpoint = (reference / "ckpt-0.pt").stat().st_size
    resize(checkpoint * 3 // 2)  # room for the initial checkpoint and the logs, not for a second checkpoint
    folder = place / "run"
    out = scripts.run_here(capfd, "train.py", *options(data_dir, folder), expect=2)
    assert "Traceback" not in out.stderr
    assert re.fullmatch(rf"error: cannot write .*{re.escape(str(folder))}/\S+: No space left on device(;.*)?",
                        out.stderr.strip().splitlines()[-1]), out.stderr[-2000:]
    assert_run_folder_whole(folder)
    assert list_checkpoints(folder)

    resize(64 << 20)
    scripts.run_here(capfd, "restore.py", "--restore-path", str(folder))
    assert_run_folder_whole(folder)
    assert_same_state(folder / f"ckpt-{ITERATIONS}.pt", reference / f"ckpt-{ITERATIONS}.pt")
    assert training_rows(folder) == training_rows(reference)
