"""Options say what they do: the run's header and --print-config show the optimiser as it really updates (the
default SGD without momentum), and an option that changes nothing with the choices made gets one notice naming
what would use it. The table of such options (`cnns.config.table.USED_ONLY_WITH`) is held here to what the
optimisers and schedules really read."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from torch import nn

import scripts
from cnns.config.table import OPTIMISERS, USED_ONLY_WITH, has_effect
from cnns.optim import OptimiserSpec, optimiser_recipe, parameter_groups
from cnns.schedules import SCHEDULE_KINDS, ScheduleSpec, lr_at


@pytest.fixture(scope="module")
def data_dir(shapes_cifar10) -> Path:
    return shapes_cifar10("effects", train=32, test=8, seed=7)


def header_and_notices(capfd, data_dir: Path, tmp_path: Path, *options: str) -> tuple[str, list[str]]:
    out = scripts.run_here(capfd, "train.py", "--dataset", "cifar-10", "--data-dir", str(data_dir), "--model-size", "8",
                           "--compile-only", "--logs-path", str(tmp_path / "run"), *options)
    lines = out.stdout.splitlines()
    header = next(line for line in lines if line.startswith(" Learning Rate:"))
    return header, [line for line in lines if line.startswith("notice: ")]


def test_sgd_says_it_has_no_momentum_and_a_momentum_given_to_it_gets_one_notice(data_dir, tmp_path, capfd):
    header, notices = header_and_notices(capfd, data_dir, tmp_path, "--lr-schedule", "cosine", "--weight-decay",
                                         "5e-4", "--momentum", "0.8", "--abs-learning-rate", "0.1")
    assert header == " Learning Rate: 0.1 (cosine, SGD without momentum, weight decay 0.0005)"
    assert notices == ["notice: --momentum has no effect with --optimiser SGD; it is used by --optimiser momentum, "
                       "RMSprop or LARS"]


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
        "notice: --weight-decay has no effect with --optimiser LARS; it is used by --optimiser SGD, momentum or "
        "RMSprop",
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
    cls, groups, arguments = optimiser_recipe(parameter_groups(nn.Linear(2, 2), spec.weight_decay), spec)
    return cls, arguments, [{key: value for key, value in group.items() if key != "params"} for group in groups]


OPTIMISER_FIELDS = {dest for dest, (chooser, _) in USED_ONLY_WITH.items()
                    if chooser == "optimiser" and dest in {f.name for f in dataclasses.fields(OptimiserSpec)}}


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
