import io

import pytest
import torch
from torch import nn

import cnns.stochastic_rounding
from cnns.errors import ConfigError
from cnns.kernels import rounding
from cnns.optim import (
    NORM_OR_BIAS,
    OPTIMISERS,
    HalfPrecisionOptimiser,
    OptimiserSpec,
    build_optimiser,
    parameter_groups,
    set_lr,
)
from cnns.stochastic_rounding import stochastic_round

# --------------------------------------------------------------------------------------------
# stochastic rounding
# --------------------------------------------------------------------------------------------

SAMPLES = 1_000_000
# Gap between 1.0 and the next representable value: 7 and 10 stored mantissa bits.
GAP_ABOVE_ONE = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


@pytest.fixture(params=["pass", "operators"])
def bfloat16_rounding(request, monkeypatch):
    """Each bfloat16 rounding test runs both implementations: the C++ pass of `cnns.kernels.rounding` (the
    CPU's, where built) and the torch operators (GPUs', and the CPU's where the pass was not built)."""
    if request.param == "pass" and not rounding.available():
        pytest.skip("the rounding pass was not built")
    if request.param == "operators":
        monkeypatch.setattr(cnns.stochastic_rounding, "_rounding_kernel", lambda: None)
    return request.param


# float16 has no pass: its tests run the operators once.
EACH_ROUNDING = pytest.mark.parametrize("dtype, bfloat16_rounding", [
    (torch.bfloat16, "pass"), (torch.bfloat16, "operators"), (torch.float16, "operators")],
    indirect=["bfloat16_rounding"], ids=["bfloat16-pass", "bfloat16-operators", "float16"])


@EACH_ROUNDING
@pytest.mark.parametrize("sign", [1.0, -1.0])
@pytest.mark.parametrize("fraction", [0.1, 0.37, 0.5, 0.9])
def test_stochastic_round_is_unbiased_and_lands_on_a_neighbour(dtype, sign, fraction, bfloat16_rounding):
    gap = GAP_ABOVE_ONE[dtype]
    low, high = sign * 1.0, sign * (1.0 + gap)
    value = sign * (1.0 + fraction * gap)  # exactly representable in float32
    x = torch.full((SAMPLES,), value, dtype=torch.float32)
    generator = torch.Generator().manual_seed(1234)

    rounded = stochastic_round(x, dtype, generator)

    assert rounded.dtype == dtype
    as_float = rounded.double()
    assert torch.all((as_float == low) | (as_float == high))
    # Standard error of the mean is gap * sqrt(f(1-f)/N) <= 5e-4 gap; allow 6 of those.
    assert abs(as_float.mean().item() - value) < 3e-3 * gap
    assert abs((as_float == high).double().mean().item() - fraction) < 3e-3


@EACH_ROUNDING
def test_stochastic_round_leaves_representable_values_and_specials_alone(dtype, bfloat16_rounding):
    exact = torch.tensor([0.0, -0.0, 1.0, -2.5, 0.375, 1024.0, float("inf"), float("-inf")]).to(dtype)
    x = exact.float().repeat(1000)
    rounded = stochastic_round(x, dtype, torch.Generator().manual_seed(0))
    assert torch.equal(rounded.view(torch.int16), exact.repeat(1000).view(torch.int16))  # sign of zero too
    assert torch.isnan(stochastic_round(torch.tensor([float("nan")]), dtype)).all()


def test_bfloat16_nans_stay_nans_whatever_their_payload(bfloat16_rounding):
    # A NaN whose payload is in the low half alone: carrying noise into the top half, or dropping the low
    # half, would give an infinity.
    bits = torch.tensor([0x7F800001, 0xFF800001, 0x7F80FFFF, 0x7FC00000, 0xFFFFFFFF], dtype=torch.int64)
    x = bits.to(torch.int32).view(torch.float32).repeat(1000)  # int64 -> int32 wraps the top bit: the sign
    rounded = stochastic_round(x, torch.bfloat16, torch.Generator().manual_seed(2))
    assert torch.isnan(rounded).all()


