"""The option rules and defaults that cnns.config states once, each tested where it is stated (issue 46: a rule
checked in two layers, or a default written in three, drifts)."""

from __future__ import annotations

import pytest

from cnns.config import RunConfig
from cnns.config.defaults import EXPONENTIAL_DECAY_RATE, EXPONENTIAL_DROPS, check_bn_span, resolve
from cnns.config.table import build_parser, option_defaults
from cnns.errors import ConfigError


def resolved(**values) -> dict:
    """train.py's options resolved as a command line giving `values` (a CIFAR folder's) resolves them."""
    return resolve({**option_defaults("train"), "dataset": "cifar-10", "data_dir": "/nonexistent/cifar10", **values})


# --BN-span: a span is that many replicas of one stage, so it divides --replicas (cnns.config.defaults)


@pytest.mark.parametrize("span, replicas", [(1, 3), (1, 1), (2, 4), (4, 4), (3, 6), (2, "auto")])
def test_a_bn_span_that_divides_the_replicas_is_accepted(span, replicas):
    check_bn_span(span, replicas)


def test_a_bn_span_without_replicas_is_one_line():
    with pytest.raises(ConfigError, match=r"^--BN-span 2 spans replicas: give --replicas \(a multiple of it\)$"):
        check_bn_span(2, 1)


@pytest.mark.parametrize("span, replicas", [(3, 4), (4, 6), (5, 2)])
def test_a_bn_span_that_does_not_divide_the_replicas_is_one_line(span, replicas):
    with pytest.raises(ConfigError, match=rf"^--BN-span {span} must divide --replicas {replicas}$"):
        check_bn_span(span, replicas)


def test_resolving_the_options_applies_the_bn_span_rule():
    with pytest.raises(ConfigError, match="--BN-span 3 must divide --replicas 4"):
        resolved(replicas=4, BN_span=3)
    assert resolved(replicas=4, BN_span=2)["BN_span"] == 2


# The pipeline's layout (--shards, --pipeline-splits, --pipeline-schedule): one declaration (cnns.config.table) for
# train.py and for restore.py's new layout


def _layout(script: str, argv: list[str]) -> tuple:
    args = build_parser(script).parse_args(argv)
    return args.shards, args.pipeline_splits, args.pipeline_schedule


@pytest.mark.parametrize("script", ["train", "restore"])
def test_train_and_restore_read_the_pipeline_layout_alike(script):
    restore_path = ["--restore-path", "run"] if script == "restore" else []
    argv = [*restore_path, "--shards", "3", "--pipeline-split", "layer1", "layer2", "--pipeline-schedule", "Sequential"]
    assert _layout(script, argv) == (3, ["layer1", "layer2"], "Sequential")
    assert _layout(script, restore_path) == (None, None, None)


def test_train_takes_pipeline_splits_without_names_and_restore_does_not():
    """train.py --pipeline-splits alone prints the names it takes; restore.py's names the new layout's cuts."""
    assert _layout("train", ["--pipeline-splits"])[1] == []
    with pytest.raises(SystemExit) as stopped:
        _layout("restore", ["--restore-path", "run", "--pipeline-splits"])
    assert stopped.value.code == 2


# The exponential schedule's defaults (--lr-decay-rate 0.97, --lr-drops 146): stated once, in cnns.config.defaults


def test_the_exponential_schedule_s_defaults_are_filled_once_as_the_options_resolve():
    exponential = resolved(lr_schedule="exponential")
    assert (exponential["lr_decay_rate"], exponential["lr_drops"]) == (EXPONENTIAL_DECAY_RATE, EXPONENTIAL_DROPS)
    assert (EXPONENTIAL_DECAY_RATE, EXPONENTIAL_DROPS) == (0.97, 146)  # Graphcore's application's
    given = resolved(lr_schedule="exponential", lr_drops=7)
    assert (given["lr_decay_rate"], given["lr_drops"]) == (0.97, 7)
    optim = RunConfig.from_options({**exponential, "seed": 1}).optim
    assert (optim.lr_decay_rate, optim.lr_drops) == (0.97, 146)


def test_another_schedule_leaves_the_exponential_parameters_unset():
    """RunConfig does not default them a second time: a stepped run has no drops to count."""
    stepped = resolved(lr_schedule="stepped")
    assert stepped["lr_decay_rate"] is None and stepped["lr_drops"] is None
    optim = RunConfig.from_options({**stepped, "seed": 1}).optim
    assert optim.lr_decay_rate is None and optim.lr_drops is None


# LAMB's rule (its entry in cnns.optim): the gradient is clipped by the whole model's norm, so LAMB is refused where
# a process steps only a part of the model, before anything is written


@pytest.mark.parametrize("values", [{"pipeline": True, "shards": 2}, {"rts": True, "replicas": 2}])
def test_lamb_is_refused_where_a_process_steps_a_part_of_the_model(values):
    with pytest.raises(ConfigError, match="^--optimiser LAMB clips the gradient by the whole model's norm, which a "
                                          "pipeline stage or an --rts shard does not see"):
        resolved(optimiser="LAMB", **values)
    assert resolved(optimiser="AdamW", **values)["optimiser"] == "AdamW"


def test_lamb_takes_replicas_which_average_the_whole_gradient_and_rts_of_one_replica():
    assert resolved(optimiser="LAMB", replicas=2)["optimiser"] == "LAMB"
    assert resolved(optimiser="LAMB", rts=True, replicas=1)["optimiser"] == "LAMB"
