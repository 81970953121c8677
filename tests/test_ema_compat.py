"""The weight EMA keeps a float32 average of half-precision weights, on every timm cnns supports.

timm 1.0.29's ModelEmaV3 has no `dtype` argument and 1.0.31's has one (engine/ema.py says how one path
serves both). These tests run against whichever timm is importable; to check the lower end of the range:
    pip install --no-deps --target /tmp/timm129 timm==1.0.29
    PYTHONPATH=/tmp/timm129 .venv/bin/python -m pytest tests/test_ema_compat.py
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cnns.engine.ema import WeightEma, build_ema
from cnns.errors import ConfigError

DECAY = 0.999


def small_model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4)).to(dtype)


def shift_weights(model: nn.Module, step: float) -> dict[str, torch.Tensor]:
    """Move every weight by `step` in place, in the model's dtype; returns the new weights in float64."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(step)
    return {k: v.double() for k, v in model.state_dict().items() if v.is_floating_point()}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_average_of_half_weights_is_float32_and_moves_by_updates_the_half_type_cannot_hold(dtype):
    model = small_model(dtype)
    with torch.no_grad():  # weights in [1, 1.5): a shift by 0.25 is exact in either half type
        for p in model.parameters():
            p.copy_(torch.rand(p.shape) * 0.5 + 1)
    start = {k: v.double() for k, v in model.state_dict().items() if v.is_floating_point()}
    ema = WeightEma(model, DECAY)
    assert all(v.dtype == torch.float32 for v in ema.state_dict().values() if v.is_floating_point())
    # The average starts at the weights exactly (a half value is exact in float32).
    assert all(torch.equal(ema.state_dict()[k].double(), v) for k, v in start.items())

    # The test means something only where a half-precision average could not move: one update
    # (1 - decay) * 0.25 is below half the spacing of either half type in [1, 2), so it would round away.
    weight = model[0].weight.detach()
    assert torch.equal(weight + (1 - DECAY) * 0.25, weight)
    target = shift_weights(model, 0.25)

    steps = 50
    for _ in range(steps):
        ema.update(model)
    # Closed form for a constant target: ema_n = target + (start - target) * decay^n. Each float32 lerp
    # rounds at most twice, each by half an ulp of values below 2 (2^-24); twice that per step as margin.
    tolerance = steps * 2 * 2.0**-23
    for k, t in target.items():
        expected = t + (start[k] - t) * DECAY**steps
        assert (ema.state_dict()[k].double() - expected).abs().max().item() < tolerance, k
    moved = 0.25 * (1 - DECAY**steps)  # about 0.012, some 3000 tolerances
    for k in ("0.weight", "0.bias", "1.weight", "3.weight"):
        assert torch.allclose(ema.state_dict()[k].double() - start[k], torch.full_like(start[k], moved),
                              rtol=0, atol=tolerance), k


def test_integer_buffers_are_copied_and_a_loaded_average_continues_exactly():
    model = small_model(torch.bfloat16)
    ema = WeightEma(model, DECAY)
    model.train()
    for _ in range(3):
        model(torch.randn(5, 8, dtype=torch.bfloat16))  # BatchNorm counts batches and moves its statistics
        ema.update(model)
    state = ema.state_dict()
    assert state["1.num_batches_tracked"].dtype == torch.int64 and state["1.num_batches_tracked"].item() == 3

    resumed = WeightEma(small_model(torch.bfloat16), DECAY)
    resumed.load_state_dict({k: v.clone() for k, v in state.items()})
    shift_weights(model, 0.125)
    ema.update(model)
    resumed.update(model)
    assert all(torch.equal(resumed.state_dict()[k], v) for k, v in ema.state_dict().items())


def test_float32_weights_are_averaged_in_place_of_a_copy():
    model = small_model(torch.float32)
    ema = build_ema(model, DECAY)
    start = model[0].weight.detach().clone()
    shift_weights(model, 1.0)
    ema.update(model)
    # One lerp: start + (1 - decay) * 1.0, rounded once in float32.
    torch.testing.assert_close(ema.state_dict()["0.weight"], start + (1 - DECAY), rtol=0, atol=2.0**-22)
    assert build_ema(model, None) is None


@pytest.mark.parametrize("decay", [0.0, 1.0, -0.5, 1.5])
def test_a_decay_outside_0_1_is_one_line(decay):
    with pytest.raises(ConfigError, match=r"--ema-decay must be between 0 and 1"):
        WeightEma(small_model(torch.float32), decay)
