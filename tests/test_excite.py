"""Fused squeeze-excitation (cnns.kernels.excite via cnns.engine.fusion) against timm's SqueezeExcite.

References are float64 copies of the same module. Tolerances come from the computation: in float32 every value
is a sum of at most H*W + C products accumulated in float32 (error below that many units of 2^-24 of the
scale); in bfloat16 each value passes through at most eight roundings of 2^-9 (half a bfloat16 ulp): the
channel mean, the two 1x1 convolutions, their activations, the gate, the product, and the gradient's sums.
"""

from __future__ import annotations

import copy

import pytest
import torch
from timm.models._efficientnet_blocks import SqueezeExcite
from torch import nn

from cnns.engine.fusion import fuse_squeeze_excitation
from cnns.engine.recomputation import recompute_blocks
from cnns.kernels import norm_act
from cnns.models import build_model
from cnns.models.model_spec import ModelSpec

pytestmark = pytest.mark.skipif(not norm_act.available(), reason="the fused passes were not built")


def _tolerance(dtype: torch.dtype, h: int, w: int, c: int) -> float:
    """Relative to the largest magnitude of the compared tensor."""
    return (h * w + c) * 2.0 ** -24 if dtype == torch.float32 else 8 * 2.0 ** -9


def _run(module, x, grad, autocast=False):
    x = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = module(x)
    y.backward(grad.to(y.dtype))
    return [y, x.grad] + [p.grad for p in module.parameters()]


# (N, C, reduced channels, H, W): EfficientNet-B0 SE shapes, odd sizes, a channel tail, batch 1.
SHAPES = [(4, 144, 6, 13, 11), (2, 96, 4, 28, 28), (1, 1152, 48, 7, 7), (3, 40, 10, 5, 9), (2, 24, 2, 1, 1)]


@pytest.mark.parametrize("precision", ["32.32", "16.16", "16.32"])
@pytest.mark.parametrize("n,c,rd,h,w", SHAPES)
def test_fused_squeeze_excitation_equals_timm_within_rounding(n, c, rd, h, w, precision):
    torch.manual_seed(c + h)
    plain = SqueezeExcite(c, rd_channels=rd, act_layer=nn.SiLU).to(memory_format=torch.channels_last)
    dtype = torch.bfloat16 if precision == "16.16" else torch.float32
    plain = plain.to(dtype)
    fused = copy.deepcopy(plain)
    assert fuse_squeeze_excitation(fused) == 1
    reference = copy.deepcopy(plain).double()
    x = torch.randn(n, c, h, w).contiguous(memory_format=torch.channels_last)
    grad = torch.randn_like(x)
    autocast = precision == "16.32"
    expected = _run(reference, x.double(), grad.double())
    got = _run(fused, x.to(dtype), grad, autocast)
    torch_got = _run(plain, x.to(dtype), grad, autocast)
    tolerance = _tolerance(torch.bfloat16 if precision != "32.32" else torch.float32, h, w, c)
    for e, g, t in zip(expected, got, torch_got):
        assert g.dtype == t.dtype and g.shape == t.shape
        scale = e.abs().max().item()
        assert (g.double() - e).abs().max().item() <= tolerance * scale
        assert (t.double() - e).abs().max().item() <= tolerance * scale  # the bound holds for timm's too
    assert got[0].is_contiguous(memory_format=torch.channels_last)
    assert got[1].is_contiguous(memory_format=torch.channels_last)


def test_a_built_efficientnet_fuses_every_block_and_keeps_its_state_dict_and_evaluation():
    torch.manual_seed(0)
    spec = ModelSpec("efficientnet", "B0", 10, 64)
    plain = build_model(spec).to(memory_format=torch.channels_last)
    fused = copy.deepcopy(plain)
    assert fuse_squeeze_excitation(fused) == 16
    assert fuse_squeeze_excitation(fused) == 0  # once only
    assert list(fused.state_dict()) == list(plain.state_dict())
    x = torch.randn(2, 3, 64, 64).contiguous(memory_format=torch.channels_last)
    plain.eval(), fused.eval()
    with torch.no_grad():
        assert torch.equal(plain(x), fused(x))  # evaluation runs timm's own forward


def test_recomputed_blocks_give_the_same_gradients():
    """Activation checkpointing runs the fused forward twice: the gradients must not change."""
    torch.manual_seed(0)
    spec = ModelSpec("efficientnet", "B0", 10, 64)
    model = build_model(spec).to(memory_format=torch.channels_last)
    fuse_squeeze_excitation(model)
    recomputed = copy.deepcopy(model)
    assert recompute_blocks(recomputed, ["blocks.1", "blocks.3"]) == 2
    x = torch.randn(2, 3, 64, 64).contiguous(memory_format=torch.channels_last)
    grads = []
    for m in (model, recomputed):
        m.train()
        m(x).square().sum().backward()
        grads.append([p.grad for p in m.parameters()])
    for a, b in zip(*grads):
        assert torch.equal(a, b)
