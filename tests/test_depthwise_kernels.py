"""The depthwise-convolution backward kernels (cnns.kernels.depthwise) against float64 convolution gradients.

Tolerances come from the computation: each value is a float32 sum of n products (n = the taps reaching an input
value, or N * Ho * Wo positions for a weight), so its error is at most n * 2^-24 times the sum of the products'
magnitudes (the classic bound for recursive summation; bfloat16 x bfloat16 products are exact in float32), plus
the final rounding to the output dtype (2^-8 relative for bfloat16, 2^-24 for float32).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from cnns.engine.kernel_choice import CNNS, FLOAT32, NATIVE, depthwise_routes, route_slow_depthwise_backward
from cnns.kernels import depthwise

pytestmark = pytest.mark.skipif(not depthwise.available(), reason="the depthwise kernels were not built")

UNIT = 2.0 ** -24
ROUNDING = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8}

# (N, C, H, W, kernel, stride): EfficientNet-B0's depthwise layers at small batch and size, channel counts that
# leave a tail past the last full vector (24, 40, 7), batch 1, odd and non-square sizes, 7x7.
CASES = [
    (2, 32, 16, 16, 3, 1), (2, 96, 16, 16, 3, 2), (2, 144, 14, 14, 5, 2), (2, 240, 7, 7, 5, 1),
    (2, 672, 7, 7, 5, 2), (1, 1152, 4, 4, 5, 1), (3, 24, 9, 13, 3, 2), (2, 40, 11, 8, 5, 1), (1, 7, 5, 6, 7, 1),
    (2, 16, 15, 15, 7, 2), (1, 48, 3, 3, 5, 1),
]


@pytest.fixture(params=depthwise.builds(), ids=lambda build: build.name)
def build(request, monkeypatch):
    """Each build in turn (AVX2 and AVX-512 where the CPU runs both): every one must be as exact."""
    monkeypatch.setattr(depthwise, "_ext", request.param)
    return request.param.name


def _operands(n, c, h, w, kernel, stride, dtype):
    torch.manual_seed(n * 1000 + c + h + kernel + stride)
    conv = nn.Conv2d(c, c, kernel, stride=stride, padding=kernel // 2, groups=c, bias=False)
    x = torch.randn(n, c, h, w).to(dtype).contiguous(memory_format=torch.channels_last)
    weight = conv.weight.detach().to(dtype)
    out = conv(x.float())
    grad = torch.randn_like(out).to(dtype).contiguous(memory_format=torch.channels_last)
    return conv, x, weight, grad


def _reference(grad, x, weight, stride, padding, absolute=False):
    """float64 input and weight gradients of the depthwise convolution (of |operands| with absolute=True)."""
    operands = [t.double().abs() if absolute else t.double() for t in (grad, x, weight)]
    return torch.ops.aten.convolution_backward(*operands, None, stride, padding, (1, 1), False, (0, 0),
                                               x.shape[1], [True, True, False])[:2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("n,c,h,w,kernel,stride", CASES)
def test_gradients_equal_float64_convolution_within_the_summation_bound(build, n, c, h, w, kernel, stride, dtype):
    conv, x, weight, grad = _operands(n, c, h, w, kernel, stride, dtype)
    stride2, padding = conv.stride, conv.padding
    expected_input, expected_weight = _reference(grad, x, weight, stride2, padding)
    magnitude_input, magnitude_weight = _reference(grad, x, weight, stride2, padding, absolute=True)

    grad_input = depthwise.input_gradient(grad, weight, (h, w), stride2, padding)
    assert grad_input.dtype == dtype and grad_input.shape == x.shape
    assert grad_input.is_contiguous(memory_format=torch.channels_last)
    taps = kernel * kernel  # at most this many products reach an input value
    bound = (taps + 1) * UNIT * magnitude_input + ROUNDING[dtype] * expected_input.abs()
    assert ((grad_input.double() - expected_input).abs() <= bound).all()

    grad_weight = depthwise.weight_gradient(grad, x, kernel, stride2, padding)
    assert grad_weight.dtype == torch.float32 and grad_weight.shape == weight.shape
    positions = n * grad.shape[2] * grad.shape[3]
    bound = (positions + 1) * UNIT * magnitude_weight + UNIT * expected_weight.abs()
    assert ((grad_weight.double() - expected_weight).abs() <= bound).all()


def test_a_nan_in_the_gradient_reaches_the_inputs_and_weights_it_touches(build):
    conv, x, weight, grad = _operands(1, 40, 6, 6, 3, 1, torch.bfloat16)
    grad[0, 3, 2, 2] = float("nan")  # channel 3 is in the first vector; 35 would be in the tail
    grad[0, 35, 0, 0] = float("nan")
    grad_input = depthwise.input_gradient(grad, weight, (6, 6), (1, 1), (1, 1))
    grad_weight = depthwise.weight_gradient(grad, x, 3, (1, 1), (1, 1))
    nan_inputs = grad_input.isnan()
    assert nan_inputs[0, 3, 1:4, 1:4].all() and nan_inputs[0, 35, 0:2, 0:2].all()
    assert nan_inputs.sum() == 9 + 4
    assert grad_weight[3].isnan().all() and grad_weight[35].isnan().any() and grad_weight.isnan().sum() < 2 * 9 + 1


def test_bad_operands_get_one_clear_error():
    _, x, weight, grad = _operands(1, 16, 8, 8, 3, 2, torch.bfloat16)
    with pytest.raises(ValueError, match="spatial size does not match"):
        depthwise.input_gradient(grad, weight, (9, 12), (2, 2), (1, 1))
    with pytest.raises(ValueError, match="kernel sizes 3, 5 and 7"):
        depthwise.weight_gradient(grad, x, 4, (2, 2), (1, 1))  # 4x4 fits the sizes
    with pytest.raises(ValueError, match="one dtype"):
        depthwise._ext.weight_gradient(grad.permute(0, 2, 3, 1).contiguous(),
                                       x.float().permute(0, 2, 3, 1).contiguous(), 3, 2, 2, 1, 1)


@pytest.mark.parametrize("channels,kernel,stride,routes", [
    (24, 3, 2, (CNNS, NATIVE)), (40, 5, 1, (NATIVE, CNNS)), (16, 5, 2, (CNNS, CNNS)), (16, 3, 1, (NATIVE, NATIVE)),
])
def test_routes_send_only_the_slow_halves_to_the_kernels(channels, kernel, stride, routes, monkeypatch):
    conv = nn.Conv2d(channels, channels, kernel, stride=stride, padding=kernel // 2, groups=channels)
    assert depthwise_routes(conv) == routes
    grouped = nn.Conv2d(32, 32, 5, stride=2, padding=2, groups=2)  # 16 channels a group: not depthwise
    assert depthwise_routes(grouped) == (NATIVE, NATIVE)
    dilated = nn.Conv2d(channels, channels, kernel, stride=stride, padding=kernel - 1, dilation=2, groups=channels)
    assert depthwise_routes(dilated) == tuple(FLOAT32 if r == CNNS else r for r in routes)
    monkeypatch.setattr(depthwise, "_ext", None)  # no compiler at install time: oneDNN in float32
    assert depthwise_routes(conv) == tuple(FLOAT32 if r == CNNS else r for r in routes)


@pytest.mark.parametrize("autocast", [False, True], ids=["16.16", "16.32"])
def test_a_routed_model_trains_like_the_plain_one_in_bfloat16(autocast, monkeypatch):
    """An EfficientNet-style block: the routed convolutions' gradients agree with oneDNN's float32 ones to
    bfloat16 accuracy, in 16.16 (bfloat16 weights) and 16.32 (float32 weights under autocast)."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Conv2d(16, 48, 1), nn.Conv2d(48, 48, 5, stride=2, padding=2, groups=48), nn.ReLU(),
                          nn.Conv2d(48, 48, 3, padding=1, groups=48), nn.Conv2d(48, 8, 1))
    plain = plain.to(memory_format=torch.channels_last)
    reference = copy.deepcopy(plain)
    routed = copy.deepcopy(plain) if autocast else copy.deepcopy(plain).to(torch.bfloat16)
    unrouted = copy.deepcopy(routed)  # before routing: a copy of a routed module is routed too
    assert route_slow_depthwise_backward(routed) == 1
    x = torch.randn(2, 16, 15, 15).contiguous(memory_format=torch.channels_last)

    calls = []
    for half, function in [("input", depthwise.input_gradient), ("weight", depthwise.weight_gradient)]:
        monkeypatch.setattr(depthwise, f"{half}_gradient",
                            lambda *args, _f=function, _h=half: calls.append(_h) or _f(*args))

    def gradients(model, dtype, half):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=half):
            model(x.to(dtype)).float().square().sum().backward()
        return [p.grad.double() for p in model.parameters()]

    expected = gradients(reference, torch.float32, half=False)
    native = gradients(unrouted, torch.float32 if autocast else torch.bfloat16, half=autocast)
    got = gradients(routed, torch.float32 if autocast else torch.bfloat16, half=autocast)
    assert calls == ["input", "weight"]  # the strided 5x5 convolution's two halves, once each
    for e, n, g in zip(expected, native, got):
        # Both differ from float32 through the same bfloat16 forward; the routed halves may round differently.
        assert (g - e).abs().max() <= 1.5 * (n - e).abs().max() + 2.0 ** -8 * e.abs().max()
