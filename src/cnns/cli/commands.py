"""The seed's scripts behind the root scripts and `cnns <command>`: one short function each.

Each parses its command line into options (for a finished run, merged with the run's own by
`cnns.runs`), prints them for --print-config, and calls one entry point below: `cnns.tasks` for the
seed's training and evaluation scripts, `cnns.engine.embedded`, `cnns.inference`, `cnns.bench`.
`cnns.cli.run_script` maps their errors to exit codes; `cnns.cli.tools` holds the commands the seed
did not have (predict, export, benchmark, bench-data) and `cnns.cli.plot` the plot command.
"""

from __future__ import annotations

from cnns.cli.parsing import (half_type_of_the_device, parse_options, print_config, resolved_evaluation_options,
                              resolved_training_options)


def train_main(argv: list[str]) -> int:
    from cnns import tasks

    options, notices = resolved_training_options("train", argv)
    if options["print_config"]:
        return print_config(options)
    return tasks.train(options, notices, relaunch=argv)


def restore_main(argv: list[str]) -> int:
    from cnns import tasks
    from cnns.runs import RunFolder, restore_options

    values, _ = parse_options("restore", argv)
    run = RunFolder.open(values["restore_path"])
    options = restore_options(run, values)
    if values.get("print_config"):
        return print_config(options)
    return tasks.restore(run, options, relaunch=argv)


def validate_main(argv: list[str]) -> int:
    from cnns import tasks

    values, options, notices = resolved_evaluation_options("validate", argv)
    if values["print_config"]:
        return print_config(options)
    return tasks.validate(options, values.get("restore_path"), repeat=values.get("repeat") or 1, notices=notices,
                          relaunch=argv)


def weight_avg_main(argv: list[str]) -> int:
    from cnns import tasks

    values, options, notices = resolved_evaluation_options("weight-avg", argv)
    if values["print_config"]:
        return print_config(options)
    # The training run's --no-validation does not carry over: only this command line's does.
    return tasks.weight_average(options, values.get("restore_path"), values["mode"], values.get("N"),
                                values.get("decay"), values.get("discard_last") or 0,
                                validate=values.get("validation") is not False, notices=notices)


def infer_main(argv: list[str]) -> int:
    from cnns.engine.embedded import infer, inference_options

    values, notices = parse_options("infer", argv)
    half_type_of_the_device(values)
    options = inference_options(values)
    if values.get("print_config"):
        return print_config(options)
    return infer(options, notices)


def splits_main(argv: list[str]) -> int:
    """`cnns splits`: every cut of the model with what lies before it (parameters, activations, time
    of one micro-batch forward and backward) and the cuts that balance --shards stages (default 2)."""
    from cnns import tasks

    # The model's shape is all it needs: no data folder (ImageNet-sized unless --dataset says otherwise).
    if not any(a.startswith(("--data-dir", "--synthetic-data", "--generated-data")) for a in argv):
        argv = [*argv, "--synthetic-data"] + ([] if any(a.startswith("--dataset") for a in argv) else
                                              ["--dataset", "imagenet"])
    argv = argv if "--pipeline" in argv else [*argv, "--pipeline"]
    options, _ = resolved_training_options("train", argv)
    return tasks.propose_splits(options)
