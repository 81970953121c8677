"""One writer per run folder (`cnns.runfolder.lock`): a second command on a folder another one writes ends in one line
naming the holder, exit 2, nothing written; the kernel drops the lock of a holder that dies, SIGKILL too."""

from __future__ import annotations

import csv
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import processes
import scripts

from cnns.runfolder.lock import LOCK_NAME

# A ResNet-8 on the built-in shapes (no data files), 625 updates an epoch: a row every update, and checkpoints
# at 0, 6 and 12.
BUILTIN_RUN = ("--dataset", "builtin", "--model-size", "8", "--micro-batch-size", "8", "--ckpts-per-epoch", "100",
               "--log-freq", "1", "--no-validation", "--seed", "3")
ITERATIONS = 12
CHILD_TIMEOUT_S = 240
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    """A finished run of ITERATIONS updates, trained in this process."""
    folder = tmp_path_factory.mktemp("locked-runs") / "run"
    scripts.train_here(*BUILTIN_RUN, "--iterations", str(ITERATIONS), "--logs-path", str(folder))
    assert (folder / f"ckpt-{ITERATIONS}.pt").is_file() and not (folder / LOCK_NAME).exists()
    return folder


@pytest.fixture
def run_copy(trained_run, tmp_path) -> Path:
    return Path(shutil.copytree(trained_run, tmp_path / trained_run.name))


def cut_back_to(folder: Path, iteration: int) -> None:
    """The run as a crash after `iteration`'s checkpoint leaves it: the later checkpoints gone, their rows kept
    (restore.py sets those apart and trains the updates again)."""
    for path in folder.glob("ckpt-*.pt"):
        if int(path.stem.split("-")[1]) > iteration:
            path.unlink()


def iterations_in(path: Path) -> list[int]:
    with open(path, newline="") as f:
        return [int(row["iteration"]) for row in csv.DictReader(f)]


def digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def root_script(name: str, *args: str) -> list[str]:
    return [sys.executable, str(scripts.ROOT / name), *args]


def wait_until_it_holds(process: subprocess.Popen, folder: Path) -> None:
    """Until the process has taken the folder's lock (the lock file names its pid), or the test fails."""
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if (folder / LOCK_NAME).read_text().split("\n")[0] == str(process.pid):
                return
        except (OSError, UnicodeDecodeError):
            pass
        time.sleep(0.005)
    out, err = processes.communicate(process, timeout=30) if process.poll() is not None else ("", "")
    pytest.fail(f"{process.args[1]} never held the lock of {folder} (exit {process.poll()}): {err[-2000:]}")


