"""timm's image classifiers by their timm names (issue 69): a table of models from several timm families, each
training a few updates on real images (scikit-learn's handwritten digits as CIFAR-10 files, tests/digit_records.py)
and learning them, exported as safetensors and loaded back by timm the way `cnns export` prints, predicting as
`cnns predict` does; cut at the model's own stages into pieces that are the model, two pipeline stages equal to one
process, recomputation per stage changing no number, --group-norm replacing every batch norm.
"""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import scripts
from digit_records import TRAIN_IMAGES, write_digits_cifar10
from stage_checks import assert_stages_are_the_model
from test_replicas import relative_difference

from cnns.models import ModelSpec, build_model, count_parameters, split_points
from cnns.models.split_points import model_pieces, resolve_splits, stage_pieces

# Five timm families: ConvNeXt (layer norm, no batch norm), RegNet, MobileNetV3 (squeeze-excitation, hard-swish),
# ResNet-D (deep stem, average-pool shortcuts), GhostNet.
TIMM_MODELS = ["convnext_atto", "regnetx_002", "mobilenetv3_small_100", "resnet18d", "ghostnet_100"]
PREDICTED = 20  # held-out digits predicted both ways


@pytest.fixture(scope="module")
def digits(tmp_path_factory) -> Path:
    return write_digits_cifar10(tmp_path_factory.mktemp("digits-cifar"))


@pytest.fixture(scope="module")
def digit_pngs(tmp_path_factory) -> Path:
    """The first held-out digits as 32x32 PNG files, for `cnns predict` and timm's transform alike."""
    from sklearn.datasets import load_digits

    folder = tmp_path_factory.mktemp("digit-pngs")
    images = load_digits().images[TRAIN_IMAGES:TRAIN_IMAGES + PREDICTED]
    for index, image in enumerate(images):
        pixels = np.kron((image * 255 / 16).astype(np.uint8), np.ones((4, 4), np.uint8))
        Image.fromarray(np.stack([pixels] * 3, axis=-1)).save(folder / f"{index:02d}.png")
    return folder


def logged(run: Path) -> tuple[list[float], float]:
    with open(run / "training.csv") as file:
        losses = [float(row["loss_batch"]) for row in csv.DictReader(file)]
    with open(run / "validation.csv") as file:
        return losses, float(list(csv.DictReader(file))[-1]["val_acc"])


# The run: cnns's defaults (16.16 with stochastic rounding, the model's own normalisation, timm's ImageNet input
# statistics) but AdamW (the optimiser timm's recipes train these with, at its default learning rate here, 0.002;
# SGD's 0.5 is the CIFAR ResNets'), 96 updates of 32 digits, validated on the 297 held out. A run this short needs
# batch norm's running statistics to follow faster than Graphcore's 0.97 lets them (--BN-decay 0.9).
TRAINING = ("--optimiser", "AdamW", "--iterations", "96", "--log-freq", "16", "--warmup-epochs", "0",
            "--BN-decay", "0.9", "--ckpts-per-epoch", "0", "--pipeline-num-parallel", "0", "--seed", "5")
# GhostNet is cut into pieces below, not trained: the suite's time. RegNetX-200MF learns too slowly at 0.002 for 96
# updates (measured: 27 % held out at 0.0005, 39 % at 0.006): its own learning rate.
LEARNING = {"convnext_atto": (), "regnetx_002": ("--abs-learning-rate", "0.006"), "mobilenetv3_small_100": (),
            "resnet18d": ()}


@pytest.mark.slow
@pytest.mark.parametrize("name", LEARNING)
def test_a_timm_model_learns_the_digits_and_timm_reloads_its_export_as_cnns_predicts(
        name, digits, digit_pngs, tmp_path, capfd):
    import timm

    run = tmp_path / "run"
    out = scripts.run_here(capfd, "train.py", "--model", name, "--data-dir", str(digits), *TRAINING,
                           *LEARNING[name], "--logs-path", str(run)).stdout
    assert f"{name} on cifar-10" in out and "precision 16.16" in out
    assert re.search(r" Fused passes: (\d+ layers|none)", out)
    assert f"Total Parameters:{count_parameters(timm.create_model(name, num_classes=10))}" in out
    assert json.loads((run / "arguments.json").read_text())["name"] == f"{name}_bs32_16.16"
    losses, accuracy = logged(run)
    assert np.mean(losses[-2:]) < np.mean(losses[:2]), losses  # it learns: the loss falls...
    # ... and the held-out digits are told apart: chance is 10 % (29.7 of 297, spread 1.7 %); measured 21 %
    # (MobileNetV3, the slowest to start) to 90 % (ResNet-18-D).
    assert accuracy > 15.0, accuracy

    export = tmp_path / "export"
    printed = scripts.run_here(capfd, "export", "--restore-path", str(run), "--format", "safetensors",
                               "--out", str(export)).stdout
    assert f"timm's {name}" in printed
    # The printed way to load it, run as printed: timm's model and its transform from config.json.
    line = next(line for line in printed.splitlines() if line.startswith("run: ")).removeprefix("run: ")
    namespace: dict = {}
    exec(line.split("  #")[0], namespace)  # noqa: S102 - the line cnns printed for the user to run
    model, transform = namespace["model"], namespace["transform"]
    files = sorted(digit_pngs.iterdir())
    with torch.no_grad():
        theirs = torch.cat([model(transform(Image.open(f).convert("RGB"))[None]).softmax(-1) for f in files])
    done = scripts.run_here(capfd, "predict", "--restore-path", str(run), str(digit_pngs), "--top-k", "10", "--json")
    ours = torch.tensor([[p["probability"] for p in sorted(json.loads(row)["top_k"], key=lambda p: p["class"])]
                         for row in done.stdout.splitlines()])
    assert torch.equal(theirs.argmax(-1), ours.argmax(-1))  # 20 of 20 agree
    # cnns predict runs the 16.16 run's weights in float32 as timm does, on pixels resized alike (a 32 px image is
    # taken as it is both ways) and normalised by the same constants: they differ by predict's 4 decimals and the
    # kernels' order of summation (channels_last, fused passes), far below 1e-3.
    assert torch.allclose(theirs, ours, atol=1e-3), (theirs - ours).abs().max()


