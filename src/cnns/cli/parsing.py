"""A command line of Graphcore's application resolved: configs.yml defaults, overridden by the command line,
filled by its default rules (`cnns.config.defaults`), and (for a finished run) merged with the run's own
arguments.json.

`resolve_command_line` is the one way from argv to a configuration, for train, restore, validate, weight-avg
and infer: the flat options (what arguments.json and --print-config show) and the frozen `RunConfig` made from
them once, which is all a command reads.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
from typing import Any

from dataclasses import dataclass

from cnns.config import RunConfig, load_named_config, resolve
from cnns.config.config_files import command_line_over_config
from cnns.config import defaults
from cnns.config.table import IPU_ONLY_OPTIONS, USED_ONLY_WITH, build_parser, flag_of, has_effect
from cnns.data.formats import classes_in_folder, format_of_folder


def parse_options(script: str, argv: list[str]) -> tuple[dict[str, Any], list[str]]:
    """Parse a command line of Graphcore's application: configs.yml defaults, overridden by the command line, resolved.

    Returns the resolved options and the notices to print (IPU-only options named once).
    """
    parser = build_parser(script, defaults.stated_default)
    first, _ = parser.parse_known_args(argv)
    ignored_config_keys: list[str] = []
    if getattr(first, "config", None):
        values = load_named_config(first.config, first.config_path)  # a key that is no option is refused there
        known = {action.dest for action in parser._actions}
        if "batch_size" in values and "micro_batch_size" not in values:
            values["micro_batch_size"] = values.pop("batch_size")  # Graphcore's application's deprecated spelling
        ignored_config_keys = sorted(k for k in values if k not in known)  # another script's option
        values = command_line_over_config(parser, options_given(parser, argv), values)
        parser.set_defaults(**{k: v for k, v in values.items() if k in known})
    args = parser.parse_args(argv)
    values = vars(args)
    if values.get("print_config") is None:
        values["print_config"] = False
    if values.get("replicas") == "auto":
        import torch  # only when asked

        from cnns.devices import resolve_device
        from cnns.parallel.world import auto_replicas
        from cnns.precision import cpu_half_is_emulated

        device = resolve_device(values.get("device"), values.get("select_ipus"))
        matrix_units = device.type == "cpu" and not cpu_half_is_emulated(device, torch.bfloat16)
        values["replicas"] = auto_replicas(values.get("shards") or 1, device, matrix_units)
    notices = _ipu_only_notice(values, ignored_config_keys)
    values["command"] = " ".join(shlex.quote(a) for a in [parser.prog, *argv])
    return values, notices


def options_given(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The dests of the options `argv` names (whatever their values, a default's value too): argv parsed with
    every default suppressed, so that only what was typed lands in the namespace."""
    saved = [(action, action.default) for action in parser._actions]
    try:
        for action, _ in saved:
            action.default = argparse.SUPPRESS
        namespace, _ = parser.parse_known_args(argv)
    finally:
        for action, default in saved:
            action.default = default
    return set(vars(namespace))


def _ipu_only_notice(values: dict[str, Any], ignored_config_keys: list[str]) -> list[str]:
    used = [flag for dest, (flag, _) in IPU_ONLY_OPTIONS.items() if values.get(dest) not in (None, False)]
    notices = [f"IPU-only options accepted with no effect here: {', '.join(used)}"] if used else []
    if ignored_config_keys:  # options of another of the scripts (validation.py's --repeat in a training config)
        notices.append(f"not options of this script, not used: {', '.join(ignored_config_keys)} (configs.yml)")
    return notices


def dataset_from_folder_contents(data_dir: str | None) -> str | None:
    """The dataset a folder holds, from its file names only (no data is read).

    Graphcore's application guessed the dataset from the folder's name; a folder named otherwise still gets the
    right model defaults this way.
    """
    found = format_of_folder(data_dir)
    return found.dataset.name if found is not None else None


def classes_in_the_data(options: dict[str, Any]) -> int:
    """The classifier's outputs when --num-classes is not given: a folder tree's class folders (their
    names only are read), else the dataset's (CIFAR-10 10, CIFAR-100 100, ImageNet 1,000)."""
    generated = options.get("generated_data") or options.get("synthetic_data")
    return classes_in_folder(options.get("dataset"), None if generated else options.get("data_dir"))


def device_defaults(values: dict[str, Any], decided: set[str] | frozenset[str] = frozenset()) -> None:
    """`cnns.config.defaults.device_defaults` for the device the run will use (--device, --select-ipus or the
    machine's default): the machine is looked at here, the defaults are applied there."""
    if all(values.get(key) is not None or key in decided for key in ("half_dtype", "compile")):
        defaults.device_defaults(values, "", "", decided)  # only records whether --half-dtype was given
        return
    from cnns.devices import resolve_device
    from cnns.precision import default_half_dtype

    device = resolve_device(values.get("device"), values.get("select_ipus"))
    defaults.device_defaults(values, device.type, default_half_dtype(device), decided)


