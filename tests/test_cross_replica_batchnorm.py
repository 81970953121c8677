"""--BN-span on the CPU: two processes with half a batch each compute what one process computes on the whole.

One 2-process gloo run does every multi-process check and saves what each rank saw to files; the test
compares those with the plain model run on the whole batch in this process. The models are checked with
torch's batch norm layers converted (`cross_replica_batch_norm`) and, where the fused passes are built,
with their batch norms fused (`fuse_norm_activations` with the span; a CIFAR ResNet's units and stem, timm's
norm + activation, and the layers left unfused converted as before).
"""

from __future__ import annotations

import socket
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from timm.layers import BatchNormAct2d
from torch import nn

from cnns.engine.fusion import fuse_norm_activations
from cnns.kernels import norm_act
from cnns.models import build_model
from cnns.models.model_spec import ModelSpec
from cnns.parallel.batchnorm import batch_norm_span, cross_replica_batch_norm

CPU = torch.device("cpu")
HALF = 8  # each rank's micro-batch: the two halves of a batch of 16
UNEVEN = (8, 5)  # the layer checks: micro-batches of different sizes (a last, partial batch)
TIMEOUT_S = 120


def _model() -> nn.Module:
    # Convolutions without bias before a batch norm: its gradient would be 0 up to rounding noise.
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6), nn.ReLU(),
        nn.Conv2d(6, 8, 3, padding=1, stride=2, bias=False), BatchNormAct2d(8, act_layer=nn.SiLU),  # timm: norm, act
        nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8, momentum=None),  # cumulative averages
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5),
    )


def _resnet() -> nn.Module:
    # Residual units whose last batch norm, shortcut addition and ReLU fuse, and a stem.
    return build_model(ModelSpec(arch="resnet", size="8", num_classes=5, image_size=32))


MODELS = {"model": _model, "resnet": _resnet}


def _layers() -> dict[str, nn.Module]:
    return {
        "bf16_input": nn.BatchNorm2d(4),  # bfloat16 activations, float32 norm parameters
        "bf16_all": nn.BatchNorm2d(4).to(torch.bfloat16),  # everything bfloat16
        "untracked_1d": nn.BatchNorm1d(4, track_running_stats=False),  # (N, C) input, no running statistics
    }


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.square().sum(1).mean()  # a mean over the (local) micro-batch


def _rows(rank: int, sizes=(HALF, HALF)) -> slice:
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def _randomise(module: nn.Module) -> None:
    """Affine parameters and running statistics away from their initial 1 and 0."""
    with torch.no_grad():
        for norm in module.modules():
            if isinstance(norm, nn.modules.batchnorm._BatchNorm):
                if norm.weight is not None:
                    norm.weight.uniform_(0.5, 1.5)
                    norm.bias.uniform_(-0.5, 0.5)
                if norm.running_mean is not None:
                    norm.running_mean.uniform_(-0.3, 0.3)
                    norm.running_var.uniform_(0.5, 2.0)


def _setup() -> dict:
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    models = {"model": _model()}
    _randomise(models["model"])
    layers = _layers()
    for layer in layers.values():
        _randomise(layer)
    models["resnet"] = _resnet()  # drawn after the others, which keep the numbers they were checked with
    _randomise(models["resnet"])

    def images(n):
        return (torch.randn(n, 3, 12, 12, generator=generator) * 1.5 + 0.3).contiguous(
            memory_format=torch.channels_last)

    n = sum(UNEVEN)
    return {
        **{name: model.state_dict() for name, model in models.items()},
        "batches": [images(2 * HALF), images(2 * HALF)],
        "eval_batch": images(2 * HALF),
        "layers": {name: layer.state_dict() for name, layer in layers.items()},
        "layer_inputs": {
            "bf16_input": torch.randn(n, 4, 5, 5, generator=generator).to(torch.bfloat16).contiguous(
                memory_format=torch.channels_last),
            "bf16_all": (torch.randn(n, 4, 5, 5, generator=generator) + 1).to(torch.bfloat16),
            "untracked_1d": torch.randn(n, 4, generator=generator) * 2 - 1,
        },
    }


# ------------------------------------------------------------------------------------------------
# the worker processes


def _worker(rank: int, port: int, directory: str) -> None:
    torch.set_num_threads(1)
    directory = Path(directory)
    setup = torch.load(directory / "setup.pt")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    try:
        seen = _run_checks(rank, setup)
    finally:
        dist.destroy_process_group()
    torch.save(seen, directory / f"rank{rank}.pt")


