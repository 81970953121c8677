"""What a command may touch (`cnns.safe_writes`' rule, issue 52), as a table of hostile inputs over the commands.

Each case builds its trap in a copy of a finished run (an existing run folder, a symbolic link planted in it, a
checkpoint named as an output, a YAML bomb, an output over an input), runs the command as a user would, and checks
what every case must hold: the exit code, exactly one line on stderr with the case's words and no traceback, and
every file that existed before byte for byte the same (the run folder's and the files outside it a link points to).
Removing any one guard turns its row red: the rows name the guard they hold.
"""

from __future__ import annotations

import hashlib
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import scripts

ITERATIONS = 4


@pytest.fixture(scope="module")
def finished_run(shapes_cifar10, tmp_path_factory) -> Path:
    """A ResNet-8 run of 4 updates with checkpoints at 0 and 4 and its validation.csv."""
    data = shapes_cifar10("touch", train=64, test=16, seed=5)
    folder = tmp_path_factory.mktemp("touch") / "run"
    scripts.train_here("--dataset", "cifar-10", "--data-dir", str(data), "--model-size", "8", "--micro-batch-size", "16",
                       "--iterations", str(ITERATIONS), "--ckpts-per-epoch", "1", "--logs-path", str(folder))
    return folder


@dataclass(frozen=True)
class Case:
    """A command line against a trap: `prepare(run, outside)` plants it (run: a copy of the finished run; outside: a
    folder beside it holding a file a link may point to) and returns the command's arguments."""
    command: str
    prepare: Callable[[Path, Path], list[str]]
    words: str  # in the one line on stderr
    code: int = 2


def _data(run: Path) -> str:
    import json

    return json.loads((run / "arguments.json").read_text())["data_dir"]


def _append_bytes(path: Path, data: bytes) -> None:
    with open(path, "ab") as file:
        file.write(data)


def _link(path: Path, target: Path) -> None:
    path.unlink(missing_ok=True)
    path.symlink_to(target)


def _bomb(run: Path, outside: Path) -> Path:
    levels = ['a: &a ["x","x","x","x","x","x","x","x","x","x"]']
    levels += [f"{chr(98 + i)}: &{chr(98 + i)} [{','.join([f'*{chr(97 + i)}'] * 10)}]" for i in range(8)]
    path = outside / "bomb.yml"
    path.write_text("\n".join(levels) + "\nquick: {epochs: *i}\n")
    return path


