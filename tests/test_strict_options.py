"""An option is exactly what was typed, or it is refused (issue 72, kind 1).

Every parser the package builds takes no prefix of an option (argparse's allow_abbrev) and names the nearest one;
the command line's values replace configs.yml's, alternatives included, so nothing derived from a replaced value
survives; a configs.yml key that is no option is an error naming the nearest."""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

import pytest

import scripts

from cnns.cli import COMMANDS, command_parsers, parse_options
from cnns.cli.parsing import resolved_training_options
from cnns.config import load_named_config
from cnns.config.strict_parser import StrictParser
from cnns.config.table import build_parser

SRC = Path(__file__).resolve().parents[1] / "src" / "cnns"
SCRIPTS = ("train", "validate", "restore", "weight-avg", "infer")


def every_parser() -> dict[str, argparse.ArgumentParser]:
    """Every command's parser, Graphcore's five scripts' (the root scripts read these), and bench's stand-alone one."""
    from cnns.bench import passes

    parsers = {f"cnns {name}": parser for name, parser in command_parsers().items()}
    parsers.update({f"{script} script": build_parser(script) for script in SCRIPTS})
    built = []
    original = StrictParser.parse_args

    def keep(self, *args, **kwargs):  # the stand-alone script builds its parser inside main(): catch it there
        built.append(self)
        raise SystemExit(0)

    StrictParser.parse_args = keep
    try:
        with pytest.raises(SystemExit):
            passes.main([])
    finally:
        StrictParser.parse_args = original
    parsers["python -m cnns.bench.passes"] = built[0]
    return parsers


PARSERS = every_parser()


def test_no_parser_is_built_but_the_strict_one():
    """Read every module: an argparse.ArgumentParser (or a subclass other than StrictParser) built anywhere would
    take prefixes again."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call):
                name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                if name == "ArgumentParser" or (name.endswith("Parser") and name not in ("StrictParser", "OneLineErrorParser")):
                    found.append(f"{path.relative_to(SRC.parent)}:{node.lineno} {name}(...)")
    assert not found, found
    assert set(command_parsers()) == set(COMMANDS)  # every command has its parser listed
    assert all(isinstance(parser, StrictParser) and not parser.allow_abbrev for parser in PARSERS.values())


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_no_prefix_of_any_option_is_taken(name):
    """For every long option of every parser, its name less its last letter (where that is no option itself) is an
    unrecognised argument, not the option: with allow_abbrev it would be taken, or demand the option's value."""
    parser = PARSERS[name]
    for action in parser._actions:
        action.required = False  # --restore-path and the like: only prefixes are under test
    # a positional's first choice where it has choices (cnns convert's source), else any word
    positionals = [sorted(action.choices)[0] if action.choices else "x"
                   for action in parser._actions if not action.option_strings]
    spellings = set(parser.option_strings())
    tried = 0
    for option in sorted(spellings):
        prefix = option[:-1]
        if not option.startswith("--") or len(prefix) < 4 or prefix in spellings:
            continue
        _, unknown = parser.parse_known_args([*positionals, prefix])
        assert unknown == [prefix], f"{name}: {prefix} was taken for {option}"
        tried += 1
    # every parser but `cnns models` (a pattern and --help alone) has long options to try
    assert tried >= (0 if name == "cnns models" else 3)


@pytest.mark.parametrize("command, argv, meant", [
    ("train.py", ["--sched", "cosine"], "--lr-schedule"),  # timm's spelling, once a prefix of --scheduling-algorithm
    ("train.py", ["--iteration", "3"], "--iterations"),
    ("validation.py", ["--validation-image", "8"], "--validation-images"),
    ("predict", ["x.jpg", "--restore-path", "r", "--top", "3"], "--top-k"),
    ("bench-data", ["--image", "8"], "--images"),
])
def test_an_unknown_option_is_one_line_naming_the_nearest(capfd, command, argv, meant):
    err = scripts.run_here(capfd, command, *argv, expect=2).stderr
    lines = err.strip().splitlines()
    assert len(lines) == 1 and f"unrecognized arguments: {argv[-2]}" in lines[0] and f"did you mean {meant}" in lines[0], err


# ----------------------------------------------------------------------------------------------
# The command line over configs.yml over the defaults

# A value for each option of train.py's mutually exclusive groups: every group is tried (a new group must add its
# options here, so that its precedence is tested).
ALTERNATIVE_VALUES = {"epochs": 3, "iterations": 20, "ckpts_per_epoch": 2, "epochs_per_ckpt": 1,
                      "batch_norm": True, "group_norm": True, "generated_data": True, "synthetic_data": True}


