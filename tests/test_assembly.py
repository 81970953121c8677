"""The order in which a built model is made the run's (`cnns.engine.assembly.assemble`), stated for a few
representative configurations by inspecting the assembled module: which wrapper sits where, and that the
state-dict keys stay the plain model's (checkpoints load before and after). One process: where the step needs
process groups (DDP, the pipeline cut, a --BN-span), a fake world and a recording stand-in serve."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

import cnns.engine.assembly as assembly
import cnns.engine.kernel_choice as kernel_choice
from cnns.cli.parsing import resolve_command_line
from cnns.engine.assembly import unwrap
from cnns.engine.fusion import _FusedNormAct, _FusedUnit
from cnns.engine.recomputation import _Recomputed
from cnns.kernels import norm_act as kernels
from cnns.models import build_model
from cnns.parallel.batchnorm import BatchNormSpan
from cnns.parallel.world import World
from cnns.precision import PrecisionPolicy

CPU = torch.device("cpu")
needs_fused_passes = pytest.mark.skipif(not kernels.available(), reason="the fused kernels are not built")


def configured(*options: str):
    """A RunConfig as train.py resolves it, on generated CIFAR-sized data, with its precision policy."""
    cfg = resolve_command_line("train", ["--synthetic-data", "--dataset", "cifar-10", "--model-size", "8",
                                         "--micro-batch-size", "4", "--iterations", "1", *options]).config
    return cfg, cfg.precision.policy(CPU)


def recorded_steps(monkeypatch) -> list[str]:
    """The assembly's steps in the order they run, each still doing its work."""
    steps: list[str] = []
    for name in ("fuse_passes", "choose_kernels", "recompute", "cross_replica_batch_norm", "data_parallel",
                 "maybe_compile"):
        real = getattr(assembly, name)
        monkeypatch.setattr(assembly, name, lambda *a, _real=real, _name=name, **k: steps.append(_name) or
                            _real(*a, **k))
    real_apply = PrecisionPolicy.apply_to_model
    monkeypatch.setattr(PrecisionPolicy, "apply_to_model",
                        lambda self, model: steps.append("precision") or real_apply(self, model))
    return steps


def test_plain_cpu_float32_is_the_model_itself_in_channels_last(monkeypatch):
    steps = recorded_steps(monkeypatch)
    cfg, policy = configured("--fused-norm", "off", "--precision", "32.32")
    model = build_model(cfg.model)
    keys = list(model.state_dict())
    assembled = assembly.assemble(model, cfg, World(), CPU, policy)
    assert steps == ["precision", "fuse_passes", "choose_kernels", "cross_replica_batch_norm", "data_parallel",
                     "maybe_compile"]
    assert assembled.model is assembled.plain is model and assembled.replicated is None and assembled.stage is None
    assert list(model.state_dict()) == keys
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert model.conv1.weight.is_contiguous(memory_format=torch.channels_last)
    # No module specialised but the convolutions, which compute the backward of an output with few positions as
    # matrix products (cnns.engine.kernel_choice; none of this CIFAR ResNet's outputs has so few).
    assert all(type(m).__module__.startswith(("torch.", "cnns.models", "timm.")) for m in model.modules()
               if not isinstance(m, kernel_choice._FewPositionConv))
    assert all(isinstance(m, kernel_choice._FewPositionConv) for m in model.modules() if isinstance(m, nn.Conv2d))
    pool = next(m for m in model.modules() if isinstance(m, nn.AdaptiveAvgPool2d))
    assert pool._forward_pre_hooks  # the channels_last gradient hook


