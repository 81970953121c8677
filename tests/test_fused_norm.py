"""The fused norm + activation (+ residual) passes (cnns.kernels, cnns.engine.fusion) against torch's modules.

References are float64 computations from the same (already rounded) inputs. Tolerances, relative to the
largest reference value, are derived from the arithmetic:
- float32: the passes sum in float32 blocks of 256 rows added in float64, then one float32 rounding per
  result; sums of n terms carry about sqrt(n) float32 epsilons, so 8 * eps32 * sqrt(count) bounds them.
- bfloat16: the output (and in backward the pre-activation gradient, as torch's own activation backward
  rounds it) is rounded to bfloat16 once or twice: 2 * eps_bf16 (eps = 2^-7, the spacing at 1).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cnns.engine.fusion import fuse_norm_activations, fused_norms, fuses_squeeze_excitation, norm_act
from cnns.engine.recomputation import recompute_blocks
from cnns.kernels import norm_act as kernels
from cnns.kernels import runnable_builds
from cnns.models import build_model, recomputation_blocks
from cnns.models.norms import fitted_groups
from cnns.models.model_spec import ModelSpec

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the fused kernels were not built (no compiler)")

ACTS = {"none": lambda z: z, "relu": F.relu, "silu": F.silu}


def tolerance(dtype: torch.dtype, count: int) -> float:
    if dtype == torch.bfloat16:
        return 2 * torch.finfo(torch.bfloat16).eps
    return 8 * torch.finfo(torch.float32).eps * math.sqrt(count)


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    return ((value.double() - reference).abs().max() / reference.abs().max().clamp_min(1e-30)).item()


def reference(x, weight, bias, residual, groups, act, running=None, momentum=0.1, relu_mask=None):
    """act(norm(x) [+ residual]) in float64 with torch's functions; running = (mean, var) float64 buffers.

    ReLU takes the pass's own mask (its output > 0): whether a value within float32 rounding of zero is
    cut is decided by rounding, not by the algorithm, and one such element among 100,000 moves the input
    gradient there by its whole value (seen: one element of (2, 256, 14, 14))."""
    if groups:
        z = F.group_norm(x, groups, weight, bias, 1e-5)
    else:
        mean, var = running if running is not None else (None, None)
        z = F.batch_norm(x, mean, var, weight, bias, True, momentum, 1e-5)
    if residual is not None:
        z = z + residual
    if act == "relu":
        return z * relu_mask
    return ACTS[act](z)


# Shapes of the supported models (ResNet-20 and ResNet-50 stages, EfficientNet-B0 layers), odd sizes,
# batch 1, and group counts fitted to channels the asked-for count does not divide.
CASES = [
    # (shape, groups asked for (0: batch norm))
    ((4, 16, 32, 32), 0), ((4, 64, 8, 8), 0), ((2, 256, 14, 14), 0), ((2, 144, 16, 16), 0),
    ((3, 24, 7, 5), 0), ((1, 40, 3, 3), 0), ((2, 2048, 2, 2), 0),
    # Narrow layers go k rows at a time (k * C >= 256): blocks and super-rows that end part-way.
    ((5, 16, 9, 11), 0), ((2, 24, 33, 17), 0),
    ((4, 16, 32, 32), 16), ((2, 256, 14, 14), 32), ((2, 40, 9, 7), 32), ((1, 24, 5, 5), 4), ((3, 112, 4, 4), 4),
]


@pytest.fixture(params=kernels.builds(), ids=lambda build: build.name)
def build(request, monkeypatch):
    """Each build in turn (setup.py: AVX2 and AVX-512 on x86, those this CPU runs): the one not chosen for this
    CPU must be as exact as the chosen one."""
    monkeypatch.setattr(kernels, "_ext", request.param)
    return request.param.name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("act,with_residual", [("none", False), ("relu", False), ("silu", False),
                                               ("relu", True), ("none", True)])
@pytest.mark.parametrize("shape,groups_asked", CASES)
def test_outputs_gradients_and_running_statistics_match_torch(shape, groups_asked, act, with_residual, dtype, build):
    torch.manual_seed(sum(shape) + groups_asked)
    n, c, h, w = shape
    groups = fitted_groups(groups_asked, c) if groups_asked else 0
    # Activations off zero mean and unit scale, as after a convolution; rounded to the dtype first so that the
    # float64 reference sees exactly what the pass sees.
    x = (torch.randn(shape) * 1.7 + 0.6).to(dtype).to(memory_format=torch.channels_last)
    residual = torch.randn(shape).to(dtype).to(memory_format=torch.channels_last) if with_residual else None
    weight, bias = torch.rand(c) + 0.5, torch.randn(c) * 0.3
    grad = torch.randn(shape).to(dtype).to(memory_format=torch.channels_last)

    running64 = (torch.randn(c, dtype=torch.float64), torch.rand(c, dtype=torch.float64) + 0.5)
    running = tuple(t.float() for t in running64)

    xf = x.clone().requires_grad_()
    wf, bf = weight.clone().requires_grad_(), bias.clone().requires_grad_()
    rf = residual.clone().requires_grad_() if with_residual else None
    tracked = torch.tensor(3)
    if groups:
        y = kernels.group_norm_act(xf, groups, wf, bf, 1e-5, act, rf)
    else:
        y = kernels.batch_norm_act(xf, wf, bf, *running, tracked, 0.1, 1e-5, act, rf)
    y.backward(grad)

    x64 = x.double().requires_grad_()
    w64, b64 = weight.double().requires_grad_(), bias.double().requires_grad_()
    r64 = residual.double().requires_grad_() if with_residual else None
    y64 = reference(x64, w64, b64, r64, groups, act, running64, relu_mask=(y > 0).double())
    y64.backward(grad.double())

    count = (h * w * c // groups) if groups else n * h * w
    tol = tolerance(dtype, count)
    assert y.dtype == dtype and y.is_contiguous(memory_format=torch.channels_last)
    assert relative_error(y, y64) <= tol
    assert relative_error(xf.grad, x64.grad) <= tol
    assert relative_error(wf.grad, w64.grad) <= tol and wf.grad.dtype == torch.float32
    assert relative_error(bf.grad, b64.grad) <= tol
    if with_residual:
        assert relative_error(rf.grad, r64.grad) <= tol
    if not groups:
        # Running statistics: moments summed in float32 blocks whatever the activations' dtype.
        assert relative_error(running[0], running64[0]) <= tolerance(torch.float32, count)
        assert relative_error(running[1], running64[1]) <= tolerance(torch.float32, count)
        assert tracked.item() == 4


def test_cumulative_average_without_momentum_counts_batches_as_torch():
    torch.manual_seed(0)
    plain = nn.BatchNorm2d(8, momentum=None)
    fused = copy.deepcopy(plain)
    for _ in range(3):
        x = torch.randn(4, 8, 5, 5).to(memory_format=torch.channels_last) * 2 + 1
        plain(x)
        kernels.batch_norm_act(x, fused.weight, fused.bias, fused.running_mean, fused.running_var,
                               fused.num_batches_tracked, None, fused.eps)
    assert fused.num_batches_tracked.item() == plain.num_batches_tracked.item() == 3
    # The same float32 arithmetic on moments computed two ways: a few float32 epsilons.
    torch.testing.assert_close(fused.running_mean, plain.running_mean, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fused.running_var, plain.running_var, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("act", ["none", "relu"])
def test_a_nan_spreads_where_torchs_modules_spread_it(act, dtype, build):
    """A NaN in the input poisons its channel's statistics, one in the residual only its own output, as in
    torch: the vector loops' ReLU keeps a NaN (max(NaN, 0) is NaN) and their bfloat16 rounding keeps it a NaN."""
    torch.manual_seed(0)
    # 43 rows of 24 channels: 4 super-rows of 10 rows (240 values, whole vectors), then 3 rows = 72 values,
    # 64 in vectors and the last 8 in the scalar tail.
    shape = (1, 24, 43, 1)
    x = torch.randn(shape, dtype=dtype).contiguous(memory_format=torch.channels_last)
    residual = torch.randn(shape, dtype=dtype).contiguous(memory_format=torch.channels_last)
    x[0, 3, 5, 0] = float("nan")
    residual[0, 20, 7, 0] = float("nan")  # in a vector
    residual[0, 20, 42, 0] = float("nan")  # in the tail
    y = kernels.batch_norm_act(x, None, None, None, None, None, 0.1, 1e-5, act, residual)
    expected = ACTS[act](F.batch_norm(x.float(), None, None, None, None, True, 0.1, 1e-5) + residual.float())
    assert y.isnan().sum().item() == 43 + 2
    assert torch.equal(y.isnan(), expected.isnan())


