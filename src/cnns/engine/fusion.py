"""Training on a CPU with the fused normalisation + activation (+ residual) passes of `cnns.kernels`.

Applied to a built model by `cnns.engine.assembly.assemble` (`fuse_passes`) for the norms `fused_norms` names:
each fused module becomes an instance of a fused subclass of its own class (`cnns.engine.specialise.specialise`),
and an activation the norm now applies is swapped, by name, for ``nn.Identity``; nothing else changes, so
parameters, buffers and state-dict keys stay the plain model's and checkpoints written before or after load
alike. Three patterns are fused:

- a norm followed by its activation (``bn1``/``act1`` of ResNet units and stems, timm's
  ``BatchNormAct2d``/``GroupNormAct`` of EfficientNet): the norm computes ``act(norm(x))``, the
  activation module becomes the identity;
- a residual unit's last norm, the addition of the shortcut and the final ReLU (timm's and the CIFAR
  ResNets' basic and bottleneck units): one pass instead of three;
- squeeze-excitation (timm's ``SqueezeExcite`` of EfficientNet): the channel means, the gate's scaling and
  their backward in the same passes (`cnns.kernels.excite`), wherever the passes run by default;
- nothing else: pooling and the head keep torch's kernels.

In evaluation, or for a tensor the passes do not take (CUDA, float16, not 4-d), the fused forwards
compute the same thing with torch's functions, so one fused model serves training and validation.
Only exact classes are fused (an unknown block keeps torch's modules). With a --BN-span (``span``) the
fused batch norms take their statistics over the span's replicas (`cnns.kernels.norm_act`), and where the
passes do not take a tensor, the span's torch version (`cnns.parallel.batchnorm`) runs.
"""

from __future__ import annotations

import functools
import sys
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from cnns.engine.specialise import specialise
from cnns.kernels import excite
from cnns.kernels import norm_act as kernels
from cnns.models import cifar_resnet
from cnns.parallel.batchnorm import BatchNormSpan

_ACTIVATIONS = {nn.ReLU: "relu", nn.SiLU: "silu", nn.Identity: "none"}
_PLAIN_ACT = {"relu": F.relu, "silu": F.silu, "none": lambda x: x}


# What a run fuses: norm classes (each fused with whatever activation follows it).
Norms = tuple


def _timm_classes() -> SimpleNamespace | None:
    """timm's classes that are fused, or None where timm is not imported: a model built without timm (the CIFAR
    ResNets) holds none of them. Not imported for such a model: importing timm adds seconds to every process's
    start-up (its layers import torchvision's models, whose detection ops import torch._dynamo)."""
    return _imported_timm_classes() if "timm" in sys.modules else None


@functools.cache
def _imported_timm_classes() -> SimpleNamespace:
    from timm.layers import BatchNormAct2d, GroupNormAct
    from timm.models import resnet as timm_resnet
    from timm.models._efficientnet_blocks import SqueezeExcite

    return SimpleNamespace(basic_block=timm_resnet.BasicBlock, bottleneck=timm_resnet.Bottleneck,
                           norm_acts=(BatchNormAct2d, GroupNormAct), squeeze_excite=SqueezeExcite)


def fused_norms(device: torch.device, asked: str) -> Norms:
    """The norms whose training passes a CPU run fuses, as --fused-norm (`asked`) says: "on" all, "off" none.

    "auto": where the AVX-512 (bfloat16) build runs, batch norm and group norm, where they were measured
    faster than ATen's (docs/performance.md). Not measured on an AVX2-only CPU (where 16.x runs in float32), so
    nothing is fused there unless asked for.
    """
    if device.type != "cpu" or not kernels.available() or asked == "off":
        return ()
    if asked == "on" or kernels.wide_build():
        return (nn.BatchNorm2d, nn.GroupNorm)
    return ()


def _activation(module: nn.Module) -> str | None:
    return _ACTIVATIONS.get(type(module))


