"""Every model anyone builds comes from `cnns.engine.assembly.assemble`: training's and validation's
(`cnns.engine.setup.set_up`), predict's and export's (`cnns.deploy.restored_model.restore_model`), inference_embedded.py's
(`cnns.deploy.restored_model.build_inference_model`) and the split planner's (`cnns.commands.splits.model_to_plan`, which
`cnns splits` and --pipeline-splits auto time). Built each way for one configuration and given the same weights,
they hold the same modules (the fused ones included) and compute the same logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from cnns.cli.parsing import resolve_command_line
from cnns.deploy.restored_model import build_inference_model
from cnns.commands.splits import model_to_plan
from cnns.data.augment import normalise
from cnns.deploy.restored_model import input_normalisation, restore_model
from cnns.engine.setup import set_up
from cnns.engine.fusion import _FusedNormAct, _FusedUnit
from cnns.kernels import norm_act as kernels
from cnns.parallel.world import World

CPU = torch.device("cpu")
RN8 = ["--model", "resnet", "--model-size", "8", "--dataset", "cifar-10", "--micro-batch-size", "4",
       "--iterations", "1", "--generated-data", "--seed", "5"]


def modules(model: nn.Module) -> list[tuple[str, type]]:
    return [(name, type(module)) for name, module in model.named_modules()]


def precision_options(precision: str) -> list[str]:
    """--precision, with 16.16's half type given: a CPU without bfloat16 arithmetic then trains in bfloat16 too
    (emulated) instead of falling back to float32, so the 16.16 assembly is checked on every CPU."""
    return ["--precision", precision, *(["--half-dtype", "bfloat16"] if precision == "16.16" else [])]


def built_every_way(precision: str, tmp_path: Path, fused: str) -> dict[str, nn.Module]:
    """The model of one ResNet-8 configuration (--fused-norm `fused`) from each builder, all with the weights
    training drew. A checkpoint holds what training saves (the plain model's state dict); the builders that read
    one load it."""
    cfg = resolve_command_line("train", [*RN8, *precision_options(precision), "--fused-norm", fused]).config
    training = set_up(cfg, World())
    validation = set_up(cfg, World(), train=False)
    weights = training.plain_model.state_dict()
    checkpoint = tmp_path / "ckpt-1.pt"
    torch.save({"model": weights}, checkpoint)
    planned, _ = model_to_plan(cfg, CPU)
    planned.load_state_dict(weights)
    validation.plain_model.load_state_dict(weights)
    infer_cfg = resolve_command_line("infer", [*RN8, *precision_options(precision), "--fused-norm", fused]).config
    return {"training": training.plain_model, "validation": validation.plain_model, "planner": planned,
            "predict and export": restore_model(checkpoint, cfg).model,
            "inference_embedded": build_inference_model(infer_cfg, checkpoint, CPU).model}


def images(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A uint8 NHWC batch (what inference_embedded's graph takes) and the same batch as the device feed
    normalises it for a model of `dtype` (what the others take)."""
    pixels = torch.randint(0, 256, (4, 32, 32, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    cfg = resolve_command_line("train", RN8).config
    return pixels, normalise(pixels, *input_normalisation(cfg), dtype)


@pytest.mark.parametrize("fused", ["off", "on"], ids=["plain", "fused passes"])
def test_every_builder_makes_the_same_float32_model(fused, tmp_path):
    if fused == "on" and not kernels.available():
        pytest.skip("the fused kernels are not built")
    models = built_every_way("32.32", tmp_path, fused)
    reference = modules(models["training"])
    for name, model in models.items():
        assert modules(model) == reference, name
    fused_modules = [m for m in models["training"].modules() if isinstance(m, (_FusedUnit, _FusedNormAct))]
    assert bool(fused_modules) == (fused == "on")

    # One float32 computation everywhere (same modules, weights, layout, threads and kernels): equal bits.
    _, x = images(torch.float32)
    with torch.no_grad():
        logits = {name: model.eval()(x) for name, model in models.items()}
    for name, value in logits.items():
        assert torch.equal(value, logits["training"]), name
    # In training mode (the fused passes' own kernels, batch statistics) the planner times what trains.
    with torch.no_grad():
        assert torch.equal(models["planner"].train()(x), models["training"].train()(x))


@pytest.mark.skipif(not kernels.available(), reason="the fused kernels are not built")
def test_a_16_16_run_deploys_its_own_assembly(tmp_path):
    models = built_every_way("16.16", tmp_path, "on")
    reference = modules(models["training"])
    for name, model in models.items():
        if name != "predict and export":
            assert modules(model) == reference, name
    training, deployed = models["training"], models["predict and export"]
    # predict and export compute in float32, so they hold the float32 model of this configuration: its kernel
    # choice (`cnns.engine.kernel_choice`) is float32's, not bfloat16's.
    float32_config = resolve_command_line("train", [*RN8, "--precision", "32.32", "--fused-norm", "on"]).config
    assert modules(deployed) == modules(set_up(float32_config, World()).plain_model)
    assert training.conv1.weight.dtype == torch.bfloat16 and training.bn1.weight.dtype == torch.float32
    assert deployed.conv1.weight.dtype == torch.float32  # predict and export compute in float32 (their docstrings)
    pixels, x = images(torch.bfloat16)
    with torch.no_grad():
        logits = {name: model.eval()(x).float() for name, model in models.items() if name != "predict and export"}
        embedded = build_inference_model(resolve_command_line("infer", [*RN8, *precision_options("16.16"),
                                                                        "--fused-norm", "on"]).config,
                                         tmp_path / "ckpt-1.pt", CPU)(pixels)  # normalising its uint8 input
        float32 = deployed(x.float())
    # The bfloat16 models (training, validation, planner, inference_embedded's) compute the same thing: equal bits.
    for name, value in logits.items():
        assert torch.equal(value, logits["training"]), name
    assert torch.equal(embedded, logits["training"])
    # predict's float32 computes with the same (bfloat16-exact) weights but keeps float32 activations: each of
    # ResNet-8's 8 layers rounds the bfloat16 model's activations to 8 significant bits (relative 2^-9), and
    # these errors add up to at most 8 x 2^-9 = 1.6 % of the activations' scale (about sqrt(8) x 2^-9 = 0.6 %
    # as they fall, at random signs; measured 0.5 %). Allowed: 3 % of the largest logit.
    scale = logits["training"].abs().max()
    assert torch.allclose(float32, logits["training"], rtol=0, atol=0.03 * float(scale))