def test_batch_norm_of_one_value_per_channel_is_torchs_error():
    x = torch.randn(1, 8, 1, 1)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        kernels.batch_norm_act(x, None, None, None, None, None, 0.1, 1e-5)


def test_tensors_the_passes_do_not_take_run_torchs_functions_exactly():
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(6)
    x = torch.randn(2, 6, 4, 4, dtype=torch.float64)
    residual = torch.randn_like(x)
    expected = F.relu(nn.BatchNorm2d.forward(copy.deepcopy(bn).double(), x) + residual)
    assert not kernels.supports(x)
    assert torch.equal(norm_act(bn.double(), x, "relu", residual), expected)


def spec(arch, size, norm, image, groups=4):
    return ModelSpec(arch=arch, size=size, num_classes=10, image_size=image, norm=norm, groups=groups)


MODELS = [spec("resnet", "20", "batch", 32), spec("resnet", "29", "group", 32, 16),
          spec("resnet", "18", "batch", 64), spec("resnet", "50", "group", 64, 32),
          spec("resnext", "29", "batch", 32), spec("efficientnet", "B0", "batch", 64),
          spec("efficientnet", "B0", "group", 64)]


def gradients(model, x):
    model.zero_grad()
    model(x).square().mean().backward()
    return [p.grad for p in model.parameters()]


