"""The precision policy: 16.16 keeps norm layers in float32 without casts, and learns as well as 32.32."""

from __future__ import annotations

import csv
import os
import sys
from pathlib import Path

import pytest

import processes
import torch
from scripts import ON_THE_PLATEAU_RUN, plateau_options, train_here
from torch import nn

from cnns.models import ModelSpec, build_model
from cnns.stochastic_rounding import stochastic_round
from cnns.precision import PrecisionPolicy

ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")


def _resnet8() -> nn.Module:
    torch.manual_seed(0)
    return build_model(ModelSpec(arch="resnet", size="8", num_classes=10, image_size=32))


def test_16_16_keeps_norm_parameters_and_statistics_in_float32_and_the_state_dict_keys():
    model = _resnet8()
    keys = set(model.state_dict())
    PrecisionPolicy.resolve("16.16", "bfloat16", CPU).apply_to_model(model)
    assert set(model.state_dict()) == keys
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            assert module.weight.dtype == module.running_mean.dtype == torch.float32
            # On CPU the mixed-type kernel takes the half input directly: no casting hooks.
            assert not module._forward_pre_hooks and not module._forward_hooks
        elif isinstance(module, nn.Conv2d):
            assert module.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("native", [True, False])
def test_a_cpu_without_bfloat16_arithmetic_runs_float32_unless_the_half_type_is_explicit(monkeypatch, native):
    import cnns.precision as precision

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert precision.cpu_half_is_emulated(CPU, torch.bfloat16) is (not native)
    assert not precision.cpu_half_is_emulated(torch.device("cuda"), torch.float16)
    chosen = PrecisionPolicy.resolve("16.16", "bfloat16", CPU, half_dtype_given=False)
    forced = PrecisionPolicy.resolve("16.16", "bfloat16", CPU, half_dtype_given=True)
    assert forced.weight_dtype == torch.bfloat16 and not forced.note
    if native:
        assert chosen == forced
    else:
        assert chosen.weight_dtype == chosen.compute_dtype == torch.float32 and not chosen.use_autocast
        assert "no bfloat16 arithmetic" in chosen.note and "--half-dtype bfloat16" in chosen.note
    # 32.32 never needs the fallback.
    assert PrecisionPolicy.resolve("32.32", "bfloat16", CPU, half_dtype_given=False).note == ""


def test_whether_the_half_type_was_explicit_is_kept_through_arguments_json():
    from cnns.cli import resolved_training_options
    from cnns.config import RunConfig, resolve

    base = ["--dataset", "cifar-10", "--synthetic-data", "--model-size", "8"]
    implicit, _ = resolved_training_options("train", base)
    explicit, _ = resolved_training_options("train", base + ["--half-dtype", "bfloat16"])
    assert not RunConfig.from_options(implicit).precision.half_dtype_given
    assert RunConfig.from_options(explicit).precision.half_dtype_given
    # restore.py and validation.py resolve a run's arguments.json, where half_dtype is always filled in.
    assert not RunConfig.from_options(resolve(implicit)).precision.half_dtype_given


@pytest.mark.parametrize("half", ["bfloat16", "float16"])
@pytest.mark.parametrize("norm", [nn.BatchNorm2d(8), nn.GroupNorm(4, 8)])
def test_half_input_through_a_float32_norm_layer_matches_float32(half, norm):
    policy = PrecisionPolicy.resolve("16.16", half, CPU)
    layer = nn.Sequential(nn.Conv2d(3, 8, 3), norm)
    reference = nn.Sequential(nn.Conv2d(3, 8, 3), type(norm)(*([4, 8] if isinstance(norm, nn.GroupNorm) else [8])))
    reference.load_state_dict(layer.state_dict())
    policy.apply_to_model(layer)
    x = torch.randn(4, 3, 10, 10).contiguous(memory_format=torch.channels_last)
    out = layer(x.to(policy.weight_dtype))
    out.float().sum().backward()
    assert out.dtype == policy.weight_dtype
    assert layer[1].weight.grad.dtype == torch.float32
    expected = reference(x)
    # Two roundings to the half type (the convolution's input and its output) of values the norm then
    # scales to unit variance, |x| < 4: 2 x 4 x 2^-8 = 0.03 for bfloat16, 2 x 4 x 2^-11 = 0.004 for float16.
    tolerance = 0.05 if half == "bfloat16" else 0.01
    assert torch.allclose(out.float(), expected, atol=tolerance, rtol=tolerance)
    if isinstance(norm, nn.BatchNorm2d):  # running statistics updated in float32
        assert torch.allclose(layer[1].running_mean, reference[1].running_mean, atol=tolerance)


