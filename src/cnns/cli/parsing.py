"""Parsing a seed command line: configs.yml defaults, overridden by the command line, resolved."""

from __future__ import annotations

import json
import os
import shlex
from typing import Any

from cnns.config import NUM_CLASSES, load_named_config, resolve
from cnns.options import IPU_ONLY_OPTIONS, build_parser


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
        import torch  # only when asked

        from cnns.engine.build import resolve_device
        from cnns.parallel.world import auto_replicas
        from cnns.precision import cpu_half_is_emulated

        device = resolve_device(values.get("device"), values.get("select_ipus"))
        matrix_units = device.type == "cpu" and not cpu_half_is_emulated(device, torch.bfloat16)
        values["replicas"] = auto_replicas(values.get("shards") or 1, device, matrix_units)
    notices = _ipu_only_notice(values, ignored_config_keys)
    values["command"] = " ".join(shlex.quote(a) for a in [parser.prog, *argv])
    return values, notices


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


def classes_in_the_data(options: dict[str, Any]) -> int:
    """The classifier's outputs when --num-classes is not given: a folder tree's class folders (their
    names only are read), else the dataset's (CIFAR-10 10, CIFAR-100 100, ImageNet 1,000)."""
    dataset = options.get("dataset")
    if dataset == "imagenet" and not (options.get("generated_data") or options.get("synthetic_data")):
        from cnns.data.imagenet import folder_tree_classes

        found = folder_tree_classes(options["data_dir"]) if options.get("data_dir") else None
        if found is not None and found[0]:
            return len(found[0])
    return NUM_CLASSES.get(dataset, 10)


def half_type_of_the_device(values: dict[str, Any]) -> None:
    """--half-dtype, when not given, from the device the run will use (--device, --select-ipus or the
    default): bfloat16 on a CPU and on a GPU with bfloat16 arithmetic, float16 (with loss scaling) on one
    without. Decided once, here, so that arguments.json records it and every later command keeps it."""
    values["half_dtype_given"] = values.get("half_dtype") is not None
    if values.get("half_dtype") is None:
        from cnns.engine.build import resolve_device
        from cnns.precision import default_half_dtype

        values["half_dtype"] = default_half_dtype(resolve_device(values.get("device"), values.get("select_ipus")))


def resolved_evaluation_options(script: str, argv: list[str]) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """validation.py / weight_avg.py: (values, resolved options, notices). The half type is the training
    run's (its arguments.json) or the command line's; where neither gives one, the device's, as for
    training (a validation.py without --restore-path on a GPU without bfloat16 runs float16)."""
    from cnns.runs import evaluation_options

    values, notices = parse_options(script, argv)
    options, run = evaluation_options(values)
    if values.get("half_dtype") is None and "half_dtype" not in run:
        half_type_of_the_device(values)
        options, _ = evaluation_options(values)
    return values, options, notices


def resolved_training_options(script: str, argv: list[str]) -> tuple[dict[str, Any], list[str]]:
    values, notices = parse_options(script, argv)
    half_type_of_the_device(values)
    if not values.get("dataset") and not (values.get("generated_data") or values.get("synthetic_data")):
        values["dataset"] = dataset_from_folder_contents(values.get("data_dir") or os.environ.get("DATA_DIR"))
    options = resolve(values)
    if options.get("num_classes") is None:
        options["num_classes"] = classes_in_the_data(options)
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
