"""The machine's limits named: what a run needs of the machine is checked before its folder where it can be known
(memory for the model, shared memory for the data workers' batches), and a limit met later ends in one line naming
it and what changes it (cnns.cli.endings), not in the line for a bug."""

from __future__ import annotations

import errno
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import scripts
from test_worker_errors import jpeg_tree

ROOT = Path(__file__).resolve().parents[1]


def test_a_model_the_memory_cannot_hold_is_refused_before_the_run_folder(tmp_path, capfd):
    out = scripts.run_here(capfd, "train.py", "--dataset", "cifar-10", "--generated-data", "--num-classes",
                           "2000000000", "--iterations", "1", "--logs-path", str(tmp_path / "run"), expect=2)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "--num-classes" in lines[0], lines
    assert "weights, gradients and optimiser state" in lines[0], lines
    assert not (tmp_path / "run").exists()


def _can_mount_a_small_shm() -> bool:
    if shutil.which("unshare") is None:
        return False
    done = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                           "mount -t tmpfs -o size=256k tmpfs /dev/shm"], capture_output=True, timeout=30)
    return done.returncode == 0


@pytest.mark.skipif(not _can_mount_a_small_shm(), reason="needs a mount namespace (root) to give /dev/shm 256 KiB")
def test_workers_shared_memory_is_checked_before_the_run_folder(tmp_path):
    """Under a /dev/shm of 256 KiB (Docker gives 64 MB), as a container too small for the workers' batches."""
    root = jpeg_tree(tmp_path / "tree")
    command = [sys.executable, str(ROOT / "train.py"), "--dataset", "imagenet", "--model-size", "18", "--image-size",
               "128", "--micro-batch-size", "4", "--iterations", "1", "--data-dir", str(root),
               "--pipeline-num-parallel", "2", "--logs-path", str(tmp_path / "run")]
    done = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                           'mount -t tmpfs -o size=256k tmpfs /dev/shm && exec "$@"', "sh", *command],
                          capture_output=True, text=True, timeout=300)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-2000:]
    assert "/dev/shm" in lines[0] and "--pipeline-num-parallel" in lines[0] and "--shm-size" in lines[0], lines
    assert not (tmp_path / "run").exists()


# torch's own words for each limit, met where no check could look before (another process filled /dev/shm, the
# descriptors ran out while sharing batches): each ends in one line naming the limit and what changes it.
LIMITS = {
    "a worker's bus error": (RuntimeError("DataLoader worker (pid 12) is killed by signal: Bus error. It is possible "
                                          "that dataloader's workers are out of shared memory. Please try to raise "
                                          "your shared memory limit."), ("/dev/shm", "--pipeline-num-parallel")),
    "a shared file that cannot grow": (RuntimeError("unable to write to file </torch_12_345_0>: No space left on "
                                                    "device (28)"), ("/dev/shm", "--shm-size")),
    "shared memory not allocated": (RuntimeError("unable to allocate shared memory(shm) for file </torch_1_2_3>: "
                                                 "Success (0)"), ("/dev/shm", "--micro-batch-size")),
    "too many open files": (OSError(errno.EMFILE, "Too many open files"), ("ulimit -n", "--pipeline-num-parallel")),
    "a worker killed for memory": (RuntimeError("DataLoader worker (pid 12) is killed by signal: Killed. "),
                                   ("out-of-memory killer", "--pipeline-num-parallel")),
    "descriptors run out while sharing": (RuntimeError("received 0 items of ancdata"), ("ulimit -n",)),
}


@pytest.mark.parametrize("name", list(LIMITS))
def test_a_limit_met_during_the_run_is_named_with_what_changes_it(name, capfd):
    from cnns.cli.endings import ending_of

    exc, words = LIMITS[name]
    code = ending_of(exc, "train")
    line = capfd.readouterr().err.strip()
    assert code == 1 and len(line.splitlines()) == 1 and "bug in cnns" not in line, line
    assert all(word in line for word in words), line


def test_data_workers_stopped_with_their_process_end_as_the_signal(capfd):
    """A replica stopped by its launcher: its workers get the SIGTERM first, and torch says so as a RuntimeError."""
    from cnns.cli.endings import ending_of

    code = ending_of(RuntimeError("DataLoader worker (pid 7) is killed by signal: Terminated. "), "train")
    assert code == 128 + signal.SIGTERM and capfd.readouterr().err.strip() == "error: interrupted by SIGTERM"


