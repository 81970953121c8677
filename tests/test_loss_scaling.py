"""Loss scaling and the float32 norm hooks: the float16 machinery of CUDA runs, exercised on the CPU
(CPU autocast and kernels take float16 too): the scaler's arithmetic, a run that overflows and
recovers, and group norm kept in float32 inside a float16 model."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from cnns.cli import run_script as run_command
from cnns.precision import LossScaler, PrecisionPolicy


def test_a_dynamic_scale_skips_an_overflow_halves_and_grows_back():
    scaler = LossScaler(1024.0, dynamic=True, growth_interval=3)
    grads = [torch.tensor([2048.0, math.inf])]
    assert scaler.unscale_(grads) is False  # skip this update
    assert (scaler.scale, scaler.clean_steps) == (512.0, 0)
    for step in range(3):
        grads = [torch.tensor([512.0, -1024.0])]
        assert scaler.unscale_(grads) is True
        assert torch.equal(grads[0], torch.tensor([1.0, -2.0]))  # divided by the scale of the step
    assert (scaler.scale, scaler.clean_steps) == (1024.0, 0)  # grown after 3 clean updates
    restored = LossScaler(1.0, dynamic=True, growth_interval=3)
    restored.load_state_dict(scaler.state_dict())
    assert (restored.scale, restored.clean_steps) == (1024.0, 0)
    assert scaler.unscale_([torch.ones(4), torch.ones(3, 2), torch.tensor([1.0, math.nan])]) is False  # any tensor
    assert scaler.scale == 512.0
    never_below_one = LossScaler(1.0, dynamic=True)
    never_below_one.unscale_([torch.tensor([math.nan])])
    assert never_below_one.scale == 1.0


def test_a_static_scale_only_divides_and_never_reads_back():
    scaler = LossScaler(128.0, dynamic=False)
    assert scaler.scale_loss(torch.tensor(2.0)).item() == 256.0
    grads = [torch.tensor([256.0, math.inf])]
    assert scaler.unscale_(grads) is True  # no check: static scaling never synchronises
    assert grads[0][0].item() == 2.0 and scaler.scale == 128.0


@pytest.fixture(scope="module")
def data_dir(shapes_cifar10) -> Path:
    return shapes_cifar10("scaling", train=32, test=16, seed=9)


def test_a_float16_run_that_overflows_skips_updates_backs_off_and_then_trains(data_dir, tmp_path):
    folder = tmp_path / "run"
    start = 2.0**24  # float16 gradients of a loss scaled by 2^24 overflow (float16's largest is 65504)
    assert run_command("train", ["--dataset", "cifar-10", "--data-dir", str(data_dir), "--model-size", "8",
                                 "--precision", "16.16", "--half-dtype", "float16", "--auto-loss-scaling",
                                 "--loss-scaling", str(start), "--micro-batch-size", "8", "--iterations", "16",
                                 "--log-freq", "1", "--ckpts-per-epoch", "4", "--warmup-epochs", "0",
                                 "--no-validation", "--seed", "4", "--logs-path", str(folder)]) == 0
    states = {i: torch.load(folder / f"ckpt-{i}.pt", weights_only=True) for i in range(17)}
    scales = [states[i]["loss_scaler"]["scale"] for i in range(17)]
    assert scales[0] == start and scales[1] == start / 2  # the first update overflowed ...
    assert torch.equal(states[1]["model"]["conv1.weight"], states[0]["model"]["conv1.weight"])  # ... and was skipped
    recovered = next(i for i in range(1, 17) if scales[i] == scales[i - 1])  # a clean update: the scale holds
    assert scales[recovered] < start and all(b <= a for a, b in zip(scales, scales[1:]))
    # From there on the updates are applied, and the weights are finite float16.
    last = states[16]["model"]["conv1.weight"]
    assert last.dtype == torch.float16 and torch.isfinite(last).all()
    assert not torch.equal(last, states[recovered - 1]["model"]["conv1.weight"])


def test_group_norm_runs_in_float32_inside_a_float16_model_where_the_device_needs_it():
    # On CUDA, group norm has no kernel for float16 input with float32 parameters: hooks cast around it.
    # The hooks are the same on any device, so they run here on the CPU with the CUDA policy.
    policy = PrecisionPolicy(torch.float16, torch.float16, "cuda", use_autocast=False)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.GroupNorm(4, 8), nn.Conv2d(8, 8, 3), nn.BatchNorm2d(8))
    reference = nn.Sequential(nn.Conv2d(3, 8, 3), nn.GroupNorm(4, 8), nn.Conv2d(8, 8, 3), nn.BatchNorm2d(8))
    reference.load_state_dict(model.state_dict())
    policy.apply_to_model(model)
    assert model[1]._forward_pre_hooks and not model[3]._forward_pre_hooks  # batch norm takes float16 on CUDA
    assert model[1].weight.dtype == model[3].weight.dtype == torch.float32
    assert set(model.state_dict()) == set(reference.state_dict())  # hooks, not wrappers: the same keys
    x = torch.randn(2, 3, 12, 12)
    out = model[:2](x.half())
    out.float().sum().backward()
    assert out.dtype == torch.float16 and model[1].weight.grad.dtype == torch.float32
    # Two float16 roundings (the convolution's input and output) of values the norm scales to |x| < 4:
    # 2 x 4 x 2^-11 = 0.004.
    torch.testing.assert_close(out.float(), reference[:2](x), atol=0.01, rtol=0.01)