def norm_act(norm: nn.Module, x: torch.Tensor, act: str, residual: torch.Tensor | None = None,
             span: BatchNormSpan | None = None) -> torch.Tensor:
    """``act(norm(x) [+ residual])`` with `norm` a BatchNorm2d, GroupNorm or timm's norm+act (its own
    activation not applied here): fused in training where the passes take the tensor, torch otherwise.
    ``span``: a batch norm's training statistics are the --BN-span's."""
    batch_norm = isinstance(norm, nn.BatchNorm2d)
    spanned = span is not None and batch_norm and norm.training
    fused = norm.training and kernels.supports(x) and (residual is None or residual.shape == x.shape)
    if fused and batch_norm:
        tracking = norm.track_running_stats
        momentum = norm.momentum
        return kernels.batch_norm_act(x, norm.weight, norm.bias, norm.running_mean if tracking else None,
                                      norm.running_var if tracking else None,
                                      norm.num_batches_tracked if tracking else None, momentum, norm.eps, act,
                                      residual, span.sum if spanned else None)
    if fused:
        return kernels.group_norm_act(x, norm.num_groups, norm.weight, norm.bias, norm.eps, act, residual)
    if spanned:
        y = span.normalise(norm, x)
    elif batch_norm:
        y = nn.BatchNorm2d.forward(norm, x)
    else:
        y = F.group_norm(x, norm.num_groups, norm.weight, norm.bias, norm.eps)
    if residual is not None:
        y = y + residual
    return _PLAIN_ACT[act](y)


class _FusedNormAct:
    """A norm (or timm's norm+act) that computes ``act(norm(x))`` in the fused passes (`norm_act`)."""

    _cnns_activation: str
    _cnns_span: BatchNormSpan | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return norm_act(self, x, self._cnns_activation, span=self._cnns_span)


def _fused_norm(norm: nn.Module, act: str, span: BatchNormSpan | None) -> None:
    norm._cnns_activation, norm._cnns_span = act, span
    specialise(norm, _FusedNormAct)
    _claim(span, norm)


def _fuse_pair(owner: nn.Module, norm_name: str, act_name: str, norms: Norms, span: BatchNormSpan | None) -> bool:
    """owner's norm then activation -> the norm computes both; the activation is swapped for the identity."""
    norm, act_module = getattr(owner, norm_name), getattr(owner, act_name)
    act = _activation(act_module)
    if act is None or type(norm) not in norms:
        return False
    _fused_norm(norm, act, span)
    if act != "none":
        setattr(owner, act_name, nn.Identity())
    return True


def _claim(span: BatchNormSpan | None, norm: nn.Module) -> None:
    if span is not None and isinstance(norm, nn.BatchNorm2d):
        span.claim(norm)  # its span statistics come from here, not from cross_replica_batch_norm's forward


def _fuse_norm_act_module(module: nn.Module, norms: Norms, span: BatchNormSpan | None) -> bool:
    """timm's BatchNormAct2d / GroupNormAct (EfficientNet) with a ReLU, SiLU or no activation, no dropout."""
    act = _activation(module.act)
    kind = nn.BatchNorm2d if isinstance(module, nn.BatchNorm2d) else nn.GroupNorm  # timm's are subclasses
    if act is None or kind not in norms or not isinstance(module.drop, nn.Identity):
        return False
    _fused_norm(module, act, span)
    return True


# Residual units, by kind: the attribute names of (norm, activation) pairs, and of the last norm and final ReLU
# that take the shortcut. Everything else in the unit must be absent for its forward to be replaced.
_BASIC_UNIT = ((("bn1", "act1"),), ("conv2", "bn2", "act2"))
_BOTTLENECK_UNIT = ((("bn1", "act1"), ("bn2", "act2")), ("conv3", "bn3", "act3"))


def _units() -> dict[type, tuple]:
    """The residual units fused, by class (the CIFAR ResNets', and timm's where it is imported): their names."""
    units = {cifar_resnet.BasicBlock: _BASIC_UNIT, cifar_resnet.Bottleneck: _BOTTLENECK_UNIT}
    timm = _timm_classes()
    if timm is not None:
        units.update({timm.basic_block: _BASIC_UNIT, timm.bottleneck: _BOTTLENECK_UNIT})
    return units


def _plain_timm_unit(unit: nn.Module) -> bool:
    """No drop-block, anti-aliasing, squeeze-excitation or drop-path: the forward is convolutions and norms."""
    extras = [getattr(unit, name, None) for name in ("drop_block", "aa")]
    return (all(e is None or isinstance(e, nn.Identity) for e in extras)
            and getattr(unit, "se", None) is None and getattr(unit, "drop_path", None) is None)


