"""The net is for bugs: every command, fed the hostile inputs of tests/test_touch.py and the kinds of issue 62 (an
option outside its domain read back from a run, a checkpoint that is not one, a folder that vanished, a path the
system refuses), ends as a user's mistake or the machine's limit in one line (or runs), never in the line that
`cnns.cli.endings` keeps for a bug ("a bug in cnns"). A command that reaches the net here names a kind of input
that is not checked where it enters."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import pytest

import scripts
from test_touch import ITERATIONS, _bomb, _link, finished_run  # noqa: F401 (the fixture)
from test_worker_errors import jpeg_tree

NEWEST = f"ckpt-{ITERATIONS}.pt"


def _options(run: Path, **changes) -> None:
    options = json.loads((run / "arguments.json").read_text())
    options.update(changes)
    (run / "arguments.json").write_text(json.dumps(options))


def _unlink(path: Path) -> Path:
    path.unlink()
    return path


# Traps planted in a copy of a finished run; each returns the run folder a command is to be given.
RUN_TRAPS: dict[str, Callable[[Path, Path], Path]] = {
    "arguments.json cut short": lambda run, out: (
        (run / "arguments.json").write_bytes((run / "arguments.json").read_bytes()[:40]), run)[1],
    "arguments.json with --BN-decay 5": lambda run, out: (_options(run, BN_decay=5.0), run)[1],
    "arguments.json with --epochs 1e308": lambda run, out: (_options(run, epochs=1e308), run)[1],
    "arguments.json with a count as text": lambda run, out: (_options(run, micro_batch_size="32"), run)[1],
    "newest checkpoint cut short": lambda run, out: (
        (run / NEWEST).write_bytes((run / NEWEST).read_bytes()[:1000]), run)[1],
    "newest checkpoint a folder": lambda run, out: (_unlink(run / NEWEST).mkdir(), run)[1],
    "newest checkpoint a dangling link": lambda run, out: (_link(run / NEWEST, out / "gone.pt"), run)[1],
    "training.csv in a foreign encoding": lambda run, out: (
        (run / "training.csv").write_bytes((run / "training.csv").read_bytes() + b"\xff\xfe"), run)[1],
    "log.txt linked outside": lambda run, out: (_link(run / "log.txt", out / "precious.txt"), run)[1],
    "the run folder vanished": lambda run, out: (shutil.rmtree(run), run)[1],
    "a path too long for the system": lambda run, out: run / ("x" * 300),
    "a path with a byte that is not UTF-8": lambda run, out: (run.rename(run.parent / "run\udcff"),
                                                              run.parent / "run\udcff")[1],
}

# What each command that reads a run is given (RUN: the run folder), kept to what needs no compiler.
RUN_COMMANDS = {
    "validation.py": ["--restore-path", "RUN"],
    "restore.py": ["--restore-path", "RUN"],
    "weight_avg.py": ["--restore-path", "RUN", "--no-validation"],
    "plot": ["RUN"],
    "export": ["--restore-path", "RUN", "--format", "safetensors", "--out", "OUT/exported"],
    "predict": ["--restore-path", "RUN", "OUT/photo.jpg"],
}


def assert_not_the_net(out) -> None:
    errors = [line for line in out.stderr.splitlines() if line.startswith("error")]  # not a library's warnings
    assert "a bug in cnns" not in out.stderr and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert len(errors) <= 1, out.stderr[-3000:]


# inference_embedded.py compiles (AOTInductor, a minute on two cores) once what it reads is good: it is not given the
# traps that leave it something good to compile.
RUN_COMMANDS["inference_embedded.py"] = ["--restore-path", "RUN", "--iterations", "1",
                                         "--artefact-path", "OUT/model.pt2"]
COMPILING = {"inference_embedded.py"}
BEFORE_COMPILING = {"training.csv in a foreign encoding", "log.txt linked outside",  # not read
                    "newest checkpoint a folder", "newest checkpoint a dangling link"}  # the one before is used


@pytest.mark.parametrize("command", list(RUN_COMMANDS))
@pytest.mark.parametrize("trap", list(RUN_TRAPS))
def test_a_command_given_a_hostile_run_ends_as_a_mistake_not_a_bug(command, trap, finished_run, tmp_path, capfd):
    if command in COMPILING and trap in BEFORE_COMPILING:
        pytest.skip("a file the command does not read: it would compile and run")
    from test_tfrecord import colour_jpeg, colour_of

    run, outside = tmp_path / "run", tmp_path / "outside"
    shutil.copytree(finished_run, run)
    outside.mkdir()
    (outside / "precious.txt").write_text("a file no command may change\n")
    (outside / "photo.jpg").write_bytes(colour_jpeg(colour_of(1)))
    given = RUN_TRAPS[trap](run, outside)
    argv = [str(given) if arg == "RUN" else arg.replace("OUT", str(outside)) for arg in RUN_COMMANDS[command]]
    assert_not_the_net(scripts.run_here(capfd, command, *argv, cwd=tmp_path, expect=None))


def _a_file(tmp: Path) -> Path:
    (tmp / "file").write_text("not a folder\n")
    return tmp / "file"


# train.py's own inputs: where it writes, what it reads.
TRAIN_TRAPS: dict[str, Callable[[Path, Path], list[str]]] = {
    "--logs-path under a file": lambda tmp, data: ["--logs-path", str(_a_file(tmp) / "run")],
    "--log-dir a file": lambda tmp, data: ["--log-dir", str(_a_file(tmp))],
    "--logs-path too long": lambda tmp, data: ["--logs-path", str(tmp / ("x" * 300))],
    "--logs-path with a byte that is not UTF-8": lambda tmp, data: ["--logs-path", str(tmp / "run\udcff")],
    "--data-dir a dangling link": lambda tmp, data: (
        (tmp / "gone").symlink_to(tmp / "nowhere"), ["--data-dir", str(tmp / "gone")])[1],
    "--data-dir a file": lambda tmp, data: ["--data-dir", str(_a_file(tmp))],
    "--data-dir links that loop": lambda tmp, data: (
        (tmp / "a").symlink_to(tmp / "b"), (tmp / "b").symlink_to(tmp / "a"), ["--data-dir", str(tmp / "a" / "x")])[2],
    "--logs-path through links that loop": lambda tmp, data: (
        (tmp / "c").symlink_to(tmp / "d"), (tmp / "d").symlink_to(tmp / "c"), ["--logs-path", str(tmp / "c" / "run")])[2],
    "--config-path a folder": lambda tmp, data: ["--config", "quick", "--config-path", str(tmp)],
    "--config-path a YAML bomb": lambda tmp, data: ["--config", "quick", "--config-path", str(_bomb(tmp, tmp))],
    "--init-path a folder that is not a run": lambda tmp, data: ["--init-path", str(tmp)],
    "--init-path a dangling link": lambda tmp, data: (
        (tmp / "weights.pt").symlink_to(tmp / "nowhere.pt"), ["--init-path", str(tmp / "weights.pt")])[1],
}


@pytest.mark.parametrize("trap", list(TRAIN_TRAPS))
def test_train_given_a_hostile_input_ends_as_a_mistake_not_a_bug(trap, tmp_path, capfd):
    data = jpeg_tree(tmp_path / "tree")
    argv = ["--dataset", "imagenet", "--model-size", "18", "--image-size", "64", "--micro-batch-size", "2",
            "--iterations", "1", "--no-validation", "--data-dir", str(data), "--logs-path", str(tmp_path / "new")]
    argv += TRAIN_TRAPS[trap](tmp_path, data)
    assert_not_the_net(scripts.run_here(capfd, "train.py", *argv, cwd=tmp_path, expect=None))