def _splitmix64_noise(key: int, count: int) -> list[int]:
    """The rounding pass's documented noise, in Python integers: element i takes bits 16*(i % 4) .. +15 of
    SplitMix64's output for the (i // 4 + 1)-th step of the Weyl sequence started at ``key``."""
    mask = (1 << 64) - 1
    noise = []
    for i in range(count):
        z = (key + (i // 4 + 1) * 0x9E3779B97F4A7C15) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        z ^= z >> 31
        noise.append((z >> (16 * (i % 4))) & 0xFFFF)
    return noise


@pytest.mark.skipif(not rounding.available(), reason="the rounding pass was not built")
def test_rounding_pass_adds_the_documented_noise_on_any_thread_count():
    count = 1031  # a partial last block of 4
    x = torch.randn(count, generator=torch.Generator().manual_seed(4)) * 3.0
    key = -0x1234_5678_9ABC_DEF0
    bits = x.view(torch.int32).tolist()
    expected = [((b & 0xFFFFFFFF) + n) >> 16 for b, n in zip(bits, _splitmix64_noise(key % (1 << 64), count))]
    got = rounding.stochastic_round_bfloat16(x, key).view(torch.int16).tolist()
    assert [g & 0xFFFF for g in got] == expected
    # Any thread computes any element's noise: the result does not depend on how the work is split.
    big = torch.randn(1 << 20, generator=torch.Generator().manual_seed(5))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = rounding.stochastic_round_bfloat16(big, 77)
        torch.set_num_threads(2)
        two = rounding.stochastic_round_bfloat16(big, 77)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one.view(torch.int16), two.view(torch.int16))


def test_stochastic_round_float16_subnormals_are_unbiased():
    tiny = 2.0**-24  # smallest float16 subnormal
    value = 3.25 * tiny
    rounded = stochastic_round(torch.full((SAMPLES,), value), torch.float16, torch.Generator().manual_seed(5))
    as_float = rounded.double()
    assert torch.all((as_float == 3 * tiny) | (as_float == 4 * tiny))
    assert abs(as_float.mean().item() - value) < 3e-3 * tiny


def test_stochastic_round_rejects_other_types():
    with pytest.raises(TypeError):
        stochastic_round(torch.ones(2), torch.float32)
    with pytest.raises(TypeError):
        stochastic_round(torch.ones(2, dtype=torch.float64), torch.bfloat16)


# --------------------------------------------------------------------------------------------
# 16.16 updates
# --------------------------------------------------------------------------------------------

def _sgd(lr):
    return lambda groups: build_optimiser(groups, OptimiserSpec("SGD", lr=lr))


@pytest.mark.parametrize("stochastic_rounding", [True, False])
def test_tiny_updates_accumulate_only_with_stochastic_rounding(stochastic_rounding):
    # Below 1.0 bfloat16 values are 2**-8 apart, so round-to-nearest discards any update smaller
    # than 2**-9 ~= 0.00195. 1000 updates of 1e-4 must still move the weight by ~0.1.
    half_ulp_below_one = 2.0**-8 / 2
    update = 1e-4
    assert update < half_ulp_below_one / 10
    weight = nn.Parameter(torch.ones(256, dtype=torch.bfloat16))
    optimiser = HalfPrecisionOptimiser([weight], _sgd(update), stochastic_rounding=stochastic_rounding, seed=7)

    for _ in range(1000):
        weight.grad = torch.ones_like(weight)
        optimiser.step()

    assert weight.dtype == torch.bfloat16
    if stochastic_rounding:
        assert abs(weight.float().mean().item() - 0.9) < 0.01
        assert abs(weight[0].float().item() - 0.9) < 0.05
    else:
        assert torch.all(weight == 1.0)


def test_float32_gradients_can_be_supplied_directly():
    # A loop that accumulates micro-batch gradients in float32 passes them to step(); the result is
    # the same as reading the (here exactly representable) half .grad.
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(5, 3, generator=generator).bfloat16().float(),
             torch.randn(5, generator=generator).bfloat16().float()]

    def run(pass_grads):
        layer = nn.Linear(3, 5).to(torch.bfloat16)
        with torch.no_grad():
            layer.weight.fill_(0.5)
            layer.bias.fill_(-0.25)
        optimiser = HalfPrecisionOptimiser(layer.parameters(), _sgd(0.01), stochastic_rounding=True, seed=3)
        if pass_grads:
            optimiser.step(grads)
        else:
            layer.weight.grad, layer.bias.grad = (g.to(torch.bfloat16) for g in grads)
            optimiser.step()
        return layer

    supplied, from_grad = run(pass_grads=True), run(pass_grads=False)
    assert torch.equal(supplied.weight, from_grad.weight) and torch.equal(supplied.bias, from_grad.bias)
    assert not torch.all(supplied.weight == 0.5)
    with pytest.raises(ValueError):
        HalfPrecisionOptimiser([nn.Parameter(torch.ones(2, dtype=torch.bfloat16))], _sgd(0.1),
                               stochastic_rounding=True, seed=0).step([])


