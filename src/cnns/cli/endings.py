"""How a command ends, whatever ends it: an exit code and at most one line on stderr, never a traceback.

* a signal: SIGTERM and SIGINT end a command with 128 + the signal's number (143, 130), as SPEC §8 asks. Training
  installs its own handlers (`cnns.engine.loop.StopRequest`: finish the update, checkpoint, say how to continue);
  everywhere else (validation, averaging, export, ...) the signal ends the command where it is, with one line.
  Writes are atomic (`cnns.safe_writes`), so what a command leaves is whole;
* a reader that went away (`train.py ... | head -1`: a broken pipe on stdout) ends the command quietly with
  128 + SIGPIPE, as a program killed by SIGPIPE does; a closed stdout or stderr (`>&-`) is /dev/null, so a
  finished run exits 0, and no file the command opens takes its descriptor (a C library writing to fd 1
  would write into it);
* a path the system will not look up (too long, looping links): one line naming it, exit 2;
* running out of memory, of shared memory or of open files: one line naming what to lower or raise;
* a data worker killed by the signal that stops the command: as the signal itself;
* a peer process that died inside a collective: one line (`cnns.parallel.world.peer_failure`);
* anything else is a bug: one line naming the error and where it happened, and the traceback in a file the line
  names; exit 1.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import tempfile
import traceback
from contextlib import contextmanager
from typing import Iterator

from cnns.errors import CONTINUE_WITH, first_line


class Terminated(BaseException):
    """A signal that ends the command where it is (outside training's own handlers), like KeyboardInterrupt."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def make_standard_streams_safe() -> None:
    """Descriptors 0-2 are open (on /dev/null where the caller closed them) and sys.stdout/stderr are files."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:  # the lowest free descriptor is taken: it is `fd` unless a lower one is closed too
                os.dup2(null, fd)
                os.close(null)
    if sys.stdout is None:
        sys.stdout = open(os.devnull, "w")
    if sys.stderr is None:
        sys.stderr = open(os.devnull, "w")


@contextmanager
def signals_end_the_command() -> Iterator[None]:
    """SIGTERM raises Terminated and SIGINT KeyboardInterrupt for the command's span. SIGINT's handler is installed
    too, not left to Python: a process started with SIGINT ignored (a script's background job, a test runner's
    child) keeps it ignored, so `kill -INT` ended training (whose own handlers catch it) but not validation."""
    def terminate(signum, frame):
        raise Terminated(signum)

    CONTINUE_WITH.clear()
    try:
        previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, terminate),
                    signal.SIGINT: signal.signal(signal.SIGINT, signal.default_int_handler)}
    except ValueError:  # not the main thread: signals stay as they are
        yield
        return
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def say(line: str, code: int) -> int:
    """`line` on stderr (nothing if stderr is gone), and the exit code."""
    try:
        print(line, file=sys.stderr, flush=True)
    except (BrokenPipeError, OSError, ValueError):
        pass
    return code


def ending_of(exc: BaseException, command: str) -> int:
    """The exit code for an exception that ended the command (after the line it says, if any)."""
    if isinstance(exc, SystemExit):
        raise exc  # argparse's --help and usage errors end as they always have
    hint = f"; {CONTINUE_WITH[0]}" if CONTINUE_WITH else ""
    if isinstance(exc, KeyboardInterrupt):
        return say(f"error: interrupted{hint}", 128 + signal.SIGINT)
    if isinstance(exc, Terminated):
        return say(f"error: interrupted by {signal.Signals(exc.signum).name}{hint}", 128 + exc.signum)
    if isinstance(exc, BrokenPipeError) or _is_a_closed_pipe(exc):
        _silence_stdout()
        return 128 + signal.SIGPIPE
    refused = path_refused(exc)
    if refused is not None:
        return say(f"error: {refused}", 2)
    stopped_by = worker_signal(exc)
    if stopped_by in (signal.SIGTERM, signal.SIGINT):  # its data workers got the signal that stops this process
        return say(f"error: interrupted by {stopped_by.name}{hint}", 128 + stopped_by)
    limit = machine_limit(exc)
    if limit is not None:
        return say(f"error: {limit}", 1)
    if out_of_memory(exc):
        return say(f"error: out of memory ({first_line(exc)}): lower --micro-batch-size (or --batch-size), "
                   "--replicas or --pipeline-num-parallel", 1)
    from cnns.parallel.world import launched, peer_failure

    line = peer_failure(exc) if launched() and isinstance(exc, Exception) else None
    if line is not None:
        return say(f"error: {line}", 1)
    return say(f"error: {type(exc).__name__}: {first_line(exc)} at {_innermost_frame(exc)} (a bug in cnns {command}; "
               f"the traceback is in {_write_traceback(exc)})", 1)


def path_refused(exc: BaseException) -> str | None:
    """The line for a path the system will not even look up (a name or a path longer than the file system takes,
    links that loop), or None. The user's path, never cnns's: it fails at the first look, before anything is
    written, wherever a command first looks at that path, so it is named here once for every command."""
    if not (isinstance(exc, OSError) and exc.errno in (errno.ENAMETOOLONG, errno.ELOOP) and exc.filename):
        return None
    path = os.fsdecode(exc.filename)
    path = path if len(path) <= 120 else path[:117] + "..."
    if exc.errno == errno.ELOOP:
        return f"{path}: too many levels of symbolic links"
    try:
        name_max, path_max = os.pathconf("/", "PC_NAME_MAX"), os.pathconf("/", "PC_PATH_MAX")
    except (OSError, ValueError):
        name_max, path_max = 255, 4096
    return (f"{path}: a name longer than the file system takes (at most {name_max} bytes a folder or file "
            f"name, {path_max} a path): choose a shorter path")


def worker_signal(exc: BaseException) -> signal.Signals | None:
    """The signal that killed a DataLoader worker, from torch's RuntimeError ("DataLoader worker (pid 12) is killed
    by signal: Terminated."), or None for any other exception."""
    text = str(exc)
    if not (isinstance(exc, RuntimeError) and "DataLoader worker" in text and "killed by signal: " in text):
        return None
    name = text.split("killed by signal: ", 1)[1].split(".")[0].strip()
    return next((number for number in signal.Signals if signal.strsignal(number) == name), None)


def machine_limit(exc: BaseException) -> str | None:
    """The line for a limit of the machine a command ran into, naming what changes it, or None: shared memory
    (/dev/shm, where data workers hand their batches over: Docker gives a container 64 MB), open files."""
    text = str(exc)
    # First: torch says "shared memory" too when the descriptors ran out while it opened a shared batch.
    if (isinstance(exc, OSError) and exc.errno == errno.EMFILE) or "Too many open files" in text or (
            "received 0 items of ancdata" in text):
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        return (f"too many open files (this process may open {soft}): raise the limit (ulimit -n) or lower "
                "--pipeline-num-parallel")
    if worker_signal(exc) == signal.SIGKILL:  # nothing in cnns sends it: the kernel's out-of-memory killer, or a user
        return ("a data-loading worker was killed (SIGKILL: most often the kernel's out-of-memory killer): lower "
                "--pipeline-num-parallel or --micro-batch-size (or --batch-size), or give the machine more memory")
    shared = worker_signal(exc) == signal.SIGBUS or (isinstance(exc, (RuntimeError, OSError)) and (
        "shared memory" in text or ("/torch_" in text and "No space left on device" in text)))
    if shared:
        return (f"out of shared memory ({_shared_memory_room()}), where data-loading workers hand their batches "
                "over: lower --pipeline-num-parallel or --micro-batch-size (or --batch-size), or give the machine "
                "more (a Docker container: docker run --shm-size=8g)")
    return None


def _shared_memory_room() -> str:
    """/dev/shm's free and whole size in words, or where it cannot be looked at, its name."""
    try:
        status = os.statvfs("/dev/shm")
    except OSError:
        return "/dev/shm"
    from cnns.bounded_reads import describe_size

    return (f"/dev/shm has {describe_size(status.f_bavail * status.f_frsize)} free of "
            f"{describe_size(status.f_blocks * status.f_frsize)}")


def out_of_memory(exc: BaseException) -> bool:
    """MemoryError, torch's OutOfMemoryError (CUDA), or the CPU allocator's failure (a RuntimeError of its own)."""
    if isinstance(exc, MemoryError):
        return True
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(exc, getattr(torch, "OutOfMemoryError", ())):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text.lower())


def _is_a_closed_pipe(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno == errno.EPIPE  # raised as a plain OSError by some writers


def _silence_stdout() -> None:
    """The reader is gone: whatever is still buffered for stdout goes to /dev/null, so the interpreter's last flush
    does not raise again on the way out."""
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
        os.close(null)
    except (OSError, ValueError, AttributeError):
        pass


def _innermost_frame(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return "an unknown place"
    frame = frames[-1]
    return f"{os.path.basename(frame.filename)}:{frame.lineno}"


def _write_traceback(exc: BaseException) -> str:
    """A new file holding the whole traceback; its path (or where it could not go)."""
    try:
        fd, path = tempfile.mkstemp(prefix="cnns-traceback-", suffix=".txt")
        with os.fdopen(fd, "w") as file:
            file.write("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
        return path
    except OSError as error:
        return f"nowhere: {error.strerror or error}"
