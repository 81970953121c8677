"""The tools' own options (`cnns benchmark`, `profile`, `bench-data`, `predict`, `export`, `plot`) declare their
domains as the training options do (`cnns.config.table.Domain`), and a value outside one is one line naming the
option, exit 2, before the tool reads or writes anything. The options come from the tools' parsers, so a new
numeric option without a domain fails the first test."""

from __future__ import annotations

import math

import pytest

from cnns.cli import inference, measure, plot, run_script
from cnns.config.table import domain_of

# command -> (its parser, the other arguments it needs to get as far as its options' check)
TOOLS = {
    "benchmark": (measure.benchmark_parser, []),
    "profile": (measure.profile_parser, ["--benchmark", "resnet20-cifar10-train"]),
    "bench-data": (measure.bench_data_parser, []),
    "predict": (inference.predict_parser, ["image.jpg", "--restore-path", "no-such-run"]),
    "export": (inference.export_parser, ["--restore-path", "no-such-run", "--format", "onnx", "--out", "m.onnx"]),
    "plot": (plot._parser, ["no-such-run"]),
}


def _numeric(parser) -> list:
    return [action for action in parser._actions
            if action.option_strings and (domain_of(action) is not None or action.type in (int, float))]


NUMERIC = [(command, action.option_strings[0]) for command, (parser, _) in TOOLS.items()
           for action in _numeric(parser())]


def test_every_numeric_tool_option_declares_its_domain():
    assert len(NUMERIC) >= 12  # the enumeration itself: one that found nothing would pass below
    undeclared = [f"{command} {action.option_strings[0]}" for command, (parser, _) in TOOLS.items()
                  for action in _numeric(parser()) if domain_of(action) is None]
    assert not undeclared, f"tool options taking a number without a domain: {undeclared}"


def _outside(domain) -> list[str]:
    low, high = domain.bounds
    values = [low - 1] if domain.within[0] == "[" else [low]
    if domain.within[-1] == "]":
        values.append(high + 1)
    return [str(int(v)) if domain.kind is int else repr(float(v)) for v in values if math.isfinite(v)]


@pytest.mark.parametrize("command, flag", NUMERIC)
def test_a_tool_option_outside_its_domain_is_one_line_and_exit_2(command, flag, tmp_path, capfd, monkeypatch):
    monkeypatch.chdir(tmp_path)
    parser, needed = TOOLS[command]
    domain = domain_of(parser()._option_string_actions[flag])
    for value in _outside(domain):
        code = run_script(command, [*needed, f"{flag}={value}"])
        err = capfd.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and flag in err[0] and domain.phrase in err[0], (value, err)
    assert list(tmp_path.iterdir()) == []  # nothing written, not even an output folder