def _in_a_small_file_system(tmp_path: Path, size: str, read_only: bool, *commands: list[str]) -> list:
    """Each command run in turn with `tmp_path/mnt` a tmpfs of `size` (holding a copy of `tmp_path/run` if there),
    remounted read-only if asked, in a mount namespace of its own: (exit code, stderr) of each."""
    script = [f"mount -t tmpfs -o size={size} tmpfs {tmp_path}/mnt",
              f"[ -d {tmp_path}/run ] && cp -r {tmp_path}/run {tmp_path}/mnt/run || true"]
    script += [f"mount -o remount,ro {tmp_path}/mnt"] if read_only else []
    script += [shlex.join(command) + f" 2>{tmp_path}/err{index}; echo $? >{tmp_path}/rc{index}"
               for index, command in enumerate(commands)]
    (tmp_path / "mnt").mkdir()
    subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", "\n".join(script)], cwd=tmp_path,
                   timeout=600, check=True)
    return [(int((tmp_path / f"rc{index}").read_text()), (tmp_path / f"err{index}").read_text())
            for index in range(len(commands))]


@pytest.mark.skipif(not _can_mount_a_small_shm(), reason="needs a mount namespace (root) for a small file system")
def test_a_read_only_folder_is_named_before_anything_is_written(tmp_path):
    train = [sys.executable, str(ROOT / "train.py"), "--dataset", "cifar-10", "--generated-data", "--model-size", "8",
             "--iterations", "1"]
    scripts.train_here(*train[2:], "--logs-path", str(tmp_path / "run"))
    ends = _in_a_small_file_system(tmp_path, "8m", True, [*train, "--log-dir", "mnt/logs"],
                                   [sys.executable, str(ROOT / "restore.py"), "--restore-path", "mnt/run"],
                                   [sys.executable, str(ROOT / "validation.py"), "--restore-path", "mnt/run"])
    for code, err in ends:
        assert code == 2 and len(err.strip().splitlines()) == 1 and "read-only" in err, ends


@pytest.mark.skipif(not _can_mount_a_small_shm(), reason="needs a mount namespace (root) for a small file system")
def test_a_full_disk_ends_in_one_line_and_leaves_the_checkpoints_whole(tmp_path):
    train = [sys.executable, str(ROOT / "train.py"), "--dataset", "cifar-10", "--generated-data", "--model-size", "8",
             "--iterations", "4", "--logs-path", "mnt/run"]
    # Every checkpoint the full disk left is whole: each loads (read inside the namespace, where the tmpfs is).
    load = [sys.executable, "-c", "import glob, sys, torch; paths = glob.glob('mnt/run/ckpt-*.pt'); "
            "[torch.load(path, weights_only=True)['model'] for path in paths]; sys.exit(0 if paths else 3)"]
    (code, err), (loaded, load_err) = _in_a_small_file_system(tmp_path, "200k", False, train + ["--seed", "1"], load)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "No space left on device" in lines[0], err
    assert loaded == 0, load_err[-2000:]


def _train_under_a_file_limit(tmp_path: Path, soft: int, hard: int) -> subprocess.CompletedProcess:
    import resource

    root = jpeg_tree(tmp_path / "tree")
    command = [sys.executable, str(ROOT / "train.py"), "--dataset", "imagenet", "--model-size", "18", "--image-size",
               "64", "--micro-batch-size", "2", "--iterations", "1", "--no-validation", "--data-dir", str(root),
               "--pipeline-num-parallel", "2", "--logs-path", str(tmp_path / "run")]
    return subprocess.run(command, capture_output=True, text=True, timeout=300,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard)))


def test_an_open_file_limit_too_low_for_the_workers_is_named_before_the_run_folder(tmp_path):
    done = _train_under_a_file_limit(tmp_path, 40, 40)  # 2 workers failed under it
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-2000:]
    assert "open files" in lines[0] and "ulimit -n" in lines[0] and "--pipeline-num-parallel" in lines[0], lines
    assert not (tmp_path / "run").exists()


def test_a_soft_open_file_limit_is_raised_to_the_hard_one(tmp_path):
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    done = _train_under_a_file_limit(tmp_path, 40, hard if hard != resource.RLIM_INFINITY else 4096)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.skipif(not _can_mount_a_small_shm(), reason="needs a mount namespace (root) for a small file system")
def test_a_disk_without_room_for_one_checkpoint_is_named_before_the_run_folder(tmp_path):
    train = [sys.executable, str(ROOT / "train.py"), "--dataset", "cifar-10", "--generated-data", "--model-size", "8",
             "--iterations", "4", "--logs-path", "mnt/run"]
    listing = [sys.executable, "-c", "import os, sys; sys.exit(3 if os.path.exists('mnt/run') else 0)"]
    (code, err), (left, _) = _in_a_small_file_system(tmp_path, "64k", False, train, listing)  # ResNet-8: 147 KiB
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "free there" in lines[0], err
    assert left == 0  # no run folder