def resolved_evaluation_options(script: str, argv: list[str]) -> tuple[dict[str, Any], dict[str, Any], list[str], Any]:
    """validation.py / weight_avg.py: (values, resolved options, notices, the run --restore-path names, read once
    here for the whole process: `cnns.runfolder.options.open_run`). The half type and compilation are the
    training run's (its arguments.json) or the command line's; where neither gives one, the device's, as for
    training (a validation.py without --restore-path on a GPU without bfloat16 runs float16, compiled)."""
    from cnns.runfolder.options import evaluation_options, open_run

    values, notices = parse_options(script, argv)
    if script == "weight-avg":  # averaging is file work: its one validation runs in this process
        values.update(replicas=1, BN_span=1)
    target = open_run(values)
    options, run = evaluation_options(values, target)
    if any(values.get(key) is None and key not in run for key in ("half_dtype", "compile")):
        device_defaults(values, decided=set(run))
        options, _ = evaluation_options(values, target)
    return values, options, notices, target


def resolved_training_options(script: str, argv: list[str]) -> tuple[dict[str, Any], list[str]]:
    values, notices = parse_options(script, argv)
    return _training_options(values), notices


def _training_options(values: dict[str, Any]) -> dict[str, Any]:
    """train.py's rule: the device's half type, the dataset from the folder's contents, the class count from
    the data; the random seed, when not given, is drawn as the configuration is made (`RunConfig.from_options`)."""
    device_defaults(values)
    if not values.get("dataset") and not (values.get("generated_data") or values.get("synthetic_data")):
        values["dataset"] = dataset_from_folder_contents(values.get("data_dir") or os.environ.get("DATA_DIR"))
    options = resolve(values)
    if options.get("num_classes") is None:
        options["num_classes"] = classes_in_the_data(options)
    options["seed_specified"] = options.get("seed") is not None
    return options


def print_config(options: dict[str, Any]) -> int:
    """The resolved options as JSON; one that changes nothing with the choices made (--momentum with --optimiser
    SGD) is shown as null, so what is printed is what the run uses."""
    shown = {dest: value if has_effect(dest, options) else None for dest, value in options.items()}
    print(json.dumps(shown, sort_keys=True, indent=4, default=str))
    return 0


def _one_of(choices: tuple[str, ...]) -> str:
    return choices[0] if len(choices) == 1 else f"{', '.join(choices[:-1])} or {choices[-1]}"


def options_without_effect(values: dict[str, Any], options: dict[str, Any]) -> list[str]:
    """A notice for each option the command line (or its configs.yml entry) gave that the choices made leave
    unused, naming the choices that would use it."""
    notices = []
    for dest, (chooser, choices) in USED_ONLY_WITH.items():
        if values.get(dest) is not None and not has_effect(dest, options):
            notices.append(f"{flag_of(dest)} has no effect with {flag_of(chooser)} {options[chooser]}; it is used "
                           f"by {flag_of(chooser)} {_one_of(choices)}")
    return notices


INFERENCE_ITERATIONS = 100  # inference_embedded.py's timed batches unless --iterations says


def inference_options(values: dict[str, Any]) -> dict[str, Any]:
    """inference_embedded.py's options from its command line's values: one process, no pipeline, no
    validation, and generated data unless synthetic data was asked for; a run's checkpoint in its run's model."""
    from cnns.runfolder.options import inference_run_options

    values, run = inference_run_options(values)
    device_defaults(values, decided=set(run))
    values = dict(values, replicas=1, BN_span=1, shards=1, pipeline=False, pipeline_splits=None, validation=False)
    if values.get("seed") is None:
        values["seed"] = 0  # generated images are the same every time, as for validation (`cnns.runfolder.run_folder`)
    if values.get("iterations") is None:
        values["iterations"] = INFERENCE_ITERATIONS
    values["generated_data"] = values.get("generated_data") or not values.get("synthetic_data")
    return resolve(values)


@dataclass(frozen=True)
class ResolvedCommandLine:
    """A command line resolved: its own values (what it gave, None where not), the flat options, the frozen
    configuration made from them, and the notices to print (IPU-only options named once)."""

    values: dict[str, Any]
    options: dict[str, Any]
    config: RunConfig
    notices: list[str]
    # The run --restore-path names, opened once, here: restore.py's `cnns.runfolder.run_folder.RunFolder`,
    # validation.py's and weight_avg.py's `RestoreTarget` (None without --restore-path).
    run: Any = None


def resolve_command_line(script: str, argv: list[str]) -> ResolvedCommandLine:
    """train / restore / validate / weight-avg / infer: argv to the run's configuration, by the script's merge
    rule (`cnns.runfolder.options` for a finished run's folder: restore.py continues with the run's own options and the
    stage layout its command line gives). predict and export resolve a run as validate does
    (`cnns.cli.inference.restored_run`)."""
    if script == "train":
        values, notices = parse_options(script, argv)
        options = _training_options(values)
        notices += options_without_effect(values, options)
    elif script == "restore":
        from cnns.runfolder.run_folder import RunFolder
        from cnns.runfolder.options import restore_options

        values, notices = parse_options(script, argv)
        run = RunFolder.open(values["restore_path"])
        options = restore_options(run, values)
        config = RunConfig.from_options(options)
        return ResolvedCommandLine(values, dict(config.arguments), config, notices, run)
    elif script == "infer":
        values, notices = parse_options(script, argv)
        options = inference_options(values)
    else:
        values, options, notices, target = resolved_evaluation_options(script, argv)
        config = RunConfig.from_options(options)
        return ResolvedCommandLine(values, dict(config.arguments), config, notices, target)
    config = RunConfig.from_options(options)
    return ResolvedCommandLine(values, dict(config.arguments), config, notices)
