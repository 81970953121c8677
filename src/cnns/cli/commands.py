"""The seed's scripts behind the root scripts and `cnns <command>`: one short function each.

Each resolves its command line once into a frozen configuration (`cnns.cli.parsing.resolve_command_line`;
for restore.py, the run folder's own options), prints it for --print-config, and calls the one file of
`cnns.commands` that runs the script. `cnns.cli.run_script` maps their errors to exit codes;
`cnns.cli.tools` holds the commands the seed did not have and `cnns.cli.plot` the plot command.
"""

from __future__ import annotations

from cnns.cli.parsing import parse_options, print_config, resolve_command_line


def train_main(argv: list[str]) -> int:
    from cnns.commands.train import train

    resolved = resolve_command_line("train", argv)
    if resolved.options["print_config"]:
        return print_config(resolved.options)
    if resolved.config.train.dataset_benchmark:
        from cnns.commands.benchmark import dataset_benchmark

        return dataset_benchmark(resolved.config, resolved.notices)
    return train(resolved.config, resolved.notices, relaunch=argv)


def restore_main(argv: list[str]) -> int:
    from cnns.commands.restore import restore
    from cnns.config import RunConfig
    from cnns.runs import RunFolder, restore_options

    values, _ = parse_options("restore", argv)
    run = RunFolder.open(values["restore_path"])
    options = restore_options(run, values)
    if values.get("print_config"):
        return print_config(options)
    return restore(run, RunConfig.from_options(options), relaunch=argv)


def validate_main(argv: list[str]) -> int:
    from cnns.commands.validate import validate

    resolved = resolve_command_line("validate", argv)
    if resolved.values["print_config"]:
        return print_config(resolved.options)
    return validate(resolved.config, resolved.values.get("restore_path"), repeat=resolved.values.get("repeat") or 1,
                    notices=resolved.notices, relaunch=argv)


def weight_avg_main(argv: list[str]) -> int:
    from cnns.commands.weight_avg import weight_average

    resolved = resolve_command_line("weight-avg", argv)
    values = resolved.values
    if values["print_config"]:
        return print_config(resolved.options)
    # The training run's --no-validation does not carry over: only this command line's does.
    return weight_average(resolved.config, values.get("restore_path"), values["mode"], values.get("N"),
                          values.get("decay"), values.get("discard_last") or 0,
                          validate=values.get("validation") is not False, notices=resolved.notices)


def infer_main(argv: list[str]) -> int:
    from cnns.commands.infer import infer

    resolved = resolve_command_line("infer", argv)
    values = resolved.values
    if values.get("print_config"):
        return print_config(resolved.options)
    return infer(resolved.config, resolved.notices, restore_path=values.get("restore_path"),
                 artefact_path=values.get("artefact_path"), force_recompile=bool(values.get("force_recompile")))


def splits_main(argv: list[str]) -> int:
    """`cnns splits`: every cut of the model with what lies before it (parameters, activations, time
    of one micro-batch forward and backward) and the cuts that balance --shards stages (default 2)."""
    from cnns.commands.splits import propose_splits

    # The model's shape is all it needs: no data folder (ImageNet-sized unless --dataset says otherwise).
    if not any(a.startswith(("--data-dir", "--synthetic-data", "--generated-data")) for a in argv):
        argv = [*argv, "--synthetic-data"] + ([] if any(a.startswith("--dataset") for a in argv) else
                                              ["--dataset", "imagenet"])
    argv = argv if "--pipeline" in argv else [*argv, "--pipeline"]
    return propose_splits(resolve_command_line("train", argv).config)
