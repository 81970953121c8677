"""Options say what they do: the run's header and --print-config show the optimiser as it really updates (the
default SGD without momentum), and an option that changes nothing with the choices made gets one notice naming
what would use it. The table of such options (`cnns.config.table.USED_ONLY_WITH`) is held here to what the
optimisers and schedules really read; its optimisers' rows come from their registry (`cnns.optim`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from torch import nn

import scripts
from cnns.config.table import USED_ONLY_WITH, has_effect
from cnns.optim import OPTIMISERS, OPTIONS, OptimiserSpec, option_users, optimiser_recipe, parameter_groups
from cnns.lr_schedules import SCHEDULE_KINDS, ScheduleSpec, lr_at


@pytest.fixture(scope="module")
def data_dir(shapes_cifar10) -> Path:
    return shapes_cifar10("effects", train=32, test=8, seed=7)


def header_and_notices(capfd, data_dir: Path, tmp_path: Path, *options: str) -> tuple[str, list[str]]:
    out = scripts.run_here(capfd, "train.py", "--dataset", "cifar-10", "--data-dir", str(data_dir), "--model-size", "8",
                           "--compile-only", "--logs-path", str(tmp_path / "run"), *options)
    lines = out.stdout.splitlines()
    header = next(line for line in lines if line.startswith(" Learning Rate:"))
    return header, [line for line in lines if line.startswith("notice: ")]


def used_by(dest: str) -> str:
    """The optimisers a notice says would use optimiser option `dest`: those whose entries read it."""
    *others, last = option_users()[dest]
    return f"{', '.join(others)} or {last}" if others else last


def test_sgd_says_it_has_no_momentum_and_a_momentum_given_to_it_gets_one_notice(data_dir, tmp_path, capfd):
    header, notices = header_and_notices(capfd, data_dir, tmp_path, "--lr-schedule", "cosine", "--weight-decay",
                                         "5e-4", "--momentum", "0.8", "--abs-learning-rate", "0.1")
    assert header == " Learning Rate: 0.1 (cosine, SGD without momentum, weight decay 0.0005)"
    assert used_by("momentum") == "momentum, RMSprop or LARS"
    assert notices == [f"notice: --momentum has no effect with --optimiser SGD; it is used by --optimiser "
                       f"{used_by('momentum')}"]


@pytest.mark.parametrize("options, described", [
    (["--optimiser", "momentum", "--momentum", "0.8"], "momentum 0.8, weight decay 1e-06"),
    (["--optimiser", "RMSprop"], "RMSprop with momentum 0.9, weight decay 1e-06"),
    (["--optimiser", "LARS", "--lars-weight-decay", "3e-5"], "LARS with momentum 0.9, weight decay 3e-05"),
])
def test_the_header_names_the_momentum_and_decay_each_optimiser_uses(data_dir, tmp_path, capfd, options, described):
    header, notices = header_and_notices(capfd, data_dir, tmp_path, *options)
    assert header.endswith(f"(stepped, {described})") and notices == []


def test_options_of_another_schedule_or_optimiser_get_a_notice_each(data_dir, tmp_path, capfd):
    _, notices = header_and_notices(capfd, data_dir, tmp_path, "--optimiser", "LARS", "--weight-decay", "1e-4",
                                    "--rmsprop-epsilon", "0.01", "--lr-schedule", "cosine", "--lr-drops", "3")
    assert notices == [
        f"notice: --weight-decay has no effect with --optimiser LARS; it is used by --optimiser {used_by('weight_decay')}",
        "notice: --rmsprop-epsilon has no effect with --optimiser LARS; it is used by --optimiser RMSprop",
        "notice: --lr-drops has no effect with --lr-schedule cosine; it is used by --lr-schedule exponential",
    ]


def print_config(capfd, *options: str) -> dict:
    out = scripts.run_here(capfd, "train.py", "--dataset", "cifar-10", "--data-dir", "/nowhere/cifar-10", *options,
                           "--print-config")
    return json.loads(out.stdout)


def test_print_config_shows_null_for_what_the_choices_leave_unused(capfd):
    sgd = print_config(capfd)
    assert sgd["optimiser"] == "SGD" and sgd["momentum"] is None and sgd["weight_decay"] == 1e-6
    assert sgd["learning_rate_decay"] == 0.1 and sgd["lr_drops"] is None and sgd["lars_weight_decay"] is None
    momentum = print_config(capfd, "--optimiser", "momentum", "--lr-schedule", "cosine")
    assert momentum["momentum"] == 0.9 and momentum["learning_rate_decay"] is None
    lars = print_config(capfd, "--optimiser", "lars")
    assert lars["weight_decay"] is None and lars["lars_weight_decay"] == 1e-6 and lars["momentum"] == 0.9


def _optimiser_settings(name: str, **changed) -> tuple:
    """What the optimiser `name` is built with, as the run builds it: its class, arguments and groups' settings."""
    spec = OptimiserSpec(name, lr=0.1, **({"weight_decay": 1e-4, "lars_weight_decay": 1e-4} | changed))
    cls, groups, arguments = optimiser_recipe(parameter_groups(nn.Linear(2, 2), spec["weight_decay"]), spec)
    return cls, arguments, [{key: value for key, value in group.items() if key != "params"} for group in groups]