def test_parameters_without_gradient_are_left_untouched():
    used = nn.Parameter(torch.ones(4, dtype=torch.float16))
    unused = nn.Parameter(torch.full((4,), 3.0, dtype=torch.float16))
    optimiser = HalfPrecisionOptimiser([used, unused], _sgd(0.5), stochastic_rounding=True, seed=0)
    used.grad = torch.ones_like(used)
    optimiser.step()
    assert torch.all(used == 0.5) and torch.all(unused == 3.0)
    optimiser.zero_grad()
    assert used.grad is None


def _half_model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4)).to(torch.bfloat16)


def _gradients(model, step):
    generator = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=generator) * 0.01 for p in model.parameters()]


def _make_half_optimiser(model, seed, offload_to=None):
    spec = OptimiserSpec("momentum", lr=0.05, momentum=0.9, weight_decay=1e-3)
    return HalfPrecisionOptimiser(
        parameter_groups(model, spec["weight_decay"]),
        lambda groups: build_optimiser(groups, spec),
        stochastic_rounding=True,
        seed=seed,
        offload_to=offload_to,
    )


def _train(model, optimiser, steps):
    for step in steps:
        for param, grad in zip(model.parameters(), _gradients(model, step)):
            param.grad = grad.to(param.dtype)
        optimiser.step()
        optimiser.zero_grad()


def test_state_dict_round_trip_continues_bitwise_identically():
    model = _half_model(seed=0)
    optimiser = _make_half_optimiser(model, seed=11)
    _train(model, optimiser, range(3))
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimiser": optimiser.state_dict()}, buffer)
    _train(model, optimiser, range(3, 8))

    def restored_run(load_optimiser_state):
        checkpoint = torch.load(io.BytesIO(buffer.getvalue()))
        restored = _half_model(seed=99)
        restored.load_state_dict(checkpoint["model"])
        restored_optimiser = _make_half_optimiser(restored, seed=12345)
        if load_optimiser_state:
            restored_optimiser.load_state_dict(checkpoint["optimiser"])
        _train(restored, restored_optimiser, range(3, 8))
        return restored

    restored = restored_run(load_optimiser_state=True)
    for original, again in zip(model.parameters(), restored.parameters()):
        assert torch.equal(original.view(torch.int16), again.view(torch.int16))
    # The check has teeth: without the momentum and generator state the runs diverge.
    fresh = restored_run(load_optimiser_state=False)
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_offloaded_optimiser_state_updates_the_weights_identically(dtype):
    """--offload-optimiser: working copies and state in host memory, weights copied back. Offloading
    to the host from the host exercises every copy that a GPU's parameters go through."""
    plain, offloaded = (_half_model(seed=0).to(dtype) for _ in range(2))
    kept = _make_half_optimiser(plain, seed=11)
    moved = _make_half_optimiser(offloaded, seed=11, offload_to=torch.device("cpu"))
    assert moved.offloaded and all(w is not p for w, p in zip(moved._working, moved.params))
    _train(plain, kept, range(4))
    _train(offloaded, moved, range(4))
    for a, b in zip(plain.parameters(), offloaded.parameters()):
        assert torch.equal(a, b)
    state = moved.state_dict()["inner"]["state"]
    assert all(s["momentum_buffer"].device.type == "cpu" and s["momentum_buffer"].dtype == torch.float32
               for s in state.values())