def _alternatives() -> list[tuple[str, str]]:
    pairs = []
    for group in build_parser("train")._mutually_exclusive_groups:
        dests = sorted({action.dest for action in group._group_actions})
        pairs += [(a, b) for a in dests for b in dests if a != b]
    return pairs


def _flag(parser: argparse.ArgumentParser, dest: str, value) -> list[str]:
    action = next(a for a in parser._actions if a.dest == dest and a.option_strings)
    return [action.option_strings[0]] if action.nargs == 0 else [action.option_strings[0], str(value)]


def _config(tmp_path: Path, values: dict) -> list[str]:
    import yaml

    path = tmp_path / "mine.yml"
    path.write_text(yaml.safe_dump({"mine": values}))
    return ["--config", "mine", "--config-path", str(path)]


@pytest.mark.parametrize("in_config, on_command_line", _alternatives())
def test_the_command_line_replaces_a_config_value_and_its_alternatives(tmp_path, in_config, on_command_line):
    assert {dest for pair in _alternatives() for dest in pair} <= set(ALTERNATIVE_VALUES)
    parser = build_parser("train")
    base = {"dataset": "cifar-10", "model_size": 8}
    argv = ["--generated-data"] if on_command_line != "synthetic_data" and in_config != "generated_data" else []
    argv += _flag(parser, on_command_line, ALTERNATIVE_VALUES[on_command_line])
    config = _config(tmp_path, {**base, in_config: ALTERNATIVE_VALUES[in_config]})
    values, _ = parse_options("train", config + argv)
    assert values[on_command_line] == ALTERNATIVE_VALUES[on_command_line]
    assert values[in_config] in (None, False), f"{in_config} from configs.yml survived {argv}"
    typed, _ = resolved_training_options("train", ["--dataset", "cifar-10", "--model-size", "8", *argv])
    resolved, _ = resolved_training_options("train", config + argv)
    differ = {k for k in typed if typed[k] != resolved.get(k) and k not in ("command", "config", "config_path", "seed")}
    assert not differ, {k: (typed[k], resolved[k]) for k in differ}


def test_iterations_over_a_configs_epochs_leave_no_warm_up_from_them():
    """The issue's example: resnet8_test gives 10 epochs (and the default 5 warm-up epochs); --iterations 20 is the
    run typed out, with no warm-up (warm-up needs --epochs), and --print-config shows one length."""
    options, _ = resolved_training_options("train", ["--config", "resnet8_test", "--iterations", "20",
                                                     "--generated-data"])
    config = load_named_config("resnet8_test")
    typed_out = []
    parser = build_parser("train")
    for key, value in config.items():
        if key != "epochs":
            typed_out += _flag(parser, key, value) if value is not False else ["--no-validation"]
    typed, _ = resolved_training_options("train", [*typed_out, "--iterations", "20", "--generated-data"])
    assert options["epochs"] is None and options["iterations"] == 20 and options["warmup_epochs"] == 0
    assert {k: v for k, v in options.items() if k not in ("command", "config", "seed")} == \
        {k: v for k, v in typed.items() if k not in ("command", "config", "seed")}
    epochs, _ = resolved_training_options("train", _config_of_iterations() + ["--epochs", "1", "--generated-data"])
    assert epochs["iterations"] is None and epochs["epochs"] == 1


def _config_of_iterations() -> list[str]:
    import tempfile

    import yaml

    path = Path(tempfile.mkdtemp()) / "iterations.yml"
    path.write_text(yaml.safe_dump({"short": {"dataset": "cifar-10", "model_size": 8, "iterations": 5}}))
    return ["--config", "short", "--config-path", str(path)]


def test_a_config_key_that_is_no_option_is_one_line_naming_the_nearest(capfd, tmp_path):
    config = _config(tmp_path, {"dataset": "cifar-10", "lr_schedul": "cosine"})
    err = scripts.run_here(capfd, "train.py", *config, "--print-config", expect=2).stderr
    assert "IPU-only" not in err and len(err.strip().splitlines()) == 1
    assert "lr_schedul is not an option of cnns nor of Graphcore's application; did you mean lr_schedule" in err
    # An option of another of the scripts (validation.py's --repeat) is named as unused, not as IPU-only.
    _, notices = parse_options("train", _config(tmp_path, {"dataset": "cifar-10", "repeat": 3}))
    assert notices == ["not options of this script, not used: repeat (configs.yml)"]