@needs_fused_passes
def test_16_16_fuses_then_recomputes_the_fused_units(monkeypatch):
    steps = recorded_steps(monkeypatch)
    cfg, policy = configured("--fused-norm", "on", "--precision", "16.16", "--half-dtype", "bfloat16", "--enable-recomputation")
    model = build_model(cfg.model)
    keys = list(model.state_dict())
    assembled = assembly.assemble(model, cfg, World(), CPU, policy)
    assert steps == ["precision", "fuse_passes", "choose_kernels", "recompute", "cross_replica_batch_norm",
                     "data_parallel", "maybe_compile"]
    assert assembled.model is model and list(model.state_dict()) == keys
    assert model.conv1.weight.dtype == torch.bfloat16
    units = [m for m in model.modules() if isinstance(m, _FusedUnit)]
    assert len(units) == 3  # ResNet-8: three basic units
    for unit in units:
        # Recomputation wraps the fused forward: it comes first in the method resolution order.
        mro = type(unit).__mro__
        assert mro.index(_Recomputed) < mro.index(_FusedUnit)
        assert isinstance(unit.act1, nn.Identity) and isinstance(unit.bn1, _FusedNormAct)
    assert isinstance(model.bn1, _FusedNormAct) and isinstance(model.act1, nn.Identity)  # the stem
    # A training step runs through the assembled module.
    x = torch.randn(2, 3, 32, 32, dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
    model.train()
    model(x).float().sum().backward()
    assert model.conv1.weight.grad is not None


@needs_fused_passes
def test_replicas_with_a_bn_span_fuse_with_the_spans_statistics_then_replicate(monkeypatch):
    steps = recorded_steps(monkeypatch)
    monkeypatch.setattr("cnns.parallel.batchnorm.dist.get_world_size", lambda group: 2)
    replicated = []
    monkeypatch.setattr(assembly, "data_parallel", lambda model, world, device: replicated.append(model) or
                        steps.append("data_parallel") or nn.Sequential(model))
    span_group = object()
    world = SimpleNamespace(bn_group=span_group, shards=1, replicas=2)
    cfg, policy = configured("--fused-norm", "on", "--precision", "32.32", "--replicas", "2", "--BN-span", "2")
    model = build_model(cfg.model)
    assembled = assembly.assemble(model, cfg, world, CPU, policy)
    assert steps == ["precision", "fuse_passes", "choose_kernels", "cross_replica_batch_norm", "data_parallel",
                     "maybe_compile"]
    assert replicated == [model] and assembled.plain is model and unwrap(assembled.model.get_submodule("0")) is model
    fused = [m for m in model.modules() if isinstance(m, _FusedNormAct)]
    assert fused and all(isinstance(m._cnns_span, BatchNormSpan) and m._cnns_span.group is span_group
                         for m in fused)
    # Every batch norm takes the span's statistics: the fused ones in their passes, the rest converted.
    norms = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert norms and all(getattr(m, "_cnns_bn_span", False) for m in norms)


def test_pipeline_stages_cut_the_finished_single_device_model(monkeypatch):
    steps = recorded_steps(monkeypatch)
    cut = []

    def build_stage(cfg, model, world, device, policy):
        steps.append("build_stage")
        cut.append(model)
        return SimpleNamespace(module=SimpleNamespace(model=model))

    monkeypatch.setattr(assembly, "build_stage", build_stage)
    world = SimpleNamespace(bn_group=None, shards=2, replicas=1, broadcast_state=lambda module, among_replicas: None)
    cfg, policy = configured("--fused-norm", "off", "--precision", "32.32", "--pipeline", "--shards", "2", "--pipeline-splits",
                             "stage2/unit1", "--enable-recomputation")
    model = build_model(cfg.model)
    assembled = assembly.assemble(model, cfg, world, CPU, policy)
    # Recomputed per block before the cut; a stage is neither replicated by DDP nor compiled.
    assert steps == ["precision", "fuse_passes", "choose_kernels", "recompute", "cross_replica_batch_norm",
                     "build_stage"]
    assert cut == [model] and assembled.replicated is None
    assert any(isinstance(m, _Recomputed) for m in model.modules())


def test_compile_is_the_outermost_wrapper(monkeypatch):
    cfg, policy = configured("--fused-norm", "off", "--precision", "32.32", "--compile")
    model = build_model(cfg.model)
    keys = list(model.state_dict())
    assembled = assembly.assemble(model, cfg, World(), CPU, policy)
    assert assembled.model is not model and assembled.model._orig_mod is model  # compiled at its first call
    assert unwrap(assembled.model) is model and list(unwrap(assembled.model).state_dict()) == keys