# Every optimiser option but the one given to the optimisers as another (cnns.optim: --rmsprop-base-decay-exp
# derives --rmsprop-decay).
OPTIMISER_FIELDS = set(OPTIONS) - {"rmsprop_base_decay_exp"}


@pytest.mark.parametrize("optimiser", OPTIMISERS)
@pytest.mark.parametrize("dest", sorted(OPTIMISER_FIELDS))
def test_the_table_says_which_options_each_optimiser_really_reads(optimiser, dest):
    changed = {"momentum": 0.5, "weight_decay": 0.3, "rmsprop_decay": 0.5, "rmsprop_epsilon": 0.5,
               "lars_eeta": 0.5, "lars_epsilon": 0.5, "lars_weight_decay": 0.3}[dest]
    reads = _optimiser_settings(optimiser) != _optimiser_settings(optimiser, **{dest: changed})
    assert reads == has_effect(dest, {"optimiser": optimiser})


# Every schedule's parameters as a run's resolved options give them; SCHEDULE_FIELDS changes one of them.
SCHEDULE_DEFAULTS = {"learning_rate_decay": 0.1, "learning_rate_schedule": (0.5, 0.75), "lr_decay_rate": 0.97,
                     "lr_drops": 146, "poly_lr_decay_power": 2.0, "poly_lr_end_ratio": 1e-5}
SCHEDULE_FIELDS = {"learning_rate_decay": 0.5, "learning_rate_schedule": (0.3,), "lr_decay_rate": 0.5,
                   "lr_drops": 3, "poly_lr_decay_power": 1.0, "poly_lr_end_ratio": 0.5}


@pytest.mark.parametrize("schedule", SCHEDULE_KINDS)
@pytest.mark.parametrize("dest", sorted(SCHEDULE_FIELDS))
def test_the_table_says_which_options_each_schedule_really_reads(schedule, dest):
    def rates(**changed) -> list[float]:
        spec = ScheduleSpec(schedule, 1.0, 20, warmup_steps=2, **(SCHEDULE_DEFAULTS | changed))
        return [lr_at(spec, step) for step in range(20)]

    reads = rates() != rates(**{dest: SCHEDULE_FIELDS[dest]})
    assert reads == has_effect(dest, {"lr_schedule": schedule})


def test_every_optimiser_and_schedule_option_of_the_table_is_checked():
    assert {dest for dest, (chooser, _) in USED_ONLY_WITH.items() if chooser == "lr_schedule"} == \
        set(SCHEDULE_FIELDS) | {"abs_end_learning_rate"}  # given as poly_lr_end_ratio (cnns.config.defaults)
    assert {dest for dest, (chooser, _) in USED_ONLY_WITH.items() if chooser == "optimiser"} == \
        OPTIMISER_FIELDS | {"rmsprop_base_decay_exp"}  # given as rmsprop_decay (cnns.config.defaults)


# A run resolved without data: ResNet-8 on synthetic CIFAR-10 images, in float32 so that every copy of a weight
# is 4 bytes.
SYNTHETIC_RUN = ("--synthetic-data", "--dataset", "cifar-10", "--model-size", "8", "--micro-batch-size", "8",
                 "--iterations", "1", "--no-validation", "--precision", "32.32")


@pytest.mark.parametrize("name", OPTIMISERS)
def test_each_registry_entry_is_what_the_choices_notices_print_config_and_memory_estimate_read(name, capsys):
    """An optimiser is declared once, as its entry (cnns.optim.OPTIMISERS): --optimiser offers it in any case,
    the options it does not read get a notice each and show null in --print-config, those it reads do neither,
    and the memory estimate counts its state."""
    from cnns.cli.parsing import print_config as printed
    from cnns.cli.parsing import resolve_command_line
    from cnns.config.table import build_parser
    from cnns.models import build_model
    from cnns.parallel.launch import worker_memory

    info = OPTIMISERS[name]
    (choice,) = [action for action in build_parser("train")._actions if action.dest == "optimiser"]
    assert tuple(choice.choices) == tuple(OPTIMISERS)
    assert {choice.type(spelling) for spelling in (name, name.upper(), name.lower(), *info.aliases)} == {name}
    assert {dest: USED_ONLY_WITH[dest] for dest in OPTIONS} == {
        dest: ("optimiser", tuple(other for other, entry in OPTIMISERS.items() if dest in entry.reads))
        for dest in OPTIONS}

    # Every optimiser option given (0.5 is in each one's range).
    given = [part for option in OPTIONS.values() for part in (option.flag, "0.5")]
    resolved = resolve_command_line("train", [*SYNTHETIC_RUN, "--optimiser", name.upper(), *given])
    assert resolved.config.optim.optimiser == name
    unread = [option.flag for dest, option in OPTIONS.items() if dest not in info.reads]
    assert [notice.split()[0] for notice in resolved.notices] == unread
    assert all(notice.startswith(f"{flag} has no effect with --optimiser {name}; it is used by ")
               for notice, flag in zip(resolved.notices, unread))
    printed(resolved.options)
    shown = json.loads(capsys.readouterr().out)
    assert {dest for dest in OPTIONS if shown[dest] is not None} == set(info.reads)

    parameters = sum(p.numel() for p in build_model(resolved.config.model).parameters())
    memory = worker_memory(resolved.config)  # weights, gradients and the state: float32 copies of each parameter
    assert memory.model == parameters * 4 * (2 + info.state_per_parameter)
