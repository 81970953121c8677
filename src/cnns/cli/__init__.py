"""Command line: `cnns <command>` and Graphcore's root scripts, the top floor of the package.

The only reader of sys.argv, and imported by nothing else in the package. Every command parses its
command line into plain values (`cnns.cli.parsing` for Graphcore's options) and calls one entry point,
grouped by what the commands do: `cnns.cli.runs` (make and read run folders: train, restore, validate,
weight-avg), `cnns.cli.inference` (use a trained model: infer, predict, export), `cnns.cli.measure`
(benchmark, profile, bench-data, splits) and `cnns.cli.plot`. A `CnnsError` anywhere becomes one line on
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

from cnns.cli.parsing import parse_options, resolved_training_options
from cnns.errors import CnnsError, ConfigError

COMMANDS = ("train", "validate", "restore", "weight-avg", "infer", "benchmark", "profile", "bench-data", "splits",
            "plot", "predict", "export")


def _dispatch(command: str) -> Callable[[list[str]], int]:
    from cnns.cli import inference, measure, plot, runs

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
    }[command]


def run_script(command: str, argv: list[str] | None = None) -> int:
    """Run one command with clean error handling: CnnsError -> one line, exit 2."""
    # A torch, torchvision or timm older than pyproject.toml's range (a GPU machine keeps its own) is
    # one line naming the pip command, before anything fails inside the command.
    from cnns.versions import check_installed_versions

    line = check_installed_versions()
    if line is not None:
        print(f"error: {line}", file=sys.stderr)
        return 2
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _dispatch(command)(argv)
    except CnnsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        # In a multi-process run, a peer that died surfaces here as a transport error from inside a
        # collective (often the gradient all-reduce): one line, not a traceback. Anything else is a bug.
        from cnns.parallel.world import launched, peer_failure

        line = peer_failure(exc) if launched() else None
        if line is None:
            raise
        print(f"error: {line}", file=sys.stderr)
        return 1


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