def _run_checks(rank: int, setup: dict) -> dict:
    span = dist.new_group([0, 1])
    alone = [dist.new_group([r]) for r in range(2)][rank]  # every rank takes part in creating every group
    seen = {}

    # A span of one replica: nothing changes.
    lone = _model()
    returned, converted = cross_replica_batch_norm(lone, alone, CPU)
    seen["alone"] = (converted, returned is lone, [name for name, m in lone.named_modules() if "forward" in vars(m)])

    model = _model()
    model.load_state_dict(setup["model"])
    model = model.to(memory_format=torch.channels_last)
    keys, types = list(model.state_dict()), [type(m) for m in model.modules()]
    returned, seen["converted"] = cross_replica_batch_norm(model, span, CPU)
    seen["same_object"] = returned is model
    seen["same_keys"] = list(model.state_dict()) == keys
    seen["same_types"] = [type(m) for m in model.modules()] == types

    seen["model"] = _train_on_my_half(model, setup, rank, span)

    # The fused passes taking the span's statistics, on both models.
    seen["fused"] = {}
    if norm_act.available():
        for name, make in MODELS.items():
            model = make()
            model.load_state_dict(setup[name])
            model = model.to(memory_format=torch.channels_last)
            fused = fuse_norm_activations(model, (nn.BatchNorm2d,), batch_norm_span(span))
            _, converted = cross_replica_batch_norm(model, span, CPU)
            seen["fused"][name] = {"fused": fused, "converted": converted,
                                   **_train_on_my_half(model, setup, rank, span)}

    # Single layers: uneven micro-batches, bfloat16, channels_last, (N, C) inputs.
    rows = _rows(rank, UNEVEN)
    seen["layers"] = {}
    for name, layer in _layers().items():
        layer.load_state_dict(setup["layers"][name])
        cross_replica_batch_norm(layer, span, CPU)
        x = setup["layer_inputs"][name][rows].clone().requires_grad_()
        out = layer.train()(x)
        _loss(out.float().flatten(1)).backward()
        seen["layers"][name] = {
            "out": out.detach(), "channels_last": out.is_contiguous(memory_format=torch.channels_last),
            "grad_dtype": x.grad.dtype, "buffers": {n: b.clone() for n, b in layer.named_buffers()},
        }
    return seen


def _train_on_my_half(model: nn.Module, setup: dict, rank: int, span) -> dict:
    """Two training steps on this rank's half of each batch (gradients averaged as DDP does), a training-mode
    forward without autograd, the buffers, and an evaluation-mode forward."""
    seen = {}
    rows = _rows(rank)
    model.train()
    for step, batch in enumerate(setup["batches"]):
        model.zero_grad(set_to_none=True)
        out = model(batch[rows])
        _loss(out).backward()
        grads = {}
        for name, parameter in model.named_parameters():
            grad = parameter.grad.clone()
            dist.all_reduce(grad, group=span)  # what DDP does: the mean over the replicas
            grads[name] = grad / 2
        seen[f"train{step}"] = (out.detach(), grads)
    with torch.no_grad():  # training mode without autograd: still the span's statistics
        seen["train_no_grad"] = model(setup["batches"][0][rows])
    seen["buffers"] = {name: buffer.clone() for name, buffer in model.named_buffers()}
    model.eval()
    with torch.no_grad():
        seen["eval"] = model(setup["eval_batch"][rows])
    return seen


