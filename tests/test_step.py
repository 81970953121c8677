"""cnns.engine.step: the float32 sum of half-precision micro-batch gradients, however the backward
passes are run."""

from __future__ import annotations

import torch
from torch import nn

from cnns.engine.step import FloatGradientAccumulator


def _half_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to(torch.bfloat16)


def _micro_batches():
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(8, 16, generator=generator).to(torch.bfloat16) for _ in range(4)]


def test_gradients_summed_as_computed_equal_the_sum_after_each_backward():
    """A pipeline schedule runs the backward passes itself: post-accumulate hooks add each half
    gradient to the float32 sum as autograd produces it, which must equal the step's own rule (sum
    after every backward) and differ from what bfloat16 .grad accumulation would give."""
    by_step, by_hooks, native = _half_model(), _half_model(), _half_model()
    after_each = FloatGradientAccumulator(list(by_step.parameters()), enabled=True)
    as_computed = FloatGradientAccumulator(list(by_hooks.parameters()), enabled=True)
    as_computed.accumulate_as_computed()
    for x in _micro_batches():
        by_step(x).float().square().mean().backward()
        after_each.after_backward()
        by_hooks(x).float().square().mean().backward()
        native(x).float().square().mean().backward()
    assert all(p.grad is None for p in by_hooks.parameters())  # freed as they were summed
    sums, hooked = after_each.gradients(), as_computed.gradients()
    assert all(s.dtype == torch.float32 for s in hooked)
    for a, b in zip(sums, hooked):
        assert torch.equal(a, b)
    assert any(not torch.equal(s, p.grad.float()) for s, p in zip(sums, native.parameters()))
    assert as_computed.buffers is None  # handed over: the next update starts from zero