@pytest.mark.parametrize("name", OPTIMISERS)
def test_every_optimiser_updates_half_weights_by_its_float32_update_rounded_stochastically(name):
    """16.16, for each optimiser of the registry: the wrapper keeps its state in float32 and writes back the update
    it makes of float32 copies, rounded stochastically: one rounding of all the weights in the optimiser's order,
    by the wrapper's generator. A float32 model updated by the same optimiser and rounded so gives bitwise the
    same weights, step after step."""
    half = _half_model(seed=0)
    plain = _half_model(seed=0).float()  # the same weights (bfloat16 values are float32 values)
    spec = OptimiserSpec(name, lr=0.05, weight_decay=1e-2)
    wrapped = HalfPrecisionOptimiser(parameter_groups(half, 1e-2), lambda groups: build_optimiser(groups, spec),
                                     stochastic_rounding=True, seed=5)
    inner = build_optimiser(parameter_groups(plain, 1e-2), spec)
    order = [p for group in parameter_groups(plain, 0.0) for p in group["params"]]
    half_order = [p for group in parameter_groups(half, 0.0) for p in group["params"]]
    generator = torch.Generator().manual_seed(5)
    for step in range(3):
        for param, other, grad in zip(half.parameters(), plain.parameters(), _gradients(half, step)):
            param.grad = grad.to(torch.bfloat16)
            other.grad = param.grad.float()
        wrapped.step()
        inner.step()
        rounded = stochastic_round(torch.cat([p.detach().reshape(-1) for p in order]), torch.bfloat16, generator)
        with torch.no_grad():
            for param, piece in zip(order, rounded.split([p.numel() for p in order])):
                param.copy_(piece.view(param.shape))  # the half weights are the truth
        for param, other in zip(half_order, order):
            assert param.dtype == torch.bfloat16
            assert torch.equal(param.view(torch.int16), other.to(torch.bfloat16).view(torch.int16)), (name, step)
    state = [value for entry in wrapped.state_dict()["inner"]["state"].values() for value in entry.values()]
    assert state or OPTIMISERS[name].state_per_parameter == 0
    assert all(value.dtype == torch.float32 for value in state if torch.is_tensor(value) and value.is_floating_point())
    assert sum(value.numel() for value in state if torch.is_tensor(value) and value.dim() > 0) == \
        OPTIMISERS[name].state_per_parameter * sum(p.numel() for p in half.parameters())


def test_set_lr_reaches_the_inner_optimiser():
    model = _half_model(seed=0)
    optimiser = _make_half_optimiser(model, seed=0)
    set_lr(optimiser, 0.125)
    assert [g["lr"] for g in optimiser.param_groups] == [0.125, 0.125]
    assert all(g["lr"] == 0.125 for g in optimiser.inner.param_groups)


# --------------------------------------------------------------------------------------------
# parameter groups and the float32 optimisers against closed forms
# --------------------------------------------------------------------------------------------

class SmallNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3)
        self.bn = nn.BatchNorm2d(3)
        self.fc = nn.Linear(3, 2)


def _as_double(model):
    model = model.double()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float64))
    return model


def _set_grads(model, seed):
    generator = torch.Generator().manual_seed(seed)
    grads = {}
    for name, p in model.named_parameters():
        p.grad = torch.randn(p.shape, generator=generator, dtype=torch.float64)
        grads[name] = p.grad.clone()
    return grads


def test_norm_parameters_and_biases_are_not_decayed():
    net = SmallNet()
    decayed, exempt = parameter_groups(net, weight_decay=0.01)
    assert {id(p) for p in decayed["params"]} == {id(net.conv.weight), id(net.fc.weight)}
    assert {id(p) for p in exempt["params"]} == {
        id(net.conv.bias), id(net.bn.weight), id(net.bn.bias), id(net.fc.bias)}
    assert decayed["weight_decay"] == 0.01 and exempt["weight_decay"] == 0.0
    assert exempt[NORM_OR_BIAS] and not decayed[NORM_OR_BIAS]


