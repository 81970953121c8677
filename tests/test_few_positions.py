"""The float32 backward of a convolution with few output positions, computed as two matrix products on the CPU
(cnns.engine.kernel_choice): the same gradients as the exact ones within float32's summation error, and taken
by exactly the convolutions whose outputs have few positions."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import cnns.engine.kernel_choice as kernel_choice
from cnns.engine.kernel_choice import FEW_OUTPUT_POSITIONS, choose_kernels, route_few_position_backward
from cnns.models import ModelSpec, build_model

CPU = torch.device("cpu")


@pytest.fixture
def matmul_backwards(monkeypatch) -> list[tuple[int, int]]:
    """The output sizes of the backward passes computed as matrix products, as they run."""
    taken = []
    real = kernel_choice._matmul_convolution_backward

    def counted(grad, *args):
        taken.append(tuple(grad.shape[-2:]))
        return real(grad, *args)

    monkeypatch.setattr(kernel_choice, "_matmul_convolution_backward", counted)
    return taken


# (in channels, out channels, kernel, stride, padding, input size, bias): ResNet-18's last 3x3 at 2 x 2 and 1 x 1,
# ResNet-50's strided 1 x 1 shortcut from 3 x 3 to 2 x 2, a strided 3x3 into 2 x 2, an unpadded one, a 1 x 4 row
@pytest.mark.parametrize("in_channels, out_channels, kernel, stride, padding, size, bias", [
    (32, 48, 3, 1, 1, (2, 2), False), (32, 48, 3, 1, 1, (1, 1), True), (24, 64, 1, 2, 0, (3, 3), False),
    (16, 32, 3, 2, 1, (4, 3), True), (16, 24, 3, 1, 0, (4, 4), False), (8, 16, 3, 1, 1, (1, 4), True)])
@pytest.mark.parametrize("layout", [torch.channels_last, torch.contiguous_format])
def test_the_matmul_backward_gives_the_exact_gradients_within_float32_sums(
        matmul_backwards, in_channels, out_channels, kernel, stride, padding, size, bias, layout):
    generator = torch.Generator().manual_seed(in_channels + kernel + stride)
    conv = nn.Conv2d(in_channels, out_channels, kernel, stride, padding, bias=bias).to(memory_format=layout)
    routed = copy.deepcopy(conv)
    assert route_few_position_backward(routed) == 1 and set(routed.state_dict()) == set(conv.state_dict())
    x = torch.randn(6, in_channels, *size, generator=generator).contiguous(memory_format=layout).requires_grad_()
    out = routed(x)
    assert torch.equal(out, conv(x))  # the forward is oneDNN's, unchanged
    grad = torch.randn(out.shape, generator=generator).contiguous(memory_format=layout)
    out.backward(grad)
    assert matmul_backwards == [tuple(out.shape[-2:])]
    # oneDNN's layouts: each gradient has its tensor's strides
    assert x.grad.stride() == x.stride() and routed.weight.grad.stride() == routed.weight.stride()

    exact, magnitude = copy.deepcopy(conv).double(), copy.deepcopy(conv).double()
    x64 = x.detach().double().requires_grad_()
    exact(x64).backward(grad.double())
    with torch.no_grad():  # the same sums over |terms|, for the float32 rounding bound
        magnitude.weight.abs_()
    x_abs = x.detach().double().abs().requires_grad_()
    magnitude(x_abs).backward(grad.double().abs())
    # The longest sum: a weight gradient over the batch and the positions, or an input gradient over the
    # output channels and kernel taps. A float32 sum of K terms errs by at most K x 2^-24 of the sum of |terms|.
    terms = max(6 * out.shape[-2] * out.shape[-1], out_channels * kernel * kernel)

    def within(ours, expected, sum_of_terms):
        bound = terms * 2.0 ** -24 * sum_of_terms + 1e-30
        assert bool(((ours.double() - expected).abs() <= bound).all()), (ours.double() - expected).abs().max()

    within(x.grad, x64.grad, x_abs.grad)
    within(routed.weight.grad, exact.weight.grad, magnitude.weight.grad)
    if bias:
        within(routed.bias.grad, exact.bias.grad, magnitude.bias.grad)


def _trained_once(spec: ModelSpec, compute_dtype: torch.dtype, image_size: int) -> nn.Module:
    torch.manual_seed(0)
    model = build_model(spec).to(memory_format=torch.channels_last)
    choose_kernels(model, CPU, compute_dtype, reproducible=True)
    if compute_dtype != torch.float32:
        model = model.to(compute_dtype)
    x = torch.randn(2, 3, image_size, image_size).to(compute_dtype).contiguous(memory_format=torch.channels_last)
    model(x).float().square().sum().backward()
    return model


def test_a_resnet_on_small_images_takes_the_matmul_backward_exactly_where_outputs_have_few_positions(
        matmul_backwards):
    # ResNet-18 at 40 px: its last stage (two blocks, a strided shortcut) is at 2 x 2; every earlier output has more
    # positions than FEW_OUTPUT_POSITIONS
    _trained_once(ModelSpec(arch="resnet", size="18", num_classes=10, image_size=40), torch.float32, 40)
    assert matmul_backwards == [(2, 2)] * 5
    assert FEW_OUTPUT_POSITIONS == 4


def test_cifar_resnets_and_gpu_or_bfloat16_runs_keep_onednns_backward(matmul_backwards, monkeypatch):
    # A CIFAR ResNet's outputs are 8 x 8 and larger
    _trained_once(ModelSpec(arch="resnet", size="20", num_classes=10, image_size=32), torch.float32, 32)
    # A CPU that computes bfloat16 keeps oneDNN's bfloat16 kernels: the choice is for float32 computation only
    monkeypatch.setattr(kernel_choice, "cpu_half_is_emulated", lambda device, half: False)
    _trained_once(ModelSpec(arch="resnet", size="18", num_classes=10, image_size=40), torch.bfloat16, 40)
    assert matmul_backwards == []


def test_a_cpu_that_emulates_bfloat16_computes_its_few_position_backwards_as_matrix_products(
        matmul_backwards, monkeypatch):
    monkeypatch.setattr(kernel_choice, "cpu_half_is_emulated", lambda device, half: True)
    model = _trained_once(ModelSpec(arch="resnet", size="18", num_classes=10, image_size=40), torch.bfloat16, 40)
    assert matmul_backwards == [(2, 2)] * 5
    assert model.layer4[0].conv1.weight.grad.dtype == torch.bfloat16