class _FusedUnit:
    """A residual unit whose norm+activation pairs are fused and whose last norm, shortcut addition and ReLU
    run as one pass; ``_cnns_unit`` holds the names (pairs, last, shortcut) of `_units`."""

    _cnns_unit: tuple
    _cnns_span: BatchNormSpan | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pairs, (conv_last, norm_last, _), shortcut_name = self._cnns_unit
        shortcut_module = getattr(self, shortcut_name)
        shortcut = x if shortcut_module is None else shortcut_module(x)
        out = x
        for norm, act in pairs:
            out = getattr(self, act)(getattr(self, norm)(getattr(self, norm.replace("bn", "conv"))(out)))
        return norm_act(getattr(self, norm_last), getattr(self, conv_last)(out), "relu", residual=shortcut,
                        span=self._cnns_span)


def _fuse_unit(unit: nn.Module, names: tuple, norms: Norms, span: BatchNormSpan | None) -> bool:
    pairs, last = names
    timm_unit = type(unit) not in (cifar_resnet.BasicBlock, cifar_resnet.Bottleneck)
    if timm_unit and not _plain_timm_unit(unit):
        return False
    norm_last, act_last = getattr(unit, last[1]), getattr(unit, last[2])
    if type(norm_last) not in norms or type(act_last) is not nn.ReLU:
        return False
    if not all(_fuse_pair(unit, norm, act, norms, span) for norm, act in pairs):
        return False
    unit._cnns_unit = (pairs, last, "downsample" if timm_unit else "shortcut")
    unit._cnns_span = span
    specialise(unit, _FusedUnit)
    _claim(span, norm_last)
    return True


def fuse_norm_activations(model: nn.Module, norms: Norms = (nn.BatchNorm2d, nn.GroupNorm),
                          span: BatchNormSpan | None = None) -> int:
    """Give the model's norm+activation(+residual) patterns whose norm class ``norms`` names the fused
    passes; returns how many were fused. With ``span`` (--BN-span), batch norms take the span's statistics,
    and `cnns.parallel.batchnorm.cross_replica_batch_norm` converts the batch norms left unfused."""
    fused = 0
    units, timm = _units(), _timm_classes()
    for module in list(model.modules()):
        if type(module) in units:
            fused += _fuse_unit(module, units[type(module)], norms, span)
        elif timm is not None and type(module) in timm.norm_acts:
            fused += _fuse_norm_act_module(module, norms, span)
    # The ResNets' stem: conv1, bn1, act1 on the model itself (a unit's own pairs are fused above).
    for owner in model.modules():
        if not isinstance(owner, _FusedUnit) and type(owner) not in units and hasattr(owner, "bn1") \
                and hasattr(owner, "act1"):
            fused += _fuse_pair(owner, "bn1", "act1", norms, span)
    return fused


def fuse_passes(model: nn.Module, device: torch.device, span: BatchNormSpan | None, asked: str) -> int:
    """The fused passes a run on `device` uses (`fused_norms`, as --fused-norm `asked`): norm + activation
    (+ residual), with a --BN-span's statistics where `span` is given, and squeeze-excitation. Returns how many
    were fused."""
    norms = fused_norms(device, asked)
    if not norms:
        return 0
    return fuse_norm_activations(model, norms, span) + fuse_squeeze_excitation(model)


def fuses_squeeze_excitation(device: torch.device, asked: str) -> bool:
    """Whether a CPU run fuses squeeze-excitation: wherever it fuses any norm (--fused-norm auto: the AVX-512
    build; on everything, off nothing)."""
    return bool(fused_norms(device, asked))


def _gate_network(module: nn.Module):
    def gate(squeezed: torch.Tensor) -> torch.Tensor:
        return module.gate(module.conv_expand(module.act1(module.conv_reduce(squeezed))))

    return gate


class _FusedSqueezeExcite:
    """timm's SqueezeExcite with the fused passes in training (`cnns.kernels.excite`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and torch.is_grad_enabled() and kernels.supports(x):
            return excite.squeeze_excite(x, _gate_network(self), list(self.parameters()))
        return super().forward(x)


def fuse_squeeze_excitation(model: nn.Module) -> int:
    """Give timm's squeeze-excitation blocks the fused passes in training; returns how many."""
    timm = _timm_classes()
    if timm is None:
        return 0
    fused = 0
    for module in model.modules():
        if type(module) is timm.squeeze_excite:
            specialise(module, _FusedSqueezeExcite)
            fused += 1
    return fused