CASES = {
    # A new run never writes into a folder that holds another run (commands/checks.check_holds_no_run).
    "train.py over a finished run": Case("train.py", lambda run, out: [
        "--dataset", "cifar-10", "--data-dir", _data(run), "--model-size", "8", "--iterations", "2",
        "--logs-path", str(run)], "holds another run"),
    "validation.py's random model over a finished run": Case("validation.py", lambda run, out: [
        "--dataset", "cifar-10", "--model-size", "8", "--generated-data", "--logs-path", str(run)],
        "holds another run"),
    # An artefact cache replaces only what cnns compiled (commands/infer.claim_artefact).
    "inference_embedded.py --force-recompile over a checkpoint": Case("inference_embedded.py", lambda run, out: [
        "--restore-path", str(run), "--artefact-path", str(run / f"ckpt-{ITERATIONS}.pt"), "--force-recompile",
        "--iterations", "1"], "is not a package cnns compiled"),
    # An output never replaces what the command reads, nor an existing file unasked (files.check_output).
    "cnns export over the checkpoint it reads": Case("export", lambda run, out: [
        "--restore-path", str(run), "--format", "pt2", "--out", str(run / f"ckpt-{ITERATIONS}.pt"), "--overwrite"],
        "which this command reads"),
    "cnns plot over a run's CSV": Case("plot", lambda run, out: [str(run), "--out", str(run / "validation.csv")],
                                       "which this command reads"),
    "cnns bench-data --json over an existing file": Case("bench-data", lambda run, out: [
        "--data-dir", _data(run), "--batches", "1", "--json", str(out / "precious.txt")], "exists: give --overwrite"),
    # No write in a run folder follows a link the command did not make (files.may_write, runlock's O_NOFOLLOW).
    "restore.py with training.csv linked outside": Case("restore.py", lambda run, out: (
        _link(run / "training.csv", out / "precious.txt"), ["--restore-path", str(run)])[1], "is a symbolic link"),
    "validation.py with validation.csv linked outside": Case("validation.py", lambda run, out: (
        (run / f"ckpt-{ITERATIONS}.pt").rename(run / f"ckpt-{ITERATIONS + 4}.pt"),
        _link(run / "validation.csv", out / "precious.txt"), ["--restore-path", str(run)])[2], "is a symbolic link"),
    "validation.py with .lock linked outside": Case("validation.py", lambda run, out: (
        _link(run / ".lock", out / "precious.txt"), ["--restore-path", str(run)])[1], "is a symbolic link"),
    "weight_avg.py with log.txt linked outside": Case("weight_avg.py", lambda run, out: (
        _link(run / "log.txt", out / "precious.txt"), ["--restore-path", str(run), "--no-validation"])[1],
        "is a symbolic link"),
    # Every file read back from a run folder is one line, before anything is written (runlog.read_run_text).
    "restore.py with training.csv in a foreign encoding": Case("restore.py", lambda run, out: (
        _append_bytes(run / "training.csv", b"\xff\xfe"), ["--restore-path", str(run)])[1], "is not UTF-8 text"),
    "validation.py with validation.csv in a foreign encoding": Case("validation.py", lambda run, out: (
        _append_bytes(run / "validation.csv", b"\xff\xfe"), ["--restore-path", str(run)])[1], "is not UTF-8 text"),
    "validation.py with arguments.json cut short": Case("validation.py", lambda run, out: (
        (run / "arguments.json").write_bytes((run / "arguments.json").read_bytes()[:40]),
        ["--restore-path", str(run)])[1], "is not valid JSON"),
    # Data files are read bounded: a regular file within --max-file-size, or one line (cnns.bounded_reads).
    "cnns predict on an image that is a link to /dev/zero": Case("predict", lambda run, out: (
        (out / "photo.jpg").symlink_to("/dev/zero"), ["--restore-path", str(run), str(out / "photo.jpg")])[1],
        "not a regular file"),
    "cnns splits with a YAML bomb as its configuration file": Case("splits", lambda run, out: [
        "--config", "quick", "--config-path", str(_bomb(run, out))], "billion laughs"),
    # Every input bounded before anything is written (config/files.read_yaml).
    "cnns benchmark with a YAML bomb as its list": Case("benchmark", lambda run, out: [
        "--spec", str(_bomb(run, out)), "--output-dir", str(out / "results")], "billion laughs"),
    "train.py with a YAML bomb as its configuration file": Case("train.py", lambda run, out: [
        "--config", "quick", "--config-path", str(_bomb(run, out)), "--logs-path", str(out / "new")], "billion laughs"),
}


