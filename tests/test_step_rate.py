"""The training step's images/s as --decode-device auto estimates it on a GPU (`cnns.engine.step_rate`): the FLOPs
counted without computing anything, and the estimate's arithmetic with the GPU's matmul rate injected (the GPU
measurement itself runs only on a GPU)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from cnns.engine import step_rate
from cnns.models import build_model
from cnns.models.model_spec import ModelSpec


@pytest.mark.parametrize("spec", [ModelSpec("resnet", "20", 10, 32), ModelSpec("resnet", "18", 1000, 64)])
def test_flops_counted_on_the_meta_device_are_those_of_a_real_forward_pass(spec):
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        build_model(spec).eval()(torch.zeros(1, 3, spec.image_size, spec.image_size))
    assert step_rate.forward_flops(spec) == counter.get_total_flops()


def test_the_estimate_is_the_matmul_rate_share_over_the_training_flops(monkeypatch):
    spec = ModelSpec("resnet", "20", 10, 32)
    monkeypatch.setattr(step_rate, "matmul_flops_per_second", lambda device, dtype: 500e12)
    expected = step_rate.STEP_SHARE_OF_MATMUL_RATE * 500e12 / (3 * step_rate.forward_flops(spec))
    assert step_rate.estimated_step_rate(spec, torch.device("cuda", 0), torch.bfloat16) == pytest.approx(expected)
