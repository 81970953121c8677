"""cnns.parallel.planning: profiling the places a model can be cut, and the balanced pipeline split."""

import contextlib
import itertools
import random

import pytest

import processes
import scripts
import torch

from cnns.cli.parsing import resolve_command_line
from cnns.commands.splits import model_to_plan
from cnns.parallel.planning import balanced_cuts, format_report, profile_cuts, propose, propose_from_profile
from cnns.errors import ConfigError
from cnns.models import ModelSpec, count_parameters, split_points
from cnns.models.split_points import main_split_names

CPU = torch.device("cpu")


def planned(*options: str):
    """The model the planner times for a train.py command line (`model_to_plan`: as one process trains it)."""
    cfg = resolve_command_line("train", ["--generated-data", *options]).config
    model, autocast = model_to_plan(cfg, CPU)
    return cfg.model, model, autocast


def stage_times(seconds, cuts):
    bounds = [0, *(cut + 1 for cut in cuts), len(seconds)]
    return [sum(seconds[start:end]) for start, end in zip(bounds, bounds[1:])]


def brute_force(seconds, allowed, stages):
    return min(max(stage_times(seconds, cuts)) for cuts in itertools.combinations(sorted(allowed), stages - 1))


@pytest.mark.parametrize("seed", range(12))
def test_balanced_cuts_is_optimal(seed):
    rng = random.Random(seed)
    n = rng.randint(8, 12)
    seconds = [rng.uniform(0.1, 5.0) for _ in range(n)]
    stages = rng.randint(2, 4)
    allowed = sorted(rng.sample(range(n - 1), rng.randint(stages - 1, n - 1)))
    cuts = balanced_cuts(seconds, allowed, stages)
    assert len(cuts) == stages - 1 and cuts == sorted(set(cuts)) and set(cuts) <= set(allowed)
    assert max(stage_times(seconds, cuts)) == pytest.approx(brute_force(seconds, allowed, stages))


def test_balanced_cuts_by_hand():
    assert balanced_cuts([1, 1, 1, 1, 4], range(4), 2) == [3]
    assert balanced_cuts([1, 1, 1, 1, 4], [0, 1], 2) == [1]  # the best allowed one, not the best one
    assert balanced_cuts([3, 1, 1, 1, 3], range(4), 3) == [0, 3]
    assert balanced_cuts([1, 2, 3], [0, 1], 1) == []


def test_balanced_cuts_errors():
    with pytest.raises(ConfigError, match="only 1 place to cut, so at most 2 stages"):
        balanced_cuts([1, 1, 1, 1], [2], 3)
    with pytest.raises(ConfigError, match="at least 1 stage"):
        balanced_cuts([1, 1], [0], 0)
    with pytest.raises(ValueError, match="cut indices"):
        balanced_cuts([1, 1, 1], [2], 2)  # after the last piece: an empty last stage


@pytest.fixture(scope="module")
def resnet20():
    spec, model, _ = planned("--dataset", "cifar-10", "--model-size", "20", "--precision", "32.32")
    return spec, model, profile_cuts(spec, model, 8, CPU, contextlib.nullcontext, repeats=2)


def test_resnet20_profile_rows(resnet20):
    spec, model, profile = resnet20
    assert [row.name for row in profile.rows] == main_split_names(spec, model)
    assert [row.cut for row in profile.rows] == list(dict.fromkeys(split_points(spec, model).values()))
    params = [row.params for row in profile.rows]
    assert all(later > earlier for earlier, later in zip(params, params[1:]))
    assert profile.total_params == sum(piece.params for piece in profile.pieces) == count_parameters(model)
    activations = [row.activation_bytes for row in profile.rows]
    assert 0 < activations[0] and all(later > earlier for earlier, later in zip(activations, activations[1:]))
    assert profile.total_activation_bytes >= activations[-1]
    assert all(piece.seconds > 0 for piece in profile.pieces)
    for row in profile.rows:  # the rows are the sums of the pieces before them
        assert row.seconds == pytest.approx(sum(piece.seconds for piece in profile.pieces[:row.piece + 1]))
        assert row.crossing_bytes == profile.pieces[row.piece].output_bytes
    assert profile.total_seconds == pytest.approx(sum(piece.seconds for piece in profile.pieces))
    assert all(parameter.grad is None for parameter in model.parameters())


