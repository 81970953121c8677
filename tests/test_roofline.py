"""The roofline of `cnns benchmark` (cnns.bench.roofline): FLOPs and minimal bytes per operator, in closed form."""

from __future__ import annotations

import pytest
import torch

from cnns.bench.roofline import OpCost, _OpRecorder, model_operators, roofline_seconds, update_seconds
from cnns.models.model_spec import ModelSpec


def _record(fn, *tensors):
    recorder = _OpRecorder()
    with recorder:
        fn(*tensors)
    return recorder.ops


def test_a_convolution_and_its_two_gradients_count_their_products_also_when_grouped():
    n, c, h, w, k = 4, 32, 14, 14, 3
    for groups in (1, 4, 32):  # dense, grouped, depthwise
        x = torch.empty(n, c, h, w, device="meta", requires_grad=True)
        weight = torch.empty(c, c // groups, k, k, device="meta", requires_grad=True)
        forward = 2.0 * n * c * h * w * (c // groups) * k * k  # one multiply-add per output and weight of a group
        ops = _record(lambda: torch.nn.functional.conv2d(x, weight, padding=1, groups=groups).sum().backward())
        by_name = {op.name: op for op in ops}
        assert by_name["convolution"].flops == forward
        # input gradient + weight gradient, each the forward's products (torch's own formula counts the
        # depthwise weight gradient as a dense one's: 32x here)
        assert by_name["convolution_backward"].flops == 2 * forward


def test_elementwise_operators_move_their_tensors_once_and_views_move_nothing():
    x = torch.empty(8, 16, 10, 10, device="meta", dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
    ops = _record(lambda t: torch.relu(t.permute(0, 2, 3, 1).reshape(-1, 16)), x)
    assert [op.name for op in ops] == ["relu"]
    assert ops[0].bytes == 2 * x.numel() * 2  # read once, written once, 2 bytes each
    ops = _record(lambda t: t.add_(t), torch.empty(100, device="meta"))
    assert ops[0].bytes == 2 * 100 * 4  # an in-place add reads its tensor and writes it


def test_the_roofline_takes_the_longer_of_compute_and_memory_for_each_operator():
    ops = [OpCost("conv", flops=2e12, bytes=1e9), OpCost("relu", flops=0.0, bytes=5e9)]
    # conv: 2 s of compute at 1 TFLOP/s beats 0.1 s of memory; relu: 0.5 s of memory at 10 GB/s
    assert roofline_seconds(ops, peak_gflops=1000.0, bandwidth_gbs=10.0) == pytest.approx(2.5)


def test_a_training_update_is_its_micro_batches_and_one_optimiser_step():
    spec = ModelSpec(arch="resnet", size="8", num_classes=10, image_size=32)
    ops = model_operators(spec, 16, train=True, dtype=torch.bfloat16)
    optimiser = [op for op in ops if op.name == "optimiser"]
    params = 75290  # ResNet-8 for CIFAR-10
    assert len(optimiser) == 1 and optimiser[0].bytes == 5 * 4 * params
    # forward + backward convolutions: the backward's products are twice the forward's but for the stem,
    # whose input needs no gradient
    conv = sum(op.flops for op in ops if op.name == "convolution")
    conv_backward = sum(op.flops for op in ops if op.name == "convolution_backward")
    stem = 2.0 * 16 * 16 * 32 * 32 * 3 * 3 * 3
    assert conv_backward == pytest.approx(2 * conv - stem)
    one = update_seconds(spec, 16, 1, True, torch.bfloat16, 1000.0, 20.0)
    four = update_seconds(spec, 16, 4, True, torch.bfloat16, 1000.0, 20.0)
    step = roofline_seconds(optimiser, 1000.0, 20.0)
    assert four - step == pytest.approx(4 * (one - step))