def _run_two_ranks(directory: Path) -> tuple[dict, list[dict]]:
    setup = _setup()
    torch.save(setup, directory / "setup.pt")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = mp.start_processes(_worker, args=(port, str(directory)), nprocs=2, start_method="spawn", join=False)
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                pytest.fail(f"the 2-process gloo run did not finish within {TIMEOUT_S} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
            process.join(5)
    return setup, [torch.load(directory / f"rank{rank}.pt") for rank in range(2)]


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-5, what: str = "") -> None:
    """Relative to the whole tensor's size: |actual - expected| <= rtol |expected| (Euclidean norms)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    error, size = (actual.double() - expected.double()).norm(), expected.double().norm()
    assert error <= rtol * size + 1e-12, f"{what}: relative error {error / size:.2e}"


# ------------------------------------------------------------------------------------------------
# the tests


def test_no_group_changes_nothing():
    model = _model()
    assert cross_replica_batch_norm(model, None, CPU) == (model, 0)
    assert not [name for name, m in model.named_modules() if "forward" in vars(m)]


@pytest.mark.multiprocess
def test_two_processes_with_half_a_batch_each_compute_what_one_process_computes_on_the_whole(tmp_path):
    # One test, not several sharing a fixture: pytest -n 2 would start the 2-process run once per xdist worker.
    setup, seen = _run_two_ranks(tmp_path)
    _check_a_span_of_one_changes_nothing(seen)
    _check_converted_in_place_keeping_types_and_state_dict_keys(seen)
    _check_outputs_gradients_and_running_statistics(setup, "model", [s["model"] for s in seen])
    if norm_act.available():
        # timm's norm + SiLU fused, the two plain batch norms converted; the ResNet-8's stem and three units
        # fused (all 7 norms), none left to convert.
        assert [(s["fused"]["model"]["fused"], s["fused"]["model"]["converted"]) for s in seen] == [(1, 2)] * 2
        assert [(s["fused"]["resnet"]["fused"], s["fused"]["resnet"]["converted"]) for s in seen] == [(4, 0)] * 2
        # The fused passes sum each channel's terms in another order than torch (float32 blocks of rows, folded
        # in float64). A gradient that is a sum of K terms with cancellation moves by up to K x 2^-24 of the
        # terms' magnitude: for timm's norm's bias, K = 16 x 6 x 6 = 576 terms whose magnitudes add up to 45-53x
        # the sum (measured on these batches), so up to 576 x 2^-24 x 53 = 1.8e-3 of it (sqrt(576) x 2^-24 x 53
        # = 7.6e-5 typically). A replica normalising with its own half's statistics is off by 5.5 % in its outputs.
        for name in MODELS:
            _check_outputs_gradients_and_running_statistics(setup, name, [s["fused"][name] for s in seen], 1.8e-3)
    for name in _layers():
        _check_single_layer_over_uneven_micro_batches(setup, seen, name)


def _check_a_span_of_one_changes_nothing(seen):
    for rank in range(2):
        assert seen[rank]["alone"] == (0, True, [])


def _check_converted_in_place_keeping_types_and_state_dict_keys(seen):
    for rank in range(2):
        assert seen[rank]["converted"] == 3
        assert seen[rank]["same_object"] and seen[rank]["same_keys"] and seen[rank]["same_types"]


def _check_outputs_gradients_and_running_statistics(setup, name, seen, rtol=1e-5):
    """Outputs, parameter gradients (averaged as DDP does) and running statistics of the whole batch."""
    plain = MODELS[name]()
    plain.load_state_dict(setup[name])
    plain = plain.to(memory_format=torch.channels_last).train()
    for step, batch in enumerate(setup["batches"]):
        plain.zero_grad(set_to_none=True)
        out = plain(batch)
        _loss(out).backward()  # the mean loss over all 16
        for rank in range(2):
            out_rank, grads = seen[rank][f"train{step}"]
            _assert_close(out_rank, out.detach()[_rows(rank)], rtol=rtol, what=f"{name} step {step} rank {rank} outputs")
            for key, parameter in plain.named_parameters():
                _assert_close(grads[key], parameter.grad, rtol=rtol, what=f"{name} step {step} rank {rank} gradient of {key}")
    with torch.no_grad():
        out = plain(setup["batches"][0])
    for rank in range(2):
        _assert_close(seen[rank]["train_no_grad"], out[_rows(rank)], rtol=rtol, what=f"{name} rank {rank} no-grad outputs")
    for key, buffer in plain.named_buffers():
        for rank in range(2):
            if key.endswith("num_batches_tracked"):
                assert torch.equal(seen[rank]["buffers"][key], buffer) and buffer.item() == 3, key
            else:
                _assert_close(seen[rank]["buffers"][key], buffer, rtol=rtol, what=f"{name} rank {rank} {key}")
    plain.eval()
    with torch.no_grad():
        out = plain(setup["eval_batch"])
    for rank in range(2):
        _assert_close(seen[rank]["eval"], out[_rows(rank)], rtol=rtol, what=f"{name} rank {rank} eval outputs")


def _check_single_layer_over_uneven_micro_batches(setup, seen, name):
    """Micro-batches of 8 and 5; the output keeps the input's dtype and memory format."""
    layer = _layers()[name]
    layer.load_state_dict(setup["layers"][name])
    x = setup["layer_inputs"][name]
    # The reference: float32 arithmetic on the whole batch, with float32 parameters and statistics.
    reference = layer.float().train()(x.float()).detach()
    rtol = 1e-5 if x.dtype == torch.float32 else 2**-8  # bfloat16 output: one rounding
    for rank in range(2):
        got = seen[rank]["layers"][name]
        assert got["out"].dtype == x.dtype and got["grad_dtype"] == x.dtype
        assert got["channels_last"] == (name == "bf16_input")
        _assert_close(got["out"].float(), reference[_rows(rank, UNEVEN)], rtol, f"{name} rank {rank}")
        for buffer_name, buffer in layer.named_buffers():
            expected = buffer.to(got["buffers"][buffer_name].dtype)
            if buffer_name == "num_batches_tracked":
                assert torch.equal(got["buffers"][buffer_name], expected)
            else:
                _assert_close(got["buffers"][buffer_name].float(), expected.float(), rtol, f"{name} {buffer_name}")
