"""Run-time wrappers change how a model runs, never what it computes: recomputation and the GPU's
reproducible mode here."""

from __future__ import annotations

import copy

import pytest

import scripts
import torch
from torch import nn

from cnns.engine.kernel_choice import choose_gpu_kernels, compute_reproducibly
from cnns.engine.recomputation import recompute_blocks
from cnns.models import ModelSpec, build_model, recomputation_blocks


def tensors_saved_for_backward(forward):
    """(forward's result, how many tensors autograd saved for the backward pass while it ran)."""
    saved = 0

    def pack(tensor):
        nonlocal saved
        saved += 1
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = forward()
    return result, saved


def _forward_backward(model: nn.Module, x: torch.Tensor):
    model.train()
    model.zero_grad(set_to_none=True)
    out = model(x)
    out.square().mean().backward()
    return out.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("spec", [
    ModelSpec(arch="resnet", size="8", num_classes=10, image_size=32),
    ModelSpec(arch="efficientnet", size="cifar", num_classes=10, image_size=32),
], ids=["resnet8", "efficientnet-cifar"])
def test_recomputed_blocks_give_bitwise_the_same_outputs_gradients_and_norm_statistics(spec):
    torch.manual_seed(0)
    plain = build_model(spec).to(memory_format=torch.channels_last)
    recomputed = copy.deepcopy(plain)
    blocks = recomputation_blocks(spec, recomputed)
    assert recompute_blocks(recomputed, blocks) == len(blocks) > 2
    assert recomputed.state_dict().keys() == plain.state_dict().keys()
    x = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(1)).contiguous(
        memory_format=torch.channels_last)
    out_plain, grads_plain = _forward_backward(plain, x)
    out_recomputed, grads_recomputed = _forward_backward(recomputed, x)
    assert torch.equal(out_plain, out_recomputed)
    for name in grads_plain:
        assert torch.equal(grads_plain[name], grads_recomputed[name]), name
    # The recomputed forward must not fold the batch into the running statistics a second time.
    buffers_plain, buffers_recomputed = dict(plain.named_buffers()), dict(recomputed.named_buffers())
    for name, value in buffers_plain.items():
        assert torch.equal(value, buffers_recomputed[name]), name


def test_recomputation_frees_the_blocks_inner_activations():
    """Fewer tensors are saved for the backward pass: the point of recomputation."""
    spec = ModelSpec(arch="resnet", size="20", num_classes=10, image_size=32)
    torch.manual_seed(0)
    plain = build_model(spec)
    recomputed = copy.deepcopy(plain)
    recompute_blocks(recomputed, recomputation_blocks(spec, recomputed))
    x = torch.randn(16, 3, 32, 32)

    def saved_bytes(model: nn.Module) -> int:
        total = 0

        def pack(t: torch.Tensor):
            nonlocal total
            total += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(x).sum()
        return total

    assert saved_bytes(recomputed) < 0.5 * saved_bytes(plain)


def test_enable_recomputation_trains_and_evaluation_runs_without_it(tmp_path, capfd):
    # train.py's command in this process (tests/scripts.py): the run, not the interpreter, is what is checked.
    out = scripts.run_here(capfd, "train.py", "--dataset", "cifar-10", "--synthetic-data", "--model-size", "8",
                           "--micro-batch-size", "8", "--iterations", "3", "--log-freq", "1", "--enable-recomputation",
                           "--ckpts-per-epoch", "0", "--log-dir", str(tmp_path / "logs"), cwd=tmp_path)
    assert "not supported yet" not in out.stdout + out.stderr
    assert out.stdout.count("throughput:") >= 3


def test_graphcores_recomputation_points_keep_only_the_segment_inputs():
    """--pipeline --shards 1 --pipeline-splits A B --enable-recomputation: three segments, each
    recomputed whole; the same outputs, gradients and statistics as the plain model, and fewer saved
    tensors than even per-unit recomputation."""
    from cnns.engine.recomputation import recompute_between_splits
    from cnns.models import resolve_splits
    from cnns.models.split_points import model_pieces, stage_pieces

    spec = ModelSpec(arch="resnet", size="20", num_classes=10, image_size=32)
    torch.manual_seed(0)
    plain = build_model(spec)
    segmented, per_unit = copy.deepcopy(plain), copy.deepcopy(plain)
    cuts = resolve_splits(spec, segmented, ["stage1/unit3/relu", "stage2/unit3/relu"])
    assert recompute_between_splits(segmented, stage_pieces(model_pieces(spec, segmented, cuts), cuts)) == 3
    recompute_blocks(per_unit, recomputation_blocks(spec, per_unit))
    x = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    out_plain, grads_plain = _forward_backward(plain, x)
    out_segmented, grads_segmented = _forward_backward(segmented, x)
    assert torch.equal(out_plain, out_segmented)
    for name in grads_plain:
        assert torch.equal(grads_plain[name], grads_segmented[name]), name
    for name, value in plain.named_buffers():
        assert torch.equal(value, dict(segmented.named_buffers())[name]), name

    def saved_tensors(model: nn.Module) -> int:
        return tensors_saved_for_backward(lambda: model(x).sum())[1]

    assert saved_tensors(segmented) < saved_tensors(per_unit) < saved_tensors(plain)


@pytest.fixture
def torch_determinism_restored():
    """compute_reproducibly sets process-wide flags: put them back for the other tests of this worker."""
    import os

    saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic,
             os.environ.get("CUBLAS_WORKSPACE_CONFIG"), torch.utils.deterministic.fill_uninitialized_memory)
    yield
    torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
    torch.utils.deterministic.fill_uninitialized_memory = saved[5]
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = saved[2], saved[3]
    if saved[4] is None:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)