def test_resnet20_crossing_tensor_is_stage2_output(resnet20):
    spec, model, profile = resnet20
    shapes = []
    hook = model.get_submodule("layer2.0").register_forward_hook(lambda m, a, out: shapes.append(out.shape))
    with torch.no_grad():
        model(torch.randn(8, 3, 32, 32))
    hook.remove()
    assert shapes == [(8, 32, 16, 16)]
    row = next(row for row in profile.rows if row.name == "stage2/unit1/relu")
    assert row.crossing_bytes == 8 * 32 * 16 * 16 * 4


def test_resnet20_proposal_is_consistent_and_balanced(resnet20):
    spec, model, profile = resnet20
    seconds = [piece.seconds for piece in profile.pieces]
    allowed = [row.piece for row in profile.rows]
    proposal = propose_from_profile(profile, 3)
    points = split_points(spec, model)
    assert len(proposal.names) == 2 and all(name in points for name in proposal.names)
    cuts = [next(row.piece for row in profile.rows if row.name == name) for name in proposal.names]
    assert proposal.stage_seconds == pytest.approx(stage_times(seconds, cuts))
    assert max(proposal.stage_seconds) == pytest.approx(brute_force(seconds, allowed, 3))
    report = format_report(proposal)
    assert f"Proposed for --shards 3: --pipeline-splits {' '.join(proposal.names)}" in report
    assert "(slowest)" in report and "balance" in report
    assert all(name in report for name in main_split_names(spec, model))
    with pytest.raises(ConfigError, match="ResNet-20 can be cut in 9 places: at most 10 stages, not 11"):
        propose_from_profile(profile, 11)


def test_efficientnet_sub_block_cuts_and_proposal():
    spec, model, autocast = planned("--dataset", "imagenet", "--num-classes", "10", "--model", "efficientnet",
                                    "--model-size", "B0", "--image-size", "64", "--precision", "32.32")
    proposal = propose(spec, model, 2, 2, CPU, autocast, repeats=1)
    names = [row.name for row in proposal.profile.rows]
    assert names == main_split_names(spec, model)
    assert {"block0", "block1a/b", "block2a", "block2a/b", "block2a/c"} <= set(names)
    assert len(proposal.names) == 1 and proposal.names[0] in split_points(spec, model)
    assert proposal.profile.total_params == count_parameters(model)
    assert sum(proposal.stage_seconds) == pytest.approx(proposal.profile.total_seconds)


# The first case runs `python -m cnns` itself (the one CPU test of that entry point); the second runs the splits
# command in this process (tests/scripts.py), without a new interpreter's seconds of start-up.
@pytest.mark.parametrize("args, rows, stages, child", [
    (["--model", "resnet", "--model-size", "50", "--shards", "4", "--micro-batch-size", "1"], 16, 4, True),
    (["--model", "efficientnet", "--model-size", "B0", "--image-size", "96", "--micro-batch-size", "1"], None, 2, False),
], ids=["resnet50-4-stages", "efficientnet-b0"])
def test_cnns_splits_prints_every_cut_and_a_proposal_that_resolves(args, rows, stages, child, capfd):
    import re
    import sys

    from cnns.models import build_model, resolve_splits

    if child:
        out = processes.run([sys.executable, "-m", "cnns", "splits", *args], capture_output=True, text=True,
                            timeout=300)
    else:
        out = scripts.run_here(capfd, "splits", *args, expect=None)
    assert out.returncode == 0, out.stderr
    proposed = re.search(rf"Proposed for --shards {stages}: --pipeline-splits (.+)", out.stdout).group(1).split()
    spec = (ModelSpec("resnet", "50", 1000, 224) if rows else ModelSpec("efficientnet", "B0", 1000, 96))
    model = build_model(spec)
    assert len(resolve_splits(spec, model, proposed)) == stages - 1
    listed = [line.split()[0] for line in out.stdout.splitlines() if line.split() and line.split()[0] in split_points(spec, model)]
    assert listed == main_split_names(spec, model)
    assert rows is None or len(listed) == rows
    assert "whole model" in out.stdout and "balance" in out.stdout
