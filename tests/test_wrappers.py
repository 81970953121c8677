"""Run-time wrappers change how a model runs, never what it computes: recomputation here."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from cnns.engine.wrappers import recompute_blocks
from cnns.models import ModelSpec, build_model, recomputation_blocks

ROOT = Path(__file__).resolve().parents[1]


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


def test_enable_recomputation_trains_and_evaluation_runs_without_it(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "--dataset", "cifar-10", "--synthetic-data", "--model-size", "8",
         "--micro-batch-size", "8", "--iterations", "3", "--log-freq", "1", "--enable-recomputation",
         "--ckpts-per-epoch", "0", "--log-dir", str(tmp_path / "logs")],
        capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "not supported yet" not in out.stdout + out.stderr
    assert out.stdout.count("throughput:") >= 3
