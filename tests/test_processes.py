"""The suite's own guard against hanging: tests/processes.py kills a child and everything it started."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

import processes

# A child that starts a grandchild in a session of its own (as torchrun's agent starts its workers),
# prints the grandchild's pid and then waits for ever.
SPAWNER = ("import subprocess, sys, time; "
           "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True); "
           "print(g.pid, flush=True); time.sleep(600)")


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead, only not yet collected
    except OSError:
        return False


def test_a_timeout_kills_the_child_and_the_grandchild_in_its_own_session():
    process = processes.start([sys.executable, "-c", SPAWNER], stdout=subprocess.PIPE, text=True)
    grandchild = int(processes.read_line(process.stdout, time.monotonic() + 60))
    assert alive(grandchild) and grandchild in processes.family(process.cnns_tag)
    with pytest.raises(pytest.fail.Exception, match="did not finish within 1 s"):
        processes.communicate(process, timeout=1)
    deadline = time.monotonic() + 10
    while alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(grandchild) and process.poll() is not None


def test_a_line_that_never_comes_fails_at_the_deadline_instead_of_blocking():
    process = processes.start([sys.executable, "-c", "import time; time.sleep(600)"], stdout=subprocess.PIPE)
    started = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match="no complete line"):
        processes.read_line(process.stdout, started + 1.5)
    assert time.monotonic() - started < 10
    processes.kill_tree(process)
    assert process.poll() is not None


def test_run_returns_what_the_child_printed_and_its_exit_code():
    out = processes.run([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"],
                        text=True, timeout=60)
    assert (out.returncode, out.stdout, out.stderr) == (3, "out\n", "err\n")
    assert os.environ.get(processes.TAG) is None  # the tag is the child's, not this process's


def test_the_family_follows_parent_links_where_the_environment_cannot_be_read(monkeypatch):
    """A process whose /proc environment reads empty (as one between fork and exec can) is still found, as
    the child of a tagged one: the guard against hanging must not miss a grandchild."""
    process = processes.start([sys.executable, "-c", SPAWNER], stdout=subprocess.PIPE, text=True)
    grandchild = int(processes.read_line(process.stdout, time.monotonic() + 60))
    real_read_bytes = processes.Path.read_bytes

    def unreadable_grandchild(path):
        return b"" if path == processes.Path(f"/proc/{grandchild}/environ") else real_read_bytes(path)

    monkeypatch.setattr(processes.Path, "read_bytes", unreadable_grandchild)
    assert set(processes.family(process.cnns_tag)) == {process.pid, grandchild}
    monkeypatch.undo()
    processes.kill_tree(process)
    deadline = time.monotonic() + 10
    while alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(grandchild)
