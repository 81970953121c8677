"""The tests' child processes, bounded: none can outlive its test or wait for ever.

Every process started through `run` or `start` carries a tag in its environment, which everything it
starts inherits (a launcher's workers, torchrun's agent and its workers, DataLoader workers), so
`kill_tree` finds the whole family in /proc even after a launcher died and its workers were
re-parented, or started sessions of their own. `run` kills the family when its timeout expires;
conftest's `reap_children` fixture kills, after every test, whatever `start` began and the test left
running (an assertion that failed before the test's own clean-up).
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest

TAG = "CNNS_TEST_PROCESS"
TIMEOUT_S = 600  # the default limit of one child process; tests that expect less give less
_started: dict[int, tuple[subprocess.Popen, str]] = {}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now, for a rendezvous or a process group."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tagged(kwargs: dict) -> str:
    tag = uuid.uuid4().hex
    kwargs["env"] = {**(kwargs.get("env") or os.environ), TAG: tag}
    return tag


def family(tag: str) -> list[int]:
    """Every live process whose environment holds the tag, and every descendant of one. The tag finds a
    family whose launcher died (its workers re-parented); the parent links find a process whose environment
    could not be read at that moment (one still starting, between fork and exec), so no member is missed."""
    marker = f"{TAG}={tag}".encode()
    tagged, parents = set(), {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            parents[pid] = _parent(entry)
            if marker in (entry / "environ").read_bytes().split(b"\0"):
                tagged.add(pid)
        except (OSError, ValueError, IndexError):  # gone, or its environment unreadable: its parent link stays
            continue
    found, frontier = set(tagged), list(tagged)
    while frontier:
        pid = frontier.pop()
        for child in (c for c, parent in parents.items() if parent == pid and c not in found):
            found.add(child)
            frontier.append(child)
    return sorted(found)


def _parent(entry: Path) -> int:
    """The parent pid from /proc/PID/stat (the field after the command name, which may hold spaces)."""
    return int(entry.joinpath("stat").read_text().rsplit(")", 1)[1].split()[1])


def kill_tree(process: subprocess.Popen) -> None:
    """SIGKILL the process and everything it started, then collect it."""
    _, tag = _started.pop(process.pid, (process, getattr(process, "cnns_tag", None)))
    pids = family(tag) if tag else []
    for pid in {*pids, process.pid}:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass


def start(argv: list[str], **kwargs) -> subprocess.Popen:
    """subprocess.Popen, tagged and registered: reaped after the test if it is still running."""
    tag = _tagged(kwargs)
    process = subprocess.Popen(argv, **kwargs)
    process.cnns_tag = tag
    _started[process.pid] = (process, tag)
    return process


def communicate(process: subprocess.Popen, timeout: float = TIMEOUT_S) -> tuple[str, str]:
    """process.communicate with a deadline: on expiry the family is killed and the test fails with
    the end of what it printed."""
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(process)
        out, err = process.communicate()
        pytest.fail(f"{' '.join(map(str, process.args))[:300]} did not finish within {timeout:.0f} s; it printed:\n"
                    f"{(out or '')[-2000:]}{(err or '')[-2000:]}")
    _started.pop(process.pid, None)
    return out, err


def run(argv: list[str], *, timeout: float = TIMEOUT_S, check: bool = False, capture_output: bool = True,
        **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run that kills the child and all it started when the timeout expires."""
    if capture_output:
        kwargs.setdefault("stdout", subprocess.PIPE)
        kwargs.setdefault("stderr", subprocess.PIPE)
    process = start(argv, **kwargs)
    out, err = communicate(process, timeout)
    if check and process.returncode:
        raise subprocess.CalledProcessError(process.returncode, argv, out, err)
    return subprocess.CompletedProcess(argv, process.returncode, out, err)


def read_line(stream, deadline: float) -> str:
    """The next line of a text pipe, or "" at its end; fails the test at the deadline (a child that
    prints nothing must not block the test in readline)."""
    # Byte by byte from the descriptor: a buffered reader could hold a line that select no longer sees.
    fd = stream.fileno()
    line = b""
    while not line.endswith(b"\n"):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            pytest.fail(f"no complete line within the deadline; got {line!r}")
        ready, _, _ = select.select([fd], [], [], min(remaining, 1.0))
        if ready:
            byte = os.read(fd, 1)
            if not byte:
                break
            line += byte
    return line.decode(errors="replace")


def reap() -> list[str]:
    """Kill what the test started and left running; the commands killed."""
    killed = []
    for process, _ in list(_started.values()):
        if process.poll() is None:
            killed.append(" ".join(map(str, process.args))[:200])
        kill_tree(process)  # also the family of one that ended but left workers behind
    return killed