def test_sgd_applies_l2_decay_only_to_the_decayed_group():
    net = _as_double(SmallNet())
    lr, wd = 0.1, 0.05
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    optimiser = build_optimiser(parameter_groups(net, wd), OptimiserSpec("sgd", lr=lr))
    grads = _set_grads(net, seed=1)
    optimiser.step()
    for name, p in net.named_parameters():
        decay = wd if name in ("conv.weight", "fc.weight") else 0.0
        expected = before[name] - lr * (grads[name] + decay * before[name])
        torch.testing.assert_close(p.detach(), expected, rtol=0, atol=1e-14)


def test_momentum_matches_closed_form_and_keeps_lr_outside_the_buffer():
    w0 = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    g1 = torch.tensor([0.3, 0.1, -0.2], dtype=torch.float64)
    g2 = torch.tensor([-0.4, 0.2, 0.6], dtype=torch.float64)
    mu, lr1, lr2 = 0.9, 0.1, 0.05
    w = nn.Parameter(w0.clone())
    optimiser = build_optimiser([w], OptimiserSpec("Momentum", lr=lr1, momentum=mu))
    w.grad = g1.clone()
    optimiser.step()
    set_lr(optimiser, lr2)
    w.grad = g2.clone()
    optimiser.step()

    m1 = g1
    w1 = w0 - lr1 * m1
    m2 = mu * m1 + g2
    w2 = w1 - lr2 * m2
    torch.testing.assert_close(w.detach(), w2, rtol=0, atol=1e-14)


def test_rmsprop_matches_tensorflow_closed_form():
    w0 = torch.tensor([[1.0, -2.0], [0.5, 3.0]], dtype=torch.float64)
    g1 = torch.tensor([[0.3, 0.1], [-0.2, 1.5]], dtype=torch.float64)
    g2 = torch.tensor([[-0.4, 0.2], [0.6, -0.1]], dtype=torch.float64)
    lr, rho, mu, eps, wd = 0.01, 0.9, 0.9, 1e-3, 1e-2
    w = nn.Parameter(w0.clone())
    optimiser = build_optimiser(
        [w], OptimiserSpec("RMSprop", lr=lr, momentum=mu, rmsprop_decay=rho, rmsprop_epsilon=eps, weight_decay=wd))
    for g in (g1, g2):
        w.grad = g.clone()
        optimiser.step()

    # TensorFlow: ms starts at 1; ms += (g^2 - ms)(1 - rho); mom = mu mom + lr g / sqrt(ms + eps);
    # w -= mom. L2 decay is added to the gradient first.
    ms, mom, expected = torch.ones_like(w0), torch.zeros_like(w0), w0.clone()
    for g in (g1, g2):
        g = g + wd * expected
        ms = ms + (g**2 - ms) * (1 - rho)
        mom = mu * mom + lr * g / torch.sqrt(ms + eps)
        expected = expected - mom
    torch.testing.assert_close(w.detach(), expected, rtol=0, atol=1e-14)


@pytest.mark.parametrize("lars_weight_decay", [1e-2, 0.0])
def test_lars_scales_weights_by_trust_ratio_and_skips_norms_and_biases(lars_weight_decay):
    net = _as_double(SmallNet())
    lr, eeta, eps = 0.5, 0.02, 1e-6
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    spec = OptimiserSpec("LARS", lr=lr, momentum=0.9, lars_eeta=eeta, lars_epsilon=eps,
                         lars_weight_decay=lars_weight_decay, weight_decay=0.5)
    optimiser = build_optimiser(parameter_groups(net, spec["weight_decay"]), spec)
    grads = _set_grads(net, seed=2)
    optimiser.step()

    for name, p in net.named_parameters():
        w, g = before[name], grads[name]
        if name in ("conv.weight", "fc.weight"):
            wd = lars_weight_decay
            trust = eeta * w.norm() / (g.norm() + wd * w.norm() + eps)
            expected = w - lr * trust * (g + wd * w)
        else:
            expected = w - lr * g  # skip list: no trust ratio, no decay
        torch.testing.assert_close(p.detach(), expected, rtol=0, atol=1e-14, msg=name)