@pytest.mark.parametrize("name", TIMM_MODELS)
def test_pieces_cut_at_the_models_own_stages_are_the_model(name):
    import timm

    spec = ModelSpec(name, "", 10, 32)
    model = build_model(spec).eval()
    points = split_points(spec, model)
    own = [info["module"] for info in timm.create_model(name).feature_info]
    assert set(points.values()) <= set(own) and len(set(points.values())) >= 3, (points, own)
    names = [f"stage{i}" for i in (1, 2, 3)]
    cuts = resolve_splits(spec, model, names)
    stages = stage_pieces(model_pieces(spec, model, cuts), cuts)
    assert_stages_are_the_model(model, stages, torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0)))


def test_recomputation_per_stage_changes_no_number():
    from cnns.engine.recomputation import recompute

    spec = ModelSpec("resnet18d", "", 10, 32)
    torch.manual_seed(0)
    plain = build_model(spec)
    recomputed = build_model(spec)
    recomputed.load_state_dict(plain.state_dict())
    recompute(recomputed, spec, None, between_splits=False)
    x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    for model in (plain, recomputed):
        model(x).logsumexp(-1).sum().backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), recomputed.named_parameters()):
        assert torch.equal(a.grad, b.grad), name


def test_group_norm_replaces_every_batch_norm_and_keeps_the_parameter_count():
    with_batch_norm = build_model(ModelSpec("mobilenetv3_small_100", "", 10, 32))
    with_group_norm = build_model(ModelSpec("mobilenetv3_small_100", "", 10, 32, norm="group", groups=8))
    assert count_parameters(with_group_norm) == count_parameters(with_batch_norm)
    assert not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in with_group_norm.modules())
    assert type(with_group_norm.bn1.act) is type(with_batch_norm.bn1.act)  # the activation kept
    assert with_group_norm(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_the_split_names_are_listed_for_a_timm_model(capfd, monkeypatch):
    monkeypatch.setenv("DATA_DIR", "/nowhere/cifar-10")
    out = scripts.run_here(capfd, "train.py", "--model", "convnext_atto", "--dataset", "cifar-10", "--pipeline",
                           "--shards", "2").stdout
    assert "stages.0 (stage1), stages.1 (stage2), stages.2 (stage3), stages.3 (stage4)" in out


# Two pipeline stages of a timm model update as one process with the same 4 micro-batches (test_pipeline's claim
# for the seed's models): 16.16 with bfloat16 weights rounded to nearest, so that both sides round alike, batch norm
# per micro-batch, one thread in every process.
PIPELINE = ("--model", "mobilenetv3_small_100", "--precision", "16.16", "--half-dtype", "bfloat16",
            "--no-stochastic-rounding", "--micro-batch-size", "8", "--gradient-accumulation-count", "4",
            "--iterations", "3", "--log-freq", "3", "--ckpts-per-epoch", "0", "--seed", "3", "--optimiser", "momentum",
            "--warmup-epochs", "0", "--no-validation", "--pipeline-num-parallel", "0")


@pytest.mark.multiprocess
def test_two_stages_of_a_timm_model_update_as_one_process(digits, tmp_path, capfd):
    one, two = tmp_path / "one", tmp_path / "two"
    scripts.train_here(*PIPELINE, "--data-dir", str(digits), "--logs-path", str(one))
    out = scripts.run_here(capfd, "train.py", *PIPELINE, "--shards", "2", "--pipeline", "--pipeline-splits",
                           "stage3", "--threads-per-worker", "1", "--data-dir", str(digits),
                           "--logs-path", str(two)).stdout
    assert "Pipeline stage 1 of 2" in out
    assert relative_difference(two / "ckpt-3.pt", one / "ckpt-3.pt") == 0.0
    mine, theirs = (torch.load(f / "ckpt-3.pt", weights_only=True)["model"] for f in (two, one))
    assert list(mine) == list(theirs)
    for key, value in theirs.items():
        assert torch.equal(mine[key], value), key