def digest(*folders: Path) -> dict[str, str]:
    """Every file below the folders (links as links), by content."""
    found = {}
    for folder in folders:
        for path in sorted(folder.rglob("*")):
            if path.is_symlink():
                found[str(path)] = "-> " + os.readlink(path)
            elif path.is_file():
                found[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


@pytest.mark.parametrize("name", list(CASES))
def test_a_hostile_input_is_one_line_and_changes_no_existing_file(finished_run, tmp_path, capfd, name):
    case = CASES[name]
    run, outside = tmp_path / "run", tmp_path / "outside"
    shutil.copytree(finished_run, run)
    outside.mkdir()
    (outside / "precious.txt").write_text("a file this command must never change\n")
    args = case.prepare(run, outside)
    before = digest(run, outside)
    out = scripts.run_here(capfd, case.command, *args, cwd=tmp_path, expect=case.code)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and case.words in lines[0] and lines[0].startswith("error: "), out.stderr[-3000:]
    assert "Traceback" not in out.stderr + out.stdout
    assert digest(run, outside) == before


# ----------------------------------------------------------------------------------------------
# What a command exists to make is its own: it refreshes it on a finished run, and changes nothing else.

OWN_OUTPUTS = {
    # (command, arguments after the run folder, the files of the run it may change)
    "cnns plot RUN": ("plot", [], {"training.png"}),
    "cnns plot RUN --overwrite": ("plot", ["--overwrite"], {"training.png"}),
    "cnns plot RUN --out RUN/training.png --overwrite": ("plot", ["--out", "{run}/training.png", "--overwrite"],
                                                         {"training.png"}),
}


@pytest.mark.parametrize("name", list(OWN_OUTPUTS))
def test_a_command_refreshes_what_it_exists_to_make_and_nothing_else(finished_run, tmp_path, capfd, name):
    command, extra, changes = OWN_OUTPUTS[name]
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    before = digest(run)
    assert all(str(run / file) in before for file in changes)  # it is there to be refreshed
    scripts.run_here(capfd, command, str(run), *(arg.format(run=run) for arg in extra), cwd=tmp_path)
    after = digest(run)
    assert {path for path in before if after.get(path) != before[path]} <= {str(run / file) for file in changes}
    assert set(after) == set(before)


# ----------------------------------------------------------------------------------------------
# Every option's domain (`cnns.config.table.Domain`, declared once with the option): a value outside it is one line
# and exit 2 before anything is written, whichever script reads it; a value inside it resolves to a run torch takes,
# or is refused in one line that names the option. The options come from the table, so an option given a domain is
# tested without a word here, and one that takes a number without declaring a domain fails the first test.

SCRIPTS = {"train.py": "train", "validation.py": "validate", "weight_avg.py": "weight-avg",
           "inference_embedded.py": "infer"}


def _numeric_actions() -> dict[str, tuple[str, object]]:
    """flag -> (the first script that takes it, its argparse action), for every option of every script that
    takes a number (one, or a list)."""
    from cnns.config.table import build_parser

    found: dict[str, tuple[str, object]] = {}  # by dest: an option's first spelling (--micro-batch-size) names it
    for script, name in SCRIPTS.items():
        for action in build_parser(name)._actions:
            if action.option_strings and action.nargs != 0 and action.dest != "help":
                found.setdefault(action.dest, (script, action))
    return {action.option_strings[0]: (script, action) for script, action in found.values() if _takes_a_number(action)}


def _takes_a_number(action) -> bool:
    from cnns.config.table import domain_of

    return domain_of(action) is not None or action.type in (int, float)


NUMERIC = _numeric_actions()


def test_every_option_that_takes_a_number_declares_its_domain():
    from cnns.config.table import domain_of

    assert len(NUMERIC) > 40  # the reader itself: an enumeration that found nothing would pass below
    undeclared = [flag for flag, (_, action) in NUMERIC.items() if domain_of(action) is None and not action.choices]
    assert not undeclared, f"options taking a number without a domain in the options table: {undeclared}"


def _open_ends(domain) -> tuple[bool, bool]:
    """Whether each end is left out: an unbounded end stands for the largest value torch holds, which is in."""
    low_text, high_text = (end.strip() for end in domain.within[1:-1].split(","))
    return domain.within[0] == "(" and low_text != "-inf", domain.within[-1] == ")" and high_text != "inf"


def _outside(domain) -> list[str]:
    """Values just outside `domain` at each end (an unbounded one past the largest int64 or float32), not finite."""
    low, high = domain.bounds
    open_low, open_high = _open_ends(domain)
    values: list[float] = []
    values.append(low if open_low else (low - 1 if domain.kind is int else math.nextafter(low, -math.inf)))
    if domain.kind is int:
        values.append(high if open_high else high + 1)
        return [str(int(value)) for value in values]
    values.append(high if open_high else math.nextafter(high, math.inf))
    return [repr(float(value)) for value in values] + ["nan", "inf", "-inf"]


def _inside(domain):
    """Values in `domain`, its ends among them (hypothesis draws the bounds first)."""
    low, high = domain.bounds
    open_low, open_high = _open_ends(domain)
    if domain.kind is int:
        return st.integers(int(low) + open_low, int(high) - open_high)
    return st.floats(low, high, exclude_min=open_low, exclude_max=open_high, allow_nan=False, allow_infinity=False)


def _base(script: str, run: Path, tmp: Path) -> list[str]:
    """A command line of `script` that would write only what `tmp` holds (a new run under it)."""
    if script == "train.py":
        return ["--dataset", "cifar-10", "--generated-data", "--model-size", "8", "--iterations", "1",
                "--logs-path", str(tmp / "new")]
    return ["--restore-path", str(run)]


@pytest.mark.parametrize("flag", sorted(NUMERIC))
def test_a_value_outside_an_options_domain_is_one_line_exit_2_and_writes_nothing(flag, finished_run, tmp_path, capfd):
    from cnns.config.table import domain_of

    script, action = NUMERIC[flag]
    domain = domain_of(action)
    if domain is None:
        pytest.skip("a fixed set of choices, which argparse holds to")
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    before = digest(run)
    for value in _outside(domain):
        out = scripts.run_here(capfd, script, *_base(script, run, tmp_path), f"{flag}={value}", cwd=tmp_path,
                               expect=None)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1 and flag in lines[0], (value, out.stderr[-2000:])
        assert not (tmp_path / "new").exists() and digest(run) == before, value


def _restore_numeric() -> list[str]:
    """restore.py's own options that take a number (its parser is its own: the new pipeline layout)."""
    from cnns.config.table import build_parser

    return sorted(action.option_strings[0] for action in build_parser("restore")._actions
                  if action.option_strings and _takes_a_number(action))


@pytest.mark.parametrize("flag", _restore_numeric())
def test_restore_refuses_a_value_outside_its_options_domain_and_writes_nothing(flag, finished_run, tmp_path, capfd):
    from cnns.config.table import build_parser, domain_of

    action = build_parser("restore")._option_string_actions[flag]
    assert domain_of(action) is not None, f"{flag} of restore.py takes a number without a domain"
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    before = digest(run)
    for value in _outside(domain_of(action)):
        out = scripts.run_here(capfd, "restore.py", "--restore-path", str(run), f"{flag}={value}", cwd=tmp_path,
                               expect=None)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1 and flag in lines[0], (value, out.stderr[-2000:])
        assert digest(run) == before, value


TRAIN_NUMERIC = sorted(flag for flag, (script, action) in NUMERIC.items()
                       if script == "train.py" and not action.choices)


@pytest.mark.parametrize("flag", TRAIN_NUMERIC)
@given(data=st.data())
@settings(max_examples=6, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
def test_a_value_inside_an_options_domain_resolves_to_a_run_torch_takes_or_is_refused_naming_it(flag, data):
    """Resolved as train.py resolves it (no run folder yet): a configuration whose learning rate an optimiser takes
    and steps with, whose seed seeds torch and whose counts are counts; or one line that names the option."""
    import torch
    from cnns.cli.parsing import resolve_command_line
    from cnns.config.table import domain_of
    from cnns.errors import CnnsError
    from cnns.optim import OptimiserSpec, build_optimiser

    value = data.draw(_inside(domain_of(NUMERIC[flag][1])))
    try:
        cfg = resolve_command_line("train", ["--dataset", "cifar-10", "--generated-data", "--model-size", "8",
                                             f"{flag}={value!r}"]).config
    except CnnsError as error:
        assert flag in str(error) and "\n" not in str(error), str(error)
        return
    o, t = cfg.optim, cfg.train
    parameter = torch.nn.Parameter(torch.ones(3))
    optimiser = build_optimiser([parameter], OptimiserSpec(o.optimiser, o.learning_rate, **o.settings))
    parameter.grad = torch.ones(3)
    optimiser.step()
    assert torch.isfinite(parameter).all() or not math.isfinite(o.learning_rate)
    torch.Generator().manual_seed(t.seed if t.seed is not None else 0)
    assert t.micro_batch_size >= 1 and t.gradient_accumulation_count >= 1 and t.global_batch_size >= 1


def _trained_value(domain) -> str:
    """The value of `domain` a short run trains with: its upper end, or for an unbounded domain a small distance
    above its lower end (an unbounded count at its largest would train for ever)."""
    low, high = domain.bounds
    open_low, open_high = _open_ends(domain)
    top = min(high, max(low, 0) + 8)
    if domain.kind is int:
        return str(int(top) - (open_high and top == high))
    return repr(math.nextafter(top, -math.inf) if open_high and top == high else top)


@pytest.mark.parametrize("flag", TRAIN_NUMERIC)
def test_a_value_inside_an_options_domain_trains_or_is_refused_naming_it(flag, tmp_path, capfd):
    """One update with each option near the top of its domain: it trains, or one line that names the option, never
    the bug line (--label-smoothing 0.9999999 reached torch's own refusal: the true class then gets less than the
    others, a rule of the class count)."""
    from cnns.config.table import domain_of

    value = _trained_value(domain_of(NUMERIC[flag][1]))
    out = scripts.run_here(capfd, "train.py", "--dataset", "cifar-10", "--generated-data", "--model-size", "8",
                           "--micro-batch-size", "2", "--iterations", "1", "--no-validation", "--logs-path",
                           str(tmp_path / "run"), f"{flag}={value}", cwd=tmp_path, expect=None)
    lines = out.stderr.strip().splitlines()
    assert "a bug in cnns" not in out.stderr and "Traceback" not in out.stderr, (value, out.stderr[-2000:])
    assert out.returncode == 0 or (out.returncode == 2 and len(lines) == 1 and flag in lines[0]), (
        value, out.returncode, out.stderr[-2000:])