def test_lars_weight_decay_defaults_to_weight_decay():
    w0 = torch.tensor([[3.0, 4.0]], dtype=torch.float64)  # norm 5
    g = torch.tensor([[0.0, 1.0]], dtype=torch.float64)   # norm 1
    w = nn.Parameter(w0.clone())
    optimiser = build_optimiser([w], OptimiserSpec("lars", lr=1.0, weight_decay=0.1, lars_eeta=0.001))
    w.grad = g.clone()
    optimiser.step()
    trust = 0.001 * 5 / (1 + 0.1 * 5)
    torch.testing.assert_close(w.detach(), w0 - trust * (g + 0.1 * w0), rtol=0, atol=1e-15)


def _float32_net_with_gradients(seed: int) -> tuple[SmallNet, dict[str, torch.Tensor]]:
    """SmallNet in float32 with standard-normal weights and gradients drawn from `seed`."""
    net = SmallNet()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=generator))
    grads = {}
    for name, p in net.named_parameters():
        p.grad = torch.randn(p.shape, generator=generator)
        grads[name] = p.grad.clone()
    return net, grads


def test_adamw_is_adams_step_beside_a_decoupled_decay_of_the_weights_only():
    net, grads = _float32_net_with_gradients(seed=3)
    lr, wd = 0.01, 0.1
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    optimiser = build_optimiser(parameter_groups(net, wd), OptimiserSpec("AdamW", lr=lr, weight_decay=wd))
    optimiser.step()

    for name, p in net.named_parameters():
        w, g = before[name].double(), grads[name].double()
        decay = wd if name in ("conv.weight", "fc.weight") else 0.0  # never norm parameters or biases
        # The first step: the bias-corrected averages are g and g^2, so Adam steps lr * g / (|g| + eps) (eps 1e-8,
        # torch's); the decay is decoupled, w (1 - lr wd), not added to the gradient.
        expected = w * (1 - lr * decay) - lr * g / (g.abs() + 1e-8)
        # In float32 each operation rounds its result by at most 2^-24 of it: the weight passes three (the decay's
        # factor, its product, the sum), the step (at most lr) about ten (the averages, the square root, the bias
        # corrections, the quotient, its factor); 2^-24 (3 |w| + 10 lr), doubled (measured: a quarter of it at most).
        # L2 decay in the gradient instead, or decayed norm parameters, would be off by about lr wd |w| = 1e-3 |w|,
        # over a thousand times this.
        bound = 2 * 2.0**-24 * (3 * w.abs() + 10 * lr)
        assert ((p.detach().double() - expected).abs() <= bound).all(), name


def test_adamw_updates_as_torchs_adamw_over_timms_parameter_groups():
    """The entry's AdamW and the one timm's factory makes (torch.optim.AdamW; timm's own rule for what is not
    decayed) update the same float32 weights bitwise alike, step after step."""
    from timm.optim import create_optimizer_v2

    ours, _ = _float32_net_with_gradients(seed=4)
    theirs, _ = _float32_net_with_gradients(seed=4)
    optimisers = [build_optimiser(parameter_groups(ours, 0.05), OptimiserSpec("AdamW", lr=0.02, weight_decay=0.05)),
                  create_optimizer_v2(theirs, "adamw", lr=0.02, weight_decay=0.05)]
    assert type(optimisers[1]) is torch.optim.AdamW
    for step in range(3):
        for net, optimiser in zip((ours, theirs), optimisers):
            generator = torch.Generator().manual_seed(100 + step)
            for p in net.parameters():
                p.grad = torch.randn(p.shape, generator=generator)
            optimiser.step()
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
        assert torch.equal(a, b), name


