"""Commands that make and read run folders, Graphcore's scripts: train.py, restore.py, validation.py and
weight_avg.py (`cnns train`, `restore`, `validate`, `weight-avg`).

Each resolves its command line once into a frozen configuration (`cnns.cli.parsing.resolve_command_line`,
restore.py's from the run folder's own options), prints it for --print-config, and calls the one file of
`cnns.commands` that runs the script, imported only then: --help, --print-config and a bad option answer
without loading the engine. `cnns.cli.run_script` maps their errors to exit codes.
"""

from __future__ import annotations

from cnns.cli.parsing import print_config, resolve_command_line


def train_main(argv: list[str]) -> int:
    resolved = resolve_command_line("train", argv)
    if resolved.options["print_config"]:
        return print_config(resolved.options)
    from cnns.commands.train import train

    if resolved.config.train.dataset_benchmark:
        from cnns.commands.benchmark import dataset_benchmark

        return dataset_benchmark(resolved.config, resolved.notices)
    return train(resolved.config, resolved.notices, relaunch=argv)


def restore_main(argv: list[str]) -> int:
    resolved = resolve_command_line("restore", argv)
    if resolved.values.get("print_config"):
        return print_config(resolved.options)
    from cnns.commands.restore import restore

    return restore(resolved.run, resolved.config, relaunch=argv)


def validate_main(argv: list[str]) -> int:
    resolved = resolve_command_line("validate", argv)
    if resolved.values["print_config"]:
        return print_config(resolved.options)
    from cnns.commands.validate import validate

    return validate(resolved.config, resolved.values.get("restore_path"), resolved.run,
                    repeat=resolved.values.get("repeat") or 1, notices=resolved.notices, relaunch=argv)


def weight_avg_main(argv: list[str]) -> int:
    resolved = resolve_command_line("weight-avg", argv)
    values = resolved.values
    if values["print_config"]:
        return print_config(resolved.options)
    from cnns.commands.weight_avg import weight_average

    # The training run's --no-validation does not carry over: only this command line's does.
    return weight_average(resolved.config, values.get("restore_path"), resolved.run, values["mode"], values.get("N"),
                          values.get("decay"), values.get("discard_last") or 0,
                          validate=values.get("validation") is not False, notices=resolved.notices)