def test_bfloat16_stochastic_rounding_is_unbiased_across_its_cache_sized_pieces(monkeypatch):
    # More elements than one piece of the blocked torch implementation (GPUs', and CPUs' without the C++
    # pass, which tests/test_optim.py checks), with the value changing halfway.
    import cnns.stochastic_rounding

    monkeypatch.setattr(cnns.stochastic_rounding, "_rounding_kernel", lambda: None)
    count = (1 << 21) + 12345
    gap = 2.0**-7
    x = torch.full((count,), 1.0 + 0.25 * gap)
    x[count // 2:] = -(2.0 + 0.75 * 2 * gap)
    rounded = stochastic_round(x, torch.bfloat16, torch.Generator().manual_seed(3)).double()
    first, second = rounded[: count // 2], rounded[count // 2:]
    assert set(first.unique().tolist()) == {1.0, 1.0 + gap}
    assert set(second.unique().tolist()) == {-2.0, -(2.0 + 2 * gap)}
    assert abs(first.mean().item() - (1.0 + 0.25 * gap)) < 0.01 * gap
    assert abs(second.mean().item() + (2.0 + 1.5 * gap)) < 0.02 * gap


@pytest.mark.parametrize("implementation", ["pass", "operators"])
def test_stochastic_rounding_is_reproducible_from_the_generator_state(implementation, monkeypatch):
    import cnns.stochastic_rounding
    from cnns.kernels import rounding

    if implementation == "pass" and not rounding.available():
        pytest.skip("the rounding pass was not built")
    if implementation == "operators":
        monkeypatch.setattr(cnns.stochastic_rounding, "_rounding_kernel", lambda: None)
    x = torch.randn(100_003)
    a = stochastic_round(x, torch.bfloat16, torch.Generator().manual_seed(9))
    b = stochastic_round(x, torch.bfloat16, torch.Generator().manual_seed(9))
    c = stochastic_round(x, torch.bfloat16, torch.Generator().manual_seed(10))
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    assert not torch.equal(a.view(torch.int16), c.view(torch.int16))
    # Every result is one of the two bfloat16 neighbours of x.
    low = x.to(torch.bfloat16).float()
    assert torch.all((a.float() - x).abs() < (low.abs() * 2**-7).clamp_min(1e-30) * 1.01)


def test_host_memory_tuning_stops_page_faults_on_reallocation():
    # In a child process: the setting is process-wide and the test runner's process should keep its own.
    code = """
import resource, sys, torch
from cnns.engine.build import keep_freed_host_memory
assert keep_freed_host_memory(torch.device("cpu"), enabled=False) is False  # --no-malloc-tuning
applied = keep_freed_host_memory(torch.device("cpu"), enabled=True)
assert keep_freed_host_memory(torch.device("cpu"), enabled=True) == applied
assert keep_freed_host_memory(torch.device("meta"), enabled=True) is False
faults = []
for _ in range(4):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [torch.ones(16, 1024, 1024) for _ in range(4)]  # 4 x 64 MB, above any mmap threshold
    del blocks
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(applied, faults)
sys.exit(0 if not applied or min(faults[1:]) < faults[0] // 10 else 1)
"""
    out = processes.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert out.returncode == 0, out.stdout + out.stderr


# ------------------------------------------------------------------------------------------------
# accuracy is not traded for speed: 16.16 learns as well as 32.32


def _rows(folder: Path) -> tuple[list[dict], list[dict]]:
    """(training.csv rows, validation.csv rows) of a run folder."""
    rows = []
    for name in ("training.csv", "validation.csv"):
        with open(folder / name, newline="") as f:
            rows.append(list(csv.DictReader(f)))
    return rows[0], rows[1]


@ON_THE_PLATEAU_RUN
def test_16_16_learns_as_well_as_32_32(plateau_data, plateau_run_32, tmp_path):
    train_here(*plateau_options("16.16", plateau_data), "--logs-path", str(tmp_path / "run16"))
    training_16, validation_16 = _rows(tmp_path / "run16")
    training_32, validation_32 = _rows(plateau_run_32)
    # The last row averages only the few updates after the last whole epoch (937 = 15 x 62 + 7): noisy.
    # Compare whole epochs: the first and the last.
    losses_16 = [float(row["loss_avg"]) for row in training_16][:-1]
    loss_32 = float(training_32[-2]["loss_avg"])
    assert len(validation_16) == 1 and int(validation_16[0]["val_size"]) == 1000  # every test image once
    # The 32.32 run's raw weights (its moving average, validated too, is the row after them).
    (raw_32,) = [row for row in validation_32 if not row["name"].endswith("_ema")]
    acc_16, acc_32 = float(validation_16[0]["val_acc"]), float(raw_32["val_acc"])
    assert losses_16[-1] < 0.3 * losses_16[0], losses_16  # 16.16 learns: a falling loss ...
    assert acc_32 > 85.0 and acc_16 > 85.0, (acc_16, acc_32)  # ... to a plateau far above chance (10 %)
    # ... and as well as 32.32, within what two runs of either precision differ by. Seeds 11-13, both precisions,
    # on a CPU with bfloat16 arithmetic and with it hidden (the emulated path: float32-computed convolutions, the
    # AVX2 kernels), 12 runs: validation accuracy 88.1-90.0 % (sd 0.5 point), last-epoch loss 0.334-0.397 (sd
    # 6.7 % of the mean). Runs that differ in any rounding part ways within a few epochs, so the same seed does
    # not pair them: two runs' difference has sd sqrt(2) x 0.5 = 0.7 point and their loss ratio sd
    # sqrt(2) x 6.7 % = 9.5 %. Bounds at about 3 sd: 2.5 points and 1.3x (measured 16.16 / 32.32 ratios:
    # 0.96-1.17). A 16.16 that learns worse by more than that fails here.
    assert acc_16 >= acc_32 - 2.5, (acc_16, acc_32)
    assert losses_16[-1] <= 1.3 * loss_32, (losses_16[-1], loss_32)


# ------------------------------------------------------------------------------------------------
# the speed wrappers applied when a model is built for training change no numbers


def test_channels_last_gradient_hooks_change_layouts_not_gradients():
    from cnns.engine.kernel_choice import keep_gradients_channels_last

    def gradients(hooked: bool):
        model = _resnet8().to(memory_format=torch.channels_last)
        if hooked:
            assert keep_gradients_channels_last(model) == 3  # global pool + two option-A shortcuts
        x = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(1)).contiguous(
            memory_format=torch.channels_last)
        model(x).square().sum().backward()
        return [p.grad for p in model.parameters()]

    # Another memory layout picks other float32 kernels, which sum the gradients in another order: at
    # most K x 2^-24 of the magnitude for K terms, K = 8 images x 32 x 32 positions = 8192 (5e-4) in
    # the worst case, sqrt(K) x 2^-24 (5e-6) typically.
    for plain, hooked in zip(gradients(False), gradients(True)):
        assert torch.allclose(plain, hooked, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("in_channels, out_channels, kernel, stride, groups, bias", [
    (16, 32, 3, 1, 1, False), (32, 64, 3, 2, 1, True), (32, 32, 3, 1, 32, False), (64, 128, 1, 2, 1, False)])
def test_half_convolutions_on_float32_kernels_are_as_exact_as_half_arithmetic(dtype, in_channels, out_channels,
                                                                               kernel, stride, groups, bias):
    """A CPU that only emulates the half type computes its convolutions with float32 kernels: every output and
    gradient is the exact result (float64 from the same half values) to within half a unit in the last place of
    the half type, plus the float32 sum's rounding (K terms: at most K x 2^-24 of the sum of |terms|)."""
    import copy

    from cnns.engine.kernel_choice import compute_half_convolutions_in_float32

    generator = torch.Generator().manual_seed(in_channels + kernel + stride)
    conv = nn.Conv2d(in_channels, out_channels, kernel, stride, kernel // 2, groups=groups, bias=bias).to(dtype)
    routed = copy.deepcopy(conv)
    assert compute_half_convolutions_in_float32(routed) == 1 and set(routed.state_dict()) == set(conv.state_dict())
    x = torch.randn(4, in_channels, 12, 12, generator=generator).to(dtype).contiguous(memory_format=torch.channels_last)
    x.requires_grad_()
    out = routed(x)
    grad = torch.randn(out.shape, generator=generator).to(dtype)
    out.backward(grad)
    assert out.dtype == dtype and x.grad.dtype == dtype and routed.weight.grad.dtype == dtype

    exact = copy.deepcopy(conv).double()
    x64 = x.detach().double().requires_grad_()
    exact(x64).backward(grad.double())
    magnitude = copy.deepcopy(conv).double()  # the same sums over |terms|, for the float32 rounding bound
    with torch.no_grad():
        magnitude.weight.abs_()
        x_abs = x.detach().double().abs().requires_grad_()
    magnitude(x_abs).backward(grad.double().abs())
    ulp = 2.0 ** (-7 if dtype == torch.bfloat16 else -10)  # the largest relative spacing of the half type's values
    terms = 4 * 12 * 12  # the longest sum: a weight gradient over the batch and the positions

    def within(ours, expected, sum_of_terms):
        bound = 0.5 * ulp * expected.abs() + terms * 2.0 ** -24 * sum_of_terms + 1e-30
        assert bool(((ours.double() - expected).abs() <= bound).all()), (ours.double() - expected).abs().max()

    within(out.detach(), exact(x.detach().double()).detach(), magnitude(x_abs).detach())
    within(x.grad, x64.grad, x_abs.grad)
    within(routed.weight.grad, exact.weight.grad, magnitude.weight.grad)
    if bias:
        within(routed.bias.grad, exact.bias.grad, magnitude.bias.grad)


@pytest.mark.parametrize("emulated", [True, False])
def test_a_cpu_that_emulates_the_half_type_runs_every_convolution_on_float32_kernels(monkeypatch, emulated):
    import cnns.engine.kernel_choice as wrappers

    monkeypatch.setattr(wrappers, "cpu_half_is_emulated", lambda device, half: emulated)
    model = build_model(ModelSpec(arch="efficientnet", size="B0", num_classes=10, image_size=32))
    convolutions = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    wrappers.choose_kernels(model, CPU, torch.bfloat16, reproducible=True)
    on_float32 = [m for m in convolutions if isinstance(m, wrappers._Float32ComputedHalfConv)]
    routed_depthwise = [m for m in convolutions if isinstance(m, wrappers._RoutedDepthwise)]
    if emulated:  # every one, depthwise included
        assert len(on_float32) == len(convolutions) and not routed_depthwise
    else:  # bfloat16 arithmetic: oneDNN's, with the slow depthwise backward halves routed
        assert not on_float32 and routed_depthwise
    plain = build_model(ModelSpec(arch="efficientnet", size="B0", num_classes=10, image_size=32))
    assert set(model.state_dict()) == set(plain.state_dict())


@pytest.mark.parametrize("channels, kernel, stride", [(24, 3, 2), (40, 5, 1), (16, 5, 2), (16, 3, 1)])
def test_depthwise_convolutions_with_a_float32_backward_half_give_the_same_gradients(channels, kernel, stride):
    import copy

    from cnns.engine.kernel_choice import route_slow_depthwise_backward

    torch.manual_seed(0)
    native = nn.Conv2d(channels, channels, kernel, stride=stride, padding=kernel // 2, groups=channels, bias=True)
    native = native.to(torch.bfloat16).to(memory_format=torch.channels_last)
    routed = copy.deepcopy(native)
    assert route_slow_depthwise_backward(routed) == (1 if stride > 1 or kernel >= 5 else 0)
    assert set(routed.state_dict()) == set(native.state_dict())
    x = torch.randn(4, channels, 12, 12).to(torch.bfloat16).contiguous(memory_format=torch.channels_last)
    inputs = [x.clone().requires_grad_() for _ in range(2)]
    outputs = [native(inputs[0]), routed(inputs[1])]
    assert torch.equal(outputs[0], outputs[1])
    grad = torch.randn_like(outputs[0])
    for out in outputs:
        out.backward(grad)
    assert inputs[1].grad.dtype == torch.bfloat16
    assert inputs[1].grad.is_contiguous(memory_format=torch.channels_last)
    # Reference: the same convolution in float32 from the same bfloat16 values. Both the native bfloat16
    # kernel and the routed one must agree with it to bfloat16 accuracy (relative to the tensor's scale:
    # a sum over many products loses absolute, not relative, accuracy near zero).
    reference = copy.deepcopy(native).float()
    x32 = x.float().requires_grad_()
    reference(x32).backward(grad.float())
    for expected, native_grad, routed_grad in [(x32.grad, inputs[0].grad, inputs[1].grad),
                                               (reference.weight.grad, native.weight.grad, routed.weight.grad),
                                               (reference.bias.grad, native.bias.grad, routed.bias.grad)]:
        tolerance = 2e-2 * expected.abs().max()
        assert (routed_grad.float() - expected).abs().max() <= tolerance
        assert (native_grad.float() - expected).abs().max() <= tolerance