def model_error(values, references) -> float:
    """Largest gradient error over the whole model, relative to the largest gradient: a gradient that is
    zero in exact arithmetic (a bias before another batch norm) is compared at the model's scale."""
    scale = max(r.abs().max().item() for r in references)
    return max((v.double() - r).abs().max().item() for v, r in zip(values, references)) / scale


@pytest.mark.parametrize("model_spec", MODELS, ids=lambda s: f"{s.arch}{s.size}-{s.norm}")
def test_fused_models_train_like_torchs_modules(model_spec):
    torch.manual_seed(0)
    plain = build_model(model_spec).to(memory_format=torch.channels_last).train()
    fused = copy.deepcopy(plain)
    reference = copy.deepcopy(plain).double()
    keys = list(plain.state_dict())
    assert fuse_norm_activations(fused) > 0
    assert list(fused.state_dict()) == keys  # a checkpoint written before loads after, and the reverse
    fused.load_state_dict(plain.state_dict())

    x = torch.randn(4, 3, model_spec.image_size, model_spec.image_size).to(memory_format=torch.channels_last)
    expected = gradients(reference, x.double())
    # Both are float32. The fused norms round differently from torch's, and a ReLU input within float32
    # rounding of zero may then be cut on one side and not the other: one such element moved ResNet-29's
    # gradients by 2e-4 of their largest value; 1e-3 leaves room for a few such elements and no more.
    assert model_error(gradients(plain, x), expected) <= 1e-3
    assert model_error(gradients(fused, x), expected) <= 1e-3
    for a, b in zip(plain.buffers(), fused.buffers()):
        if a.is_floating_point():
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
        else:
            assert torch.equal(a, b)

    # Evaluation runs torch's functions on the running statistics: the plain model's outputs.
    plain.eval(), fused.eval()
    with torch.no_grad():
        torch.testing.assert_close(fused(x), plain(x), rtol=1e-5, atol=1e-5)


def test_recomputation_of_fused_units_gives_bitwise_the_same_gradients_and_statistics():
    torch.manual_seed(0)
    model_spec = spec("resnet", "20", "batch", 32)
    fused = build_model(model_spec).to(memory_format=torch.channels_last).train()
    fuse_norm_activations(fused)
    recomputed = copy.deepcopy(fused)  # the fused forwards are bound to the copy's modules
    assert recompute_blocks(recomputed, recomputation_blocks(model_spec, recomputed)) == 9
    x = torch.randn(8, 3, 32, 32).to(memory_format=torch.channels_last)
    # Same kernels, same shapes, same threads: the recomputed forward repeats the first one exactly.
    for a, b in zip(gradients(fused, x), gradients(recomputed, x)):
        assert torch.equal(a, b)
    for a, b in zip(fused.buffers(), recomputed.buffers()):
        assert torch.equal(a, b)  # the statistics were updated once, not twice


def test_both_norms_are_fused_by_default_where_measured_and_only_on_cpus():
    default = (nn.BatchNorm2d, nn.GroupNorm)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert fused_norms(cpu, "auto") == (default if kernels.wide_build() else ())
    assert fuses_squeeze_excitation(cpu, "auto") == kernels.wide_build()
    assert fused_norms(cpu, "on") == (nn.BatchNorm2d, nn.GroupNorm)
    assert fuses_squeeze_excitation(cpu, "on")
    assert fused_norms(cuda, "on") == () and not fuses_squeeze_excitation(cuda, "on")
    assert fused_norms(cpu, "off") == () and not fuses_squeeze_excitation(cpu, "off")


def test_only_the_norms_asked_for_are_fused():
    batch = build_model(ModelSpec(arch="resnet", size="8", num_classes=10, image_size=32, norm="batch"))
    group = build_model(ModelSpec(arch="resnet", size="8", num_classes=10, image_size=32, norm="group", groups=4))
    classes = [type(m) for m in batch.modules()]
    assert fuse_norm_activations(batch, (nn.GroupNorm,)) == 0
    assert [type(m) for m in batch.modules()] == classes  # nothing specialised or swapped
    assert fuse_norm_activations(group, (nn.GroupNorm,)) > 0
    efficientnet = build_model(ModelSpec(arch="efficientnet", size="B0", num_classes=10, image_size=64))
    assert fuse_norm_activations(efficientnet, (nn.GroupNorm,)) == 0
    # Every norm: stem + 16 depthwise + 15 expansion + 16 projection (no activation) + head.
    assert fuse_norm_activations(efficientnet, (nn.BatchNorm2d,)) == 1 + 16 + 15 + 16 + 1


@pytest.mark.parametrize("name", ["norm_act", "depthwise", "rounding"])
def test_every_build_runs_on_torchs_threads(name):
    """The kernels' parallel_for is an OpenMP pragma: built without OpenMP, every pass ran on one thread whatever
    torch.set_num_threads said."""
    import importlib

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        builds = importlib.import_module(f"cnns.kernels.{name}").builds()
        assert builds, f"no build of {name} here"
        for build in builds:
            assert build.parallel_threads(64) == 2, build.name
            assert build.parallel_threads(1) == 1, build.name
    finally:
        torch.set_num_threads(threads)
