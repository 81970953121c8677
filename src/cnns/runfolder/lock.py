"""One writer per run folder: the command that writes a run folder holds an exclusive lock on it.

Two commands writing one folder at once (two `restore.py`, or `validation.py` beside a training run) would
interleave their rows in training.csv and validation.csv and overwrite each other's checkpoints. So train.py,
restore.py, validation.py and weight_avg.py hold an OS advisory lock, flock(2) on ``<run folder>/.lock``, for as
long as they write there, and a second command ends at once with one line naming the holder (its pid and
command line, which the holder writes into the file). The kernel drops the lock when its holder ends, however it
ends (SIGKILL too), so no lock outlives its process. Read-only commands (predict, export, plot) take none.

The file is removed when the lock is given back, so a folder looks as it did before; a taker therefore checks
that the file it locked is still the one at the path (a holder that removed it meanwhile would otherwise leave
two processes holding locks on two different files), and takes the new one if not.

Who takes it: the process that owns the folder. Of a run's processes that is rank 0 (`World.is_writer`; before
the processes have joined, torchrun's RANK says it), for replicas and pipeline stages alike. A command that
starts its own local workers takes the lock before they start and names itself in their environment
(`HELD_FOR_WORKERS`), so that their rank 0 writes under its launcher's lock instead of waiting on it.
"""

from __future__ import annotations

import fcntl
import os
import shlex
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from cnns.errors import CnnsError
from cnns.safe_writes import own_run_folder

LOCK_NAME = ".lock"
# "<launcher pid>:<run folder>", set while a launcher holds a folder's lock, for the workers it starts.
HELD_FOR_WORKERS = "CNNS_RUN_FOLDER_LOCKED_BY"
# A taker that finds the file removed under it (its holder gave the lock back) tries the new one; a few tries
# are plenty, since each one means another process finished a whole command in between.
_TRIES = 20
# The holder writes its pid and command right after it takes the lock; a second command that looks in that
# instant waits this long, at most, to name it.
_HOLDER_WAIT_S = 0.5

_held: set[int] = set()  # this process's lock file descriptors


class RunFolderInUse(CnnsError):
    """Another process holds the run folder's lock."""


@contextmanager
def run_folder_lock(folder: Path | None) -> Iterator[None]:
    """Hold `folder`'s lock for the body (nothing for None, or where another process of this run holds it).
    RunFolderInUse (one line naming the holder) when another command holds it; nothing is written then."""
    if folder is not None:
        own_run_folder(folder)  # this command writes the folder's files, under this lock or its launcher's
    if folder is None or not _owns_the_lock(Path(folder)):
        yield
        return
    folder = Path(folder)
    fd = _take(folder)
    previous = os.environ.get(HELD_FOR_WORKERS)
    os.environ[HELD_FOR_WORKERS] = f"{os.getpid()}:{_key(folder)}"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(HELD_FOR_WORKERS, None)
        else:
            os.environ[HELD_FOR_WORKERS] = previous
        _give_back(folder, fd)


def _owns_the_lock(folder: Path) -> bool:
    """Rank 0 of a run takes the lock, unless the launcher that started it holds it already."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and os.environ["RANK"] != "0":
        return False  # another process of the run: rank 0 holds the lock for all of them
    pid, _, path = os.environ.get(HELD_FOR_WORKERS, "").partition(":")
    return not (pid == str(os.getppid()) and path == _key(folder))


def _key(folder: Path) -> str:
    return os.path.realpath(folder)


def _take(folder: Path) -> int:
    path = folder / LOCK_NAME
    for _ in range(_TRIES):
        try:
            # O_NOFOLLOW: a link planted at .lock is refused, never opened, so the holder's name below is never
            # written (truncating first) into the file it points to.
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0), 0o644)
        except OSError as error:
            if path.is_symlink():
                raise CnnsError(f"cannot lock the run folder {folder}: {path} is a symbolic link, not a lock file "
                                "cnns made; remove it") from None
            raise CnnsError(f"cannot lock the run folder {folder}: {path}: {error.strerror or error}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise RunFolderInUse(f"{folder} is in use by {holder}: one command at a time writes a run folder; "
                                 "run this one when that one has ended") from None
        except OSError as error:  # a file system without locks
            os.close(fd)
            raise CnnsError(f"cannot lock the run folder {folder}: {path}: {error.strerror or error}") from None
        if _is_still_at(fd, path):
            try:
                _name_the_holder(fd)
            except OSError as error:  # a full disk: give the lock back, and say so in one line
                _give_back(folder, fd)
                raise CnnsError(f"cannot lock the run folder {folder}: writing {path}: "
                                f"{error.strerror or error}") from None
            _held.add(fd)
            return fd
        os.close(fd)  # its holder removed it as it gave the lock back: lock the file now at the path
    raise CnnsError(f"cannot lock the run folder {folder}: {path} keeps being replaced by other commands")


def _is_still_at(fd: int, path: Path) -> bool:
    try:
        here, there = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def _name_the_holder(fd: int) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n{this_command()}\n".encode("utf-8", "replace"), 0)


def this_command() -> str:
    """This process's command line as a user typed it (`restore.py --restore-path R`, `cnns validate ...`)."""
    argv = list(sys.argv) or ["python"]
    program = Path(argv[0]).name
    if program == "__main__.py":  # python -m cnns
        program = "cnns"
    text = shlex.join([program, *argv[1:]])
    return text.replace("\n", "\\n")[:300]


def _holder(fd: int) -> str:
    """'pid N (command)' from the lock file, read once its holder has written it."""
    deadline = time.monotonic() + _HOLDER_WAIT_S
    while True:
        text = os.pread(fd, 4096, 0).decode("utf-8", "replace")
        pid, _, rest = text.partition("\n")
        command = rest.rstrip("\n")
        if text.endswith("\n") and pid.isdigit() and command:
            return f"pid {pid} ({command})"
        if time.monotonic() >= deadline:
            return "another process"
        time.sleep(0.01)


def _give_back(folder: Path, fd: int) -> None:
    """Remove the file (while still holding it: a taker that opened it sees it gone and takes the next), then
    release the lock."""
    path = folder / LOCK_NAME
    try:
        if _is_still_at(fd, path):
            path.unlink()
    except OSError:  # a folder gone or made read-only meanwhile: the lock itself still goes with the descriptor
        pass
    _held.discard(fd)
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


def _forget_in_a_forked_child() -> None:
    """A forked child (a DataLoader worker) shares the lock's open file; closing its copy keeps the lock tied to
    the holder's life alone: a SIGKILLed holder's lock is gone at once, not when its last worker notices."""
    for fd in list(_held):
        try:
            os.close(fd)
        except OSError:
            pass
    _held.clear()


os.register_at_fork(after_in_child=_forget_in_a_forked_child)
