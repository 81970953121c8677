"""Command line: `cnns <command>` and Graphcore's root scripts, the top floor of the package.

Every command's reader of sys.argv, and imported by nothing else in the package but `python -m cnns` (the run
lock reads the command line only to name its holder, and bench's two stand-alone scripts read their own). Every
command parses its command line into plain values (`cnns.cli.parsing` for Graphcore's options) and calls one entry point,
grouped by what the commands do: `cnns.cli.runs` (make and read run folders: train, restore, validate,
weight-avg), `cnns.cli.inference` (use a trained model: infer, predict, export), `cnns.cli.measure`
(benchmark, profile, bench-data, splits), `cnns.cli.plot` and `cnns.cli.convert` (small public image sets
written as CIFAR-10 binaries). A `CnnsError` anywhere becomes one line on
stderr and exit code 2.
"""

from __future__ import annotations

import os

# torch's C++ side logs each failed connection attempt of a distributed rendezvous (and the like)
# straight to stderr, before the Python exception that we turn into one line. Read when torch loads,
# so set before anything imports it; TORCH_CPP_LOG_LEVEL=INFO (or WARNING) brings them back.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
import sys
from typing import Callable

from cnns.cli import endings
from cnns.cli.parsing import parse_options, resolved_training_options
from cnns.errors import CnnsError, ConfigError, continue_with_nothing
from cnns.safe_writes import command_scope

COMMANDS = ("train", "validate", "restore", "weight-avg", "infer", "benchmark", "profile", "bench-data", "splits",
            "plot", "predict", "export", "models", "convert")


def _dispatch(command: str) -> Callable[[list[str]], int]:
    from cnns.cli import convert, inference, measure, models, plot, runs

    return {
        "train": runs.train_main,
        "validate": runs.validate_main,
        "restore": runs.restore_main,
        "weight-avg": runs.weight_avg_main,
        "infer": inference.infer_main,
        "predict": inference.predict_main,
        "export": inference.export_main,
        "benchmark": measure.benchmark_main,
        "profile": measure.profile_main,
        "bench-data": measure.bench_data_main,
        "splits": measure.splits_main,
        "plot": plot.plot_main,
        "models": models.models_main,
        "convert": convert.convert_main,
    }[command]


def command_parsers() -> dict:
    """Every command's argument parser, by command (each a `cnns.config.strict_parser.StrictParser`): what
    tests/test_strict_options.py holds to "an option is exactly what was typed"."""
    from cnns.cli import convert, inference, measure, models, plot
    from cnns.config import defaults
    from cnns.config.table import build_parser

    own = {"benchmark": measure.benchmark_parser, "profile": measure.profile_parser,
           "bench-data": measure.bench_data_parser, "plot": plot._parser, "predict": inference.predict_parser,
           "export": inference.export_parser, "models": models.models_parser, "convert": convert._parser}
    # splits reads train.py's options (`cnns.cli.measure.splits_main`)
    return {command: own[command]() if command in own else
            build_parser("train" if command == "splits" else command, defaults.stated_default)
            for command in COMMANDS}


def run_script(command: str, argv: list[str] | None = None) -> int:
    """Run one command; every way it can end is an exit code and at most one line (`cnns.cli.endings`): a CnnsError
    is `error: <line>` and 2, a signal 128 + its number, a reader gone from stdout a quiet end."""
    endings.make_standard_streams_safe()
    # A torch, torchvision or timm older than pyproject.toml's range (a GPU machine keeps its own) is
    # one line naming the pip command, before anything fails inside the command.
    from cnns.versions import check_installed_versions

    line = check_installed_versions()
    if line is not None:
        print(f"error: {line}", file=sys.stderr)
        return 2
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        with command_scope(), endings.signals_end_the_command():  # what it may write: cnns.safe_writes
            return _dispatch(command)(argv)
    except CnnsError as exc:
        return endings.say(f"error: {exc}", 2)
    except BaseException as exc:  # noqa: BLE001 - each way out is one line (or none) and an exit code
        return endings.ending_of(exc, command)
    finally:
        # The line a signal continues with is this command's (errors.continue_with): not the next one's in this
        # process (the tests run many; so can a tool).
        continue_with_nothing()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: cnns {" + ",".join(COMMANDS) + "} [options]\n\n"
              "Train, validate, restore, average and benchmark CNN classifiers. "
              "`cnns <command> --help` lists a command's options.")
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        print(f"error: unknown command {argv[0]!r}; choose one of {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    return run_script(argv[0], argv[1:])


__all__ = ["main", "run_script", "parse_options", "resolved_training_options", "ConfigError"]