def hold(folder: Path) -> subprocess.Popen:
    """A process that holds the folder's lock until its stdin closes or it is killed (no torch: it starts at once)."""
    code = ("import sys; from pathlib import Path; from cnns.runfolder.lock import run_folder_lock\n"
            "with run_folder_lock(Path(sys.argv[1])):\n"
            "    print('holding', flush=True)\n"
            "    sys.stdin.read()\n")
    holder = processes.start([sys.executable, "-c", code, str(folder)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, env={**os.environ, "PYTHONPATH": str(scripts.ROOT / "src")})
    assert processes.read_line(holder.stdout, time.monotonic() + 60) == "holding\n"
    return holder


def test_two_restores_of_one_run_write_each_row_once(run_copy, tmp_path, capfd):
    """Two restore.py on one run at once: the second ends in one line naming the first, exit 2, and writes
    nothing; the first continues the run alone, so training.csv holds every iteration once, in order."""
    cut_back_to(run_copy, 6)
    first = processes.start(root_script("restore.py", "--restore-path", str(run_copy)), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=ONE_THREAD)
    wait_until_it_holds(first, run_copy)
    first.send_signal(signal.SIGSTOP)  # it holds the lock, and goes no further while the second one tries
    try:
        before = digest(run_copy)
        # The second command in this process (tests/scripts.py): the lock is the first process's.
        second = scripts.run_here(capfd, "restore.py", "--restore-path", str(run_copy), cwd=tmp_path, expect=None)
        assert digest(run_copy) == before  # not a row, not a line of log.txt
    finally:
        first.send_signal(signal.SIGCONT)
    command = f"restore.py --restore-path {run_copy}"
    assert second.returncode == 2, second.stderr[-3000:]
    assert second.stderr.splitlines() == [f"error: {run_copy} is in use by pid {first.pid} ({command}): one command "
                                          "at a time writes a run folder; run this one when that one has ended"]
    assert second.stdout == ""
    out, err = processes.communicate(first, timeout=CHILD_TIMEOUT_S)
    assert first.returncode == 0, err[-3000:]
    assert iterations_in(run_copy / "training.csv") == list(range(1, ITERATIONS + 1))
    assert f"Saved checkpoint to {run_copy / f'ckpt-{ITERATIONS}.pt'}" in out
    assert not (run_copy / LOCK_NAME).exists()  # given back, the folder as the run left it


def test_two_validations_of_one_run_validate_each_checkpoint_once(run_copy, tmp_path, capfd):
    first = processes.start(root_script("validation.py", "--restore-path", str(run_copy)), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=ONE_THREAD)
    wait_until_it_holds(first, run_copy)
    first.send_signal(signal.SIGSTOP)
    try:
        second = scripts.run_here(capfd, "validation.py", "--restore-path", str(run_copy), cwd=tmp_path, expect=None)
    finally:
        first.send_signal(signal.SIGCONT)
    assert second.returncode == 2 and len(second.stderr.splitlines()) == 1, second.stderr[-3000:]
    assert f"is in use by pid {first.pid} (validation.py --restore-path {run_copy})" in second.stderr
    _, err = processes.communicate(first, timeout=CHILD_TIMEOUT_S)
    assert first.returncode == 0, err[-3000:]
    assert iterations_in(run_copy / "validation.csv") == checkpointed(run_copy)


def checkpointed(folder: Path) -> list[int]:
    return sorted(int(path.stem.split("-")[1]) for path in folder.glob("ckpt-*.pt"))


@pytest.mark.parametrize("script", ["restore.py", "validation.py", "weight_avg.py", "train.py"])
def test_every_command_that_writes_a_run_folder_refuses_one_in_use(run_copy, tmp_path, capfd, script):
    """train.py writes a new run into an empty --logs-path folder (one holding a run it refuses before it looks at
    the lock: test_overwrite.py); the others continue, validate or average a run."""
    folder = run_copy
    if script == "train.py":
        folder = tmp_path / "new"
        folder.mkdir()
    args = ([*BUILTIN_RUN, "--iterations", "2", "--logs-path", str(folder)] if script == "train.py" else
            ["--restore-path", str(folder)])
    before = digest(folder)
    holder = hold(folder)
    try:
        out = scripts.run_here(capfd, script, *args, cwd=tmp_path, expect=2)
    finally:
        processes.communicate(holder, timeout=60)  # closes its stdin: it gives the lock back and ends
    assert out.stderr.splitlines() == [f"error: {folder} is in use by pid {holder.pid} (-c {folder}): one "
                                       "command at a time writes a run folder; run this one when that one has ended"]
    assert out.stdout == ""
    assert digest(folder) == before


def test_a_holder_killed_with_sigkill_leaves_no_stale_lock(run_copy, tmp_path, capfd):
    holder = hold(run_copy)
    processes.kill_tree(holder)  # SIGKILL: no clean-up runs, the lock file stays behind
    assert (run_copy / LOCK_NAME).read_text().split("\n")[0] == str(holder.pid)
    out = scripts.run_here(capfd, "validation.py", "--restore-path", str(run_copy), cwd=tmp_path)
    assert out.stdout.count("Validation top-1 accuracy") == len(checkpointed(run_copy)) == 3
    assert not (run_copy / LOCK_NAME).exists()


def test_commands_that_only_read_a_run_take_no_lock(run_copy, tmp_path, capsys):
    """cnns predict (and export, plot) read a run folder: they run beside a command that writes it."""
    from cnns.cli import run_script

    holder = hold(run_copy)
    try:
        from PIL import Image

        from cnns.data.drawn_shapes import draw_shapes

        images, _ = draw_shapes(1, seed=1)
        image = tmp_path / "one.png"
        Image.fromarray(images[0].numpy()).save(image)
        assert run_script("predict", ["--restore-path", str(run_copy), str(image), "--top-k", "1"]) == 0
    finally:
        processes.communicate(holder, timeout=60)  # closes its stdin: it gives the lock back and ends
    assert str(image) in capsys.readouterr().out


def test_workers_end_with_a_launcher_killed_with_sigkill(tmp_path):
    """train.py --replicas 2 starts its two workers; SIGKILL of the launcher (its agent cannot stop them) takes
    them too, at once, instead of leaving them to train on for thousands of updates, orphaned."""
    folder = tmp_path / "run"
    launcher = processes.start(root_script("train.py", *BUILTIN_RUN, "--iterations", "5000", "--replicas", "2",
                                           "--ckpts-per-epoch", "0", "--logs-path", str(folder),
                                           "--threads-per-worker", "1"),
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=tmp_path, env=ONE_THREAD)
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    while not (folder / "training.csv").is_file() and launcher.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert launcher.poll() is None and (folder / "training.csv").is_file(), "the workers never trained"
    workers = [pid for pid in processes.family(launcher.cnns_tag) if pid != launcher.pid]
    assert len(workers) >= 2
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.wait(timeout=30)
    deadline = time.monotonic() + 30
    while any(Path(f"/proc/{pid}").exists() and not _is_zombie(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [pid for pid in workers if Path(f"/proc/{pid}").exists() and not _is_zombie(pid)]
    assert not left, f"workers {left} outlived their launcher"
    rows = iterations_in(folder / "training.csv")
    time.sleep(1.0)
    assert iterations_in(folder / "training.csv") == rows and rows[-1] < 5000  # nothing written after


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return False


@pytest.mark.parametrize("launcher_alive", [True, False])
def test_a_worker_whose_launcher_ended_before_it_bound_to_it_ends_itself(launcher_alive):
    """end_with_the_launcher's race: the launcher named in the environment is not the parent any more (it ended
    between starting the worker and the worker's binding), so the worker SIGKILLs itself; under its launcher it
    goes on, and its own children do not inherit the binding."""
    from cnns.parallel.launch import LAUNCHER_ENV

    code = ("import os; from cnns.parallel.launch import LAUNCHER_ENV, end_with_the_launcher\n"
            "end_with_the_launcher(); print('bound', LAUNCHER_ENV in os.environ, flush=True)\n")
    launcher = os.getpid() if launcher_alive else 1  # pid 1 is never this child's parent here
    out = processes.run([sys.executable, "-c", code], timeout=120, text=True,
                        env={**os.environ, "PYTHONPATH": str(scripts.ROOT / "src"), LAUNCHER_ENV: str(launcher)})
    if launcher_alive:
        assert (out.returncode, out.stdout) == (0, "bound False\n")
    else:
        assert (out.returncode, out.stdout) == (-signal.SIGKILL, "")


def test_a_lock_whose_holder_cannot_be_written_is_given_back_with_one_line(tmp_path, monkeypatch):
    """Naming the holder in the lock file can fail (a full disk): the lock is given back at once (no descriptor
    left holding it) and the command gets one line, not a traceback."""
    import errno

    from cnns.runfolder import lock as runlock
    from cnns.errors import CnnsError

    def full_disk(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(runlock, "_name_the_holder", full_disk)
    with pytest.raises(CnnsError, match=r"cannot lock the run folder .*: writing .*\.lock: No space left on device"):
        with runlock.run_folder_lock(tmp_path):
            pass
    assert not runlock._held and not (tmp_path / LOCK_NAME).exists()
    monkeypatch.undo()
    with runlock.run_folder_lock(tmp_path):  # nothing left holding it
        assert (tmp_path / LOCK_NAME).is_file()


def test_a_link_planted_as_the_lock_file_is_refused_and_its_target_kept(tmp_path):
    from cnns.runfolder import lock as runlock
    from cnns.errors import CnnsError

    target = tmp_path / "precious.txt"
    target.write_text("keep me\n")
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / LOCK_NAME).symlink_to(target)
    with pytest.raises(CnnsError, match="is a symbolic link"):
        with runlock.run_folder_lock(folder):
            pass
    assert target.read_text() == "keep me\n"
