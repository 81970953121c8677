"""Every way a command can end is an exit code and at most one line (`cnns.cli.endings`, issue 52): a reader that
went away, closed standard streams, running out of memory, a bug, a signal. Pipes and closed descriptors with real
processes; the mapping of each exception through `cnns.cli.run_script` itself."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import processes
import scripts

QUICK = ("--config", "quickstart", "--no-validation", "--ckpts-per-epoch", "0")
TIMEOUT_S = 240


def test_a_reader_that_goes_away_ends_training_quietly_with_128_plus_sigpipe(tmp_path):
    """`train.py ... | head -1`: the pipe breaks at the next printed line; no traceback, no line, 141."""
    process = processes.start([sys.executable, str(scripts.ROOT / "train.py"), *QUICK, "--iterations", "2000",
                               "--log-freq", "1", "--logs-path", str(tmp_path / "run")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    first = process.stdout.readline()
    process.stdout.close()  # head -1 has what it wanted
    _, err = processes.communicate(process, timeout=TIMEOUT_S)
    assert first.startswith(b" Saving to")
    assert process.returncode == 128 + signal.SIGPIPE and err == b"", err[-3000:]


def test_a_run_with_stdout_and_stderr_closed_finishes_and_exits_0(tmp_path):
    """`train.py ... >&- 2>&-`: nothing to print to, and no file the run opens takes descriptor 1 or 2."""
    folder = tmp_path / "run"
    command = " ".join([sys.executable, str(scripts.ROOT / "train.py"), *QUICK, "--iterations", "3",
                        "--logs-path", str(folder)])
    out = processes.run(["sh", "-c", f"{command} >&- 2>&-"], cwd=tmp_path, timeout=TIMEOUT_S,
                        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0
    assert (folder / "ckpt-3.pt").is_file()
    assert "Saving to" in (folder / "log.txt").read_text()  # the log got its lines, not a stray copy of stdout


def raising(exc: BaseException):
    def command(argv):
        raise exc
    return command


@pytest.mark.parametrize("exc, code, words", [
    (MemoryError(), 1, "error: out of memory"),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: you tried to "
                  "allocate 822083584000 bytes"), 1, "error: out of memory ([enforce fail"),
    (KeyboardInterrupt(), 130, "error: interrupted"),
], ids=["MemoryError", "the CPU allocator", "SIGINT"])
def test_each_ending_is_one_line_and_its_exit_code(monkeypatch, capfd, exc, code, words):
    import cnns.cli

    monkeypatch.setattr(cnns.cli, "_dispatch", lambda command: raising(exc))
    out = scripts.run_here(capfd, "train.py", expect=code)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(words), out.stderr
    assert code != 1 or lines[0].endswith("lower --micro-batch-size (or --batch-size), --replicas or "
                                          "--pipeline-num-parallel")


def test_a_signal_outside_training_ends_the_command_with_128_plus_its_number(monkeypatch, capfd):
    import cnns.cli

    def terminated(argv):
        os.kill(os.getpid(), signal.SIGTERM)  # a real signal, delivered inside the command
        raise AssertionError("the signal did not end the command")

    monkeypatch.setattr(cnns.cli, "_dispatch", lambda command: terminated)
    out = scripts.run_here(capfd, "validation.py", expect=128 + signal.SIGTERM)
    assert out.stderr.strip().splitlines() == ["error: interrupted by SIGTERM"]


def test_sigint_ends_the_command_even_where_the_process_started_with_it_ignored(monkeypatch, capfd):
    """A script's background job (or a test runner's child) starts with SIGINT ignored; Python leaves it so, and
    `kill -INT` then did nothing outside training. The command installs Python's handler itself."""
    import cnns.cli

    def interrupted(argv):
        os.kill(os.getpid(), signal.SIGINT)  # a real signal, delivered inside the command
        raise AssertionError("the signal did not end the command")

    monkeypatch.setattr(cnns.cli, "_dispatch", lambda command: interrupted)
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        out = scripts.run_here(capfd, "validation.py", expect=128 + signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN  # the command's handler went with it
    finally:
        signal.signal(signal.SIGINT, before)
    assert out.stderr.strip().splitlines() == ["error: interrupted"]


def test_a_bug_is_one_line_naming_its_place_and_a_file_with_the_whole_traceback(monkeypatch, capfd):
    import cnns.cli

    def buggy(argv):
        return {}["missing"]

    monkeypatch.setattr(cnns.cli, "_dispatch", lambda command: buggy)
    out = scripts.run_here(capfd, "train.py", expect=1)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: KeyError: 'missing' at test_endings.py:"), out.stderr
    traceback_file = Path(lines[0].split("the traceback is in ")[1].rstrip(")"))
    try:
        text = traceback_file.read_text()
        assert "Traceback (most recent call last)" in text and "def buggy" not in text and "KeyError" in text
        assert 'return {}["missing"]' in text
    finally:
        traceback_file.unlink()
