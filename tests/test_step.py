"""cnns.engine.step: the float32 sum of half-precision micro-batch gradients, however the backward
passes are run."""

from __future__ import annotations

import pytest
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


class _ReplayedGradient(torch.autograd.Function):
    """Identity whose backward hands the gradient back in one static buffer, rewritten by every call:
    how a CUDA graph's replay returns its outputs (in the graph's own memory, as a fresh tensor object)."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, static: torch.Tensor) -> torch.Tensor:
        ctx.static = static
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.static.copy_(grad)
        return ctx.static.view_as(ctx.static), None


class _GraphReplayedLinear(nn.Module):
    def __init__(self, inputs: int, outputs: int):
        super().__init__()
        self.linear = nn.Linear(inputs, outputs)
        self.static = torch.zeros_like(self.linear.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = _ReplayedGradient.apply(self.linear.weight, self.static)
        return nn.functional.linear(x, weight, self.linear.bias)


def _accumulating_step(model: nn.Module, keep_gradient_buffers: bool):
    from cnns.engine.step import TrainStep, cross_entropy_loss
    from cnns.optim import HalfPrecisionOptimiser, OptimiserSpec, build_optimiser, parameter_groups
    from cnns.precision import LossScaler, PrecisionPolicy

    optimiser = HalfPrecisionOptimiser(parameter_groups(model, 0.0),
                                       lambda groups: build_optimiser(groups, OptimiserSpec("SGD", lr=0.1)),
                                       stochastic_rounding=False, seed=0)
    policy = PrecisionPolicy.resolve("32.32", "bfloat16", torch.device("cpu"))
    return TrainStep(model, optimiser, policy, LossScaler(1.0, dynamic=False), cross_entropy_loss(0.0), 2,
                     accumulate_in_float32=True, keep_gradient_buffers=keep_gradient_buffers)


def _weights_after_three_updates(make_model, keep_gradient_buffers: bool) -> tuple[torch.Tensor, list[int]]:
    torch.manual_seed(3)
    model = make_model()
    step = _accumulating_step(model, keep_gradient_buffers)
    generator = torch.Generator().manual_seed(5)
    addresses = []
    for _ in range(3):
        batches = [(torch.randn(6, 16, generator=generator), torch.randint(0, 4, (6,), generator=generator))
                   for _ in range(2)]
        step(batches, 0.1)
        addresses.append(step.params[0].grad.data_ptr())
    return step.params[0].detach().clone(), addresses


def test_kept_gradient_buffers_sum_micro_batches_that_a_graph_replay_returns_in_reused_memory():
    """--compile on a GPU replays CUDA graphs, whose gradients live in memory the next micro-batch's
    replay rewrites. Freed between updates, `.grad` would be the first micro-batch's replay output itself
    and the second would add into overwritten memory (its own gradient twice); kept and zeroed in place,
    the update sums both, as a model without replays does."""
    def replayed():
        return nn.Sequential(_GraphReplayedLinear(16, 4))

    def plain():
        return nn.Sequential(nn.Linear(16, 4))

    reference, _ = _weights_after_three_updates(plain, keep_gradient_buffers=False)
    kept, addresses = _weights_after_three_updates(replayed, keep_gradient_buffers=True)
    freed, _ = _weights_after_three_updates(replayed, keep_gradient_buffers=False)
    assert torch.equal(kept, reference)
    assert len(set(addresses)) == 1  # one buffer for the whole run
    assert not torch.allclose(freed, reference, rtol=1e-3, atol=1e-4)  # the hazard is real


def test_kept_gradient_buffers_change_nothing_without_graph_replays():
    reference, _ = _weights_after_three_updates(lambda: nn.Sequential(nn.Linear(16, 4)), keep_gradient_buffers=False)
    kept, _ = _weights_after_three_updates(lambda: nn.Sequential(nn.Linear(16, 4)), keep_gradient_buffers=True)
    assert torch.equal(kept, reference)


@pytest.mark.parametrize("as_computed", [False, True], ids=["after-backward", "pipeline-hooks"])
def test_float32_sums_start_in_memory_of_their_own_not_in_a_replayed_gradient(as_computed):
    """16.16 keeps norm parameters in float32; with --compile on a GPU their gradients are a CUDA graph's
    outputs, rewritten by the next micro-batch's replay. The float32 sum over micro-batches must start from a
    copy, or it ends up holding the last micro-batch's gradient twice (the CUDA tier's 'accessing tensor output
    of CUDAGraphs that has been overwritten' failure)."""
    from cnns.engine.step import FloatGradientAccumulator

    norm_scale = nn.Parameter(torch.ones(4))  # float32, as 16.16's norm parameters
    replay_memory = torch.zeros(4)
    accumulator = FloatGradientAccumulator([norm_scale], enabled=True)
    if as_computed:
        accumulator.accumulate_as_computed()  # the pipeline's way: a hook as each gradient is accumulated
    gradients = [torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([10.0, 20.0, 30.0, 40.0])]
    for gradient in gradients:
        (_ReplayedGradient.apply(norm_scale, replay_memory) * gradient).sum().backward()
        if not as_computed:
            accumulator.after_backward()
    [summed] = accumulator.gradients()
    assert summed.dtype == torch.float32 and torch.equal(summed, gradients[0] + gradients[1])
