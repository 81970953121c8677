"""Graphcore's root scripts (train.py, validation.py, restore.py, weight_avg.py, inference_embedded.py) run by the
tests: in a child process, or in the test's own process.

A child interpreter imports torch, torch._dynamo, timm and torchvision again before its first line of work
(about 5 CPU seconds on a 2-core CI machine), which is most of what a small test run costs. So a test runs the
script's command here (`run_here`, through `cnns.cli.run_script`, which the root scripts call) unless the
process itself is what it checks: signals, exit codes of the interpreter, torchrun, environment variables read
at import, or a run that must start from a clean interpreter. A run of several processes (--replicas,
--shards) has this process as its launcher unless the launcher is what is checked: its workers are real
processes either way, started by torch's agent as a user's run starts them. tests/test_cli.py runs every
root script as a child at least once.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import sys
import threading
import uuid
import warnings
from contextlib import contextmanager
from pathlib import Path

import numpy
import pytest
import torch

import processes

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = {"train.py": "train", "validation.py": "validate", "restore.py": "restore", "weight_avg.py": "weight-avg",
            "inference_embedded.py": "infer"}


# A ResNet-8 trained to its plateau on 2,000 drawn shapes (conftest's `plateau_data`): 15 epochs, seeded. The
# 16.16-vs-32.32 comparison and `cnns predict` read the same 32.32 run (conftest's `plateau_run_32`), trained once:
# the tests that read it share this xdist group, so one test worker makes it.
ON_THE_PLATEAU_RUN = pytest.mark.xdist_group("plateau-run")
PLATEAU_EPOCHS = 15  # to the plateau (on a CPU that only emulates bfloat16 too: its convolutions run float32 kernels)


def plateau_options(precision: str, data: Path) -> tuple[str, ...]:
    """train.py's options of a plateau run in real `precision` (--half-dtype bfloat16: bfloat16 even on a CPU that
    only emulates it), validated once, at the end, on all 1,000 test images."""
    return ("--dataset", "cifar-10", "--data-dir", str(data), "--model-size", "8", "--precision", precision,
            "--half-dtype", "bfloat16", "--epochs", str(PLATEAU_EPOCHS), "--warmup-epochs", "1", "--lr-schedule",
            "cosine", "--optimiser", "momentum", "--base-learning-rate-exponent", "-9", "--ckpts-per-epoch", "0",
            "--logs-per-epoch", "1", "--seed", "11")


def run_child(script: str, *args: str, cwd: Path, expect: int | None = 0, env: dict[str, str] | None = None,
              timeout: float = processes.TIMEOUT_S) -> subprocess.CompletedProcess:
    """The root script in a new interpreter (one torch thread, as conftest sets for the suite)."""
    out = processes.run([sys.executable, str(ROOT / script), *args], capture_output=True, text=True, cwd=cwd,
                        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, timeout=timeout)
    if expect is not None:
        assert out.returncode == expect, _shown(out)
    return out


def run_here(capfd, script: str, *args: str, cwd: Path | None = None,
             expect: int | None = 0) -> subprocess.CompletedProcess:
    """The root script's command in this process (or a `cnns` command's, named as `cnns` takes it: "splits"): its
    exit code (an argparse error's too) and what reached file descriptors 1 and 2 (so a C library's message is
    seen, as a child's would be; warnings and log records too, which pytest would otherwise keep to itself)."""
    previous = os.getcwd()
    capfd.readouterr()
    with _torch_state_kept(), _children_bounded():
        try:
            if cwd is not None:
                os.chdir(cwd)
            code = _exit_code(COMMANDS.get(script, script), list(args))
        finally:
            os.chdir(previous)
    out, err = capfd.readouterr()
    done = subprocess.CompletedProcess([script, *args], code, out, err)
    if expect is not None:
        assert code == expect, _shown(done)
    return done


def train_here(*args: str, cwd: Path | None = None) -> None:
    """train.py's command in this process where a test needs only the run folder it writes (output not captured).
    With --replicas or --shards this process is the launcher: the workers it starts are real processes."""
    previous = os.getcwd()
    with _torch_state_kept(), _children_bounded():
        try:
            if cwd is not None:
                os.chdir(cwd)
            assert _exit_code("train", list(args)) == 0
        finally:
            os.chdir(previous)


@contextmanager
def _children_bounded(timeout: float = processes.TIMEOUT_S):
    """What a command run here starts (a launcher's workers, a probe's child) is bounded as a child of
    tests/processes.py is: it carries a tag in its environment, is SIGKILLed at the deadline (the command then
    fails as a run whose worker died does) and, if still running when the command returns, is killed and the
    test fails. (This process's own /proc environment, fixed at its start, never holds the tag.)"""
    tag = uuid.uuid4().hex
    os.environ[processes.TAG] = tag  # _torch_state_kept puts the environment back
    deadline = threading.Timer(timeout, _kill_family, (tag,))
    deadline.daemon = True
    deadline.start()
    try:
        yield
    finally:
        deadline.cancel()
        left = _kill_family(tag)
    assert not left, f"the command left processes running: {left}"


def _kill_family(tag: str) -> list[int]:
    pids = processes.family(tag)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return pids


def _exit_code(command: str, argv: list[str]) -> int:
    """The exit status an interpreter would end with: sys.exit(None) is 0, sys.exit("text") prints it and is 1."""
    from cnns.cli import run_script

    try:
        return run_script(command, argv)
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            return exit_.code or 0
        print(exit_.code, file=sys.stderr)
        return 1


# pytest shows every DeprecationWarning in a test; an interpreter that starts a root script ignores them.
_PYTEST_FILTERS = [("always", None, category, None, 0) for category in (DeprecationWarning, PendingDeprecationWarning)]


def _to_stderr(message, category, filename, lineno, file=None, line=None) -> None:
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


@contextmanager
def _torch_state_kept():
    """What a run sets for its whole process and the next test must not inherit: the global random streams
    (--seed seeds torch's, Python's and numpy's), torch's thread count, grad mode, default dtype and
    deterministic-kernel flags (set by --seed on a GPU), the environment, and the SIGINT and SIGTERM handlers.
    During the run, warnings and log records reach stderr as in a child: pytest would record warnings and
    take log records into its report, so a run's stray warning would not count as a second line on stderr."""
    threads = torch.get_num_threads()
    streams = torch.get_rng_state(), random.getstate(), numpy.random.get_state()
    flags = (torch.is_grad_enabled(), torch.get_default_dtype(), torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled(), torch.backends.cudnn.benchmark,
             torch.backends.cudnn.deterministic, torch.utils.deterministic.fill_uninitialized_memory)
    environment = dict(os.environ)
    handlers = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
    root = logging.getLogger()
    log_handlers = root.handlers[:]
    kept_filters = [item for item in warnings.filters if item not in _PYTEST_FILTERS]
    try:
        with warnings.catch_warnings():
            warnings.filters[:] = kept_filters
            warnings.showwarning = _to_stderr
            root.handlers = []  # logging's last resort then writes WARNING and above to stderr, as in a child
            try:
                yield
            finally:
                root.handlers = log_handlers
    finally:
        torch.set_num_threads(threads)
        torch.set_rng_state(streams[0])
        random.setstate(streams[1])
        numpy.random.set_state(streams[2])
        torch.set_grad_enabled(flags[0])
        torch.set_default_dtype(flags[1])
        torch.use_deterministic_algorithms(flags[2], warn_only=flags[3])
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = flags[4], flags[5]
        torch.utils.deterministic.fill_uninitialized_memory = flags[6]
        if dict(os.environ) != environment:
            os.environ.clear()
            os.environ.update(environment)
        for number, handler in handlers.items():
            if signal.getsignal(number) is not handler and handler is not None:
                signal.signal(number, handler)


def _shown(out: subprocess.CompletedProcess) -> str:
    return f"exit {out.returncode}\nstdout: {out.stdout[-3000:]}\nstderr: {out.stderr[-3000:]}"
