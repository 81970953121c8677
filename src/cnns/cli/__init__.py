"""Command line: `cnns <command>` and the seed's root scripts.

The only reader of sys.argv. Every command turns its options into a resolved option dict
(`parse_options`), then into a `RunConfig`, and hands it to the package. A `CnnsError` anywhere
becomes one line on stderr and exit code 2.
"""

from __future__ import annotations

import json
import os

# torch's C++ side logs each failed connection attempt of a distributed rendezvous (and the like)
# straight to stderr, before the Python exception that we turn into one line. Read when torch loads,
# so set before anything imports it; TORCH_CPP_LOG_LEVEL=INFO (or WARNING) brings them back.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
import shlex
import sys
from typing import Any, Callable

from cnns.cli.options import IPU_ONLY_OPTIONS, build_parser
from cnns.config import load_named_config, resolve
from cnns.errors import CnnsError, ConfigError

COMMANDS = ("train", "validate", "restore", "weight-avg", "infer", "benchmark", "bench-data", "splits", "plot",
            "predict", "export")


def parse_options(script: str, argv: list[str]) -> tuple[dict[str, Any], list[str]]:
    """Parse a seed command line: configs.yml defaults, overridden by the command line, resolved.

    Returns the resolved options and the notices to print (IPU-only options named once).
    """
    parser = build_parser(script)
    first, _ = parser.parse_known_args(argv)
    ignored_config_keys: list[str] = []
    if getattr(first, "config", None):
        values = load_named_config(first.config, first.config_path)
        known = {action.dest for action in parser._actions}
        if "batch_size" in values and "micro_batch_size" not in values:
            values["micro_batch_size"] = values.pop("batch_size")  # the seed's deprecated spelling
        ignored_config_keys = sorted(k for k in values if k not in known)
        parser.set_defaults(**{k: v for k, v in values.items() if k in known})
    args = parser.parse_args(argv)
    values = vars(args)
    if values.get("print_config") is None:
        values["print_config"] = False
    if values.get("replicas") == "auto":
        values["replicas"] = auto_replicas(values.get("shards") or 1, values.get("device"))
    notices = _ipu_only_notice(values, ignored_config_keys)
    values["command"] = " ".join(shlex.quote(a) for a in [parser.prog, *argv])
    return values, notices


def auto_replicas(shards: int, device: str | None) -> int:
    """--replicas auto: under a launcher, its process count over the shards; otherwise one replica
    per GPU on CUDA, one per usable core on a CPU (see the README for when that pays off)."""
    from cnns.parallel.world import launched, usable_cores

    if launched():
        return max(1, int(os.environ["WORLD_SIZE"]) // shards)
    import torch

    if (device or "").startswith("cuda") or (device is None and torch.cuda.is_available()):
        return max(1, torch.cuda.device_count() // shards)
    return max(1, usable_cores() // shards)


def _ipu_only_notice(values: dict[str, Any], ignored_config_keys: list[str]) -> list[str]:
    used = [flag for dest, (flag, _) in IPU_ONLY_OPTIONS.items() if values.get(dest) not in (None, False)]
    used += [f"{key} (configs.yml)" for key in ignored_config_keys]
    if not used:
        return []
    return [f"IPU-only options accepted with no effect here: {', '.join(used)}"]


def dataset_from_folder_contents(data_dir: str | None) -> str | None:
    """The dataset a folder holds, from its file names only (no data is read).

    The seed guessed the dataset from the folder's name; a folder named otherwise still gets the
    right model defaults this way.
    """
    if not data_dir or not os.path.isdir(data_dir):
        return None
    from cnns.data.cifar import detect_cifar
    from cnns.data.imagenet import detect_imagenet

    found = detect_cifar(data_dir)
    if found is None and detect_imagenet(data_dir) is not None:
        found = "imagenet"
    return found


def resolved_training_options(script: str, argv: list[str]) -> tuple[dict[str, Any], list[str]]:
    values, notices = parse_options(script, argv)
    if not values.get("dataset") and not (values.get("generated_data") or values.get("synthetic_data")):
        values["dataset"] = dataset_from_folder_contents(values.get("data_dir") or os.environ.get("DATA_DIR"))
    options = resolve(values)
    if options.get("seed") is None:
        # Record the seed actually used so that restore.py continues the same data order.
        options["seed"] = int.from_bytes(os.urandom(4), "little")
        options["seed_specified"] = False
    else:
        options["seed"] = int(options["seed"])
        options["seed_specified"] = True
    return options, notices


def print_config(options: dict[str, Any]) -> int:
    print(json.dumps(options, sort_keys=True, indent=4, default=str))
    return 0


def _dispatch(command: str) -> Callable[[list[str]], int]:
    from cnns.cli import commands

    return {
        "train": commands.train_main,
        "validate": commands.validate_main,
        "restore": commands.restore_main,
        "weight-avg": commands.weight_avg_main,
        "infer": commands.infer_main,
        "benchmark": commands.benchmark_main,
        "bench-data": commands.bench_data_main,
        "splits": commands.splits_main,
        "plot": commands.plot_main,
        "predict": commands.predict_main,
        "export": commands.export_main,
    }[command]


def run_script(command: str, argv: list[str] | None = None) -> int:
    """Run one command with clean error handling: CnnsError -> one line, exit 2."""
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