@pytest.mark.parametrize("spec", [
    ModelSpec(arch="resnet", size="8", num_classes=10, image_size=32),
    ModelSpec(arch="resnet", size="18", num_classes=10, image_size=64),
    ModelSpec(arch="efficientnet", size="cifar", num_classes=10, image_size=32),
], ids=["cifar-resnet8", "timm-resnet18", "timm-efficientnet"])
def test_the_reproducible_mode_pools_by_a_mean_that_computes_what_the_pool_does(spec, torch_determinism_restored):
    """--seed on a GPU: global average pooling (no deterministic CUDA backward) becomes a mean. Checked here on
    the CPU, where both run: same outputs and gradients, within float32 rounding of a different summation
    order (a mean of H x W <= 64 values moves by at most 64 x 2^-24 of the values' magnitude: 4e-6)."""
    torch.manual_seed(0)
    pooled = build_model(spec).to(memory_format=torch.channels_last)
    mean = copy.deepcopy(pooled)
    assert compute_reproducibly(mean) == 1
    assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert not torch.utils.deterministic.fill_uninitialized_memory
    assert __import__("os").environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert mean.state_dict().keys() == pooled.state_dict().keys()
    x = torch.randn(4, 3, spec.image_size, spec.image_size, generator=torch.Generator().manual_seed(1)).contiguous(
        memory_format=torch.channels_last)
    out_a, grads_a = _forward_backward(pooled, x)
    out_b, grads_b = _forward_backward(mean, x)
    torch.testing.assert_close(out_b, out_a, rtol=1e-5, atol=1e-5)
    for name, grad in grads_a.items():
        torch.testing.assert_close(grads_b[name], grad, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("reproducible", [False, True], ids=["fastest", "seeded"])
def test_a_gpu_run_times_cudnn_algorithms_unless_it_must_repeat_bit_for_bit(reproducible, torch_determinism_restored):
    torch.backends.cudnn.benchmark = torch.backends.cudnn.deterministic = False
    torch.use_deterministic_algorithms(False)
    model = build_model(ModelSpec(arch="resnet", size="8", num_classes=10, image_size=32))
    pool = next(m for m in model.modules() if isinstance(m, torch.nn.AdaptiveAvgPool2d))
    choose_gpu_kernels(model, reproducible)
    assert torch.backends.cudnn.benchmark is not reproducible
    assert torch.backends.cudnn.deterministic is reproducible
    assert torch.are_deterministic_algorithms_enabled() is reproducible
    # The pool computed as a mean only for a seeded run: the same module, its class specialised.
    assert (type(pool).forward is not torch.nn.AdaptiveAvgPool2d.forward) is reproducible
    assert pool is next(m for m in model.modules() if isinstance(m, torch.nn.AdaptiveAvgPool2d))


def test_a_model_that_cannot_compile_stops_with_one_line_naming_no_compile():
    from cnns.engine.compilation import compilation_failures_named
    from cnns.errors import ConfigError

    def failing_backend(graph, example_inputs):
        raise RuntimeError("this backend cannot lower aten.convolution")

    model = torch.compile(nn.Conv2d(3, 4, 3), backend=failing_backend)
    with pytest.raises(ConfigError) as error, compilation_failures_named():
        model(torch.randn(2, 3, 8, 8))
    line = str(error.value)
    assert "--no-compile" in line and "cannot lower aten.convolution" in line and "\n" not in line
    with compilation_failures_named():  # anything else passes through untouched
        assert nn.Conv2d(3, 4, 3)(torch.randn(1, 3, 8, 8)).shape == (1, 4, 6, 6)


def test_a_stage_keeps_the_recomputation_of_a_block_it_cuts_inside():
    """A pipeline cut inside a recomputed EfficientNet block runs the block's parts on their own, not through its
    forward: keep_recomputation recomputes each part (same outputs and gradients, fewer saved tensors), and
    leaves the parts of a block recompute_blocks did not wrap, and whole pieces, as they are."""
    from cnns.engine.recomputation import _Recomputed, keep_recomputation
    from cnns.models.split_points import model_pieces

    spec = ModelSpec(arch="efficientnet", size="B0", num_classes=10, image_size=32)
    torch.manual_seed(0)
    plain = build_model(spec)
    recomputed = copy.deepcopy(plain)
    cut = "blocks.1.0@bn1"
    recompute_blocks(recomputed, ["blocks.1.0"])
    plain_cut, recomputed_cut = model_pieces(spec, plain, [cut]), model_pieces(spec, recomputed, [cut])
    plain_pieces = keep_recomputation(plain_cut, plain)
    pieces = keep_recomputation(recomputed_cut, recomputed)
    parts = [i for i, p in enumerate(pieces) if p.block == "blocks.1.0"]
    assert len(parts) == 2 and isinstance(recomputed.get_submodule("blocks.1.0"), _Recomputed)
    assert [p.run is q.run for p, q in zip(plain_pieces, plain_cut)] == [True] * len(plain_cut)
    assert [p.run is not q.run for p, q in zip(pieces, recomputed_cut)] == [i in parts for i in range(len(pieces))]

    x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1))

    def run(model, chain):
        def forward():
            y = x
            for piece in chain:
                y = piece.run(y)
            return y

        model.train()
        model.zero_grad()
        y, saved = tensors_saved_for_backward(forward)
        y.square().sum().backward()
        return y, {n: p.grad.clone() for n, p in model.named_parameters()}, saved

    out_plain, grads_plain, saved_plain = run(plain, plain_pieces)
    out_kept, grads_kept, saved_kept = run(recomputed, pieces)
    assert torch.equal(out_plain, out_kept) and saved_kept < saved_plain
    for name, grad in grads_plain.items():
        assert torch.equal(grad, grads_kept[name]), name