def test_lamb_is_the_trust_ratio_step_on_the_clipped_gradient_with_norm_parameters_and_biases_not_adapted():
    net, _ = _float32_net_with_gradients(seed=5)
    with torch.no_grad():
        for p in net.parameters():
            p.mul_(0.3)  # ||w|| about 0.3 ||step||: a trust ratio far from 1
            p.grad.mul_(100.0)  # a global norm of about 840, clipped to 1 ...
            p.grad.view(-1)[0] = 1e-4  # ... which brings these below epsilon (1e-6), where clipping shows
    before = {n: p.detach().double() for n, p in net.named_parameters()}
    grads = {n: p.grad.double() for n, p in net.named_parameters()}
    lr, wd, eps = 0.01, 0.1, 1e-6
    optimiser = build_optimiser(parameter_groups(net, wd), OptimiserSpec("LAMB", lr=lr, weight_decay=wd))
    optimiser.step()

    clip = max(torch.sqrt(sum((g**2).sum() for g in grads.values())).item(), 1.0)  # timm's max_grad_norm 1
    for name, p in net.named_parameters():
        w, g = before[name], grads[name] / clip
        # The first step: the bias-corrected averages are g and g^2, so Adam's step is g / (|g| + eps).
        step = g / (g.abs() + eps)
        if name in ("conv.weight", "fc.weight"):  # decayed: L2 in the step, scaled by the trust ratio
            step = step + wd * w
            step = step * w.norm() / step.norm()
        expected = w - lr * step  # norm parameters and biases: no decay, no ratio (timm's rule for them)
        # In float32 each operation rounds by at most 2^-24 of its result: the step's elements pass about ten; the
        # trust ratio's norms sum at most 54 squares (about 54 roundings, halved by the root, for each); the weight
        # one subtraction: 2^-24 (|w| + 70 |lr step|), doubled. A missing ratio (about 0.3 here) or clipping (the
        # 1e-4 gradients' steps 0.11 instead of 0.99), or decayed norm parameters, are off by a large part of a step.
        # Measured: a third of the bound at most.
        bound = 2 * 2.0**-24 * (w.abs() + 70 * (lr * step).abs())
        assert ((p.detach().double() - expected).abs() <= bound).all(), name


def test_lamb_updates_as_the_lamb_timms_factory_builds():
    """The entry's LAMB and the one timm's factory makes (its Lamb, its defaults, its own rule for what is not
    decayed) update the same float32 weights alike, step after step. The only difference is the order of the
    parameters in the gradient's global norm (timm lists the undecayed first): its sum of six squared norms
    may round differently, by a few 2^-24 of the clipping factor, which moves each step by far less than a
    rounding of the weight; 16 roundings of the weight (2^-20 relative, or of the learning rate where the weight is
    small) bound the difference after five steps. Measured: bitwise equal."""
    from timm.optim import Lamb, create_optimizer_v2

    lr = 0.02
    ours, _ = _float32_net_with_gradients(seed=6)
    theirs, _ = _float32_net_with_gradients(seed=6)
    optimisers = [build_optimiser(parameter_groups(ours, 0.05), OptimiserSpec("LAMB", lr=lr, weight_decay=0.05)),
                  create_optimizer_v2(theirs, "lamb", lr=lr, weight_decay=0.05)]
    assert type(optimisers[0]) is type(optimisers[1]) is Lamb
    for step in range(5):
        for net, optimiser in zip((ours, theirs), optimisers):
            generator = torch.Generator().manual_seed(200 + step)
            for p in net.parameters():
                p.grad = torch.randn(p.shape, generator=generator) * 10  # clipped
            optimiser.step()
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b, rtol=2.0**-20, atol=2.0**-20 * lr, msg=name)


@pytest.mark.parametrize("kwargs", [
    dict(name="adam"),
    dict(lr=-1.0),
    dict(momentum=1.0),
    dict(weight_decay=-0.1),
    dict(rmsprop_decay=1.5),
    dict(lars_weight_decay=-1.0),
])
def test_invalid_optimiser_options_raise_config_error(kwargs):
    with pytest.raises(ConfigError):
        OptimiserSpec(**(dict(name="SGD", lr=0.1) | kwargs))


def test_empty_parameter_list_is_a_config_error():
    with pytest.raises(ConfigError):
        build_optimiser([], OptimiserSpec("SGD", lr=0.1))
