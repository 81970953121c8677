"""Normalisation layer factories for --batch-norm / --group-norm --groups G.

Both keep the parameter count: GroupNorm, like BatchNorm, has one scale and one shift per channel.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Callable

from torch import nn

if TYPE_CHECKING:
    from timm.layers import GroupNormAct


def fitted_groups(groups: int, channels: int) -> int:
    """The number of GroupNorm groups to use for ``channels`` when ``groups`` was asked for.

    GroupNorm needs the groups to divide the channels. Where ``groups`` does not (EfficientNet-B0 has
    24- and 40-channel layers, CIFAR ResNets 16-channel ones, and the default is 32 groups) take the
    largest divisor of ``channels`` below it, so one --groups value serves every layer of every model.
    """
    groups = min(groups, channels)
    while channels % groups:
        groups -= 1
    return groups


def group_norm(num_channels: int, *, groups: int, **factory_kwargs) -> nn.GroupNorm:
    """A GroupNorm taking the channel count first, the way model code calls ``norm_layer(channels)``."""
    return nn.GroupNorm(fitted_groups(groups, num_channels), num_channels, **factory_kwargs)


def norm_layer(norm: str, groups: int) -> Callable[..., nn.Module]:
    """``norm_layer(channels)`` factory for ResNets (timm's ``norm_layer`` argument and ours)."""
    if norm == "group":
        return partial(group_norm, groups=groups)
    return nn.BatchNorm2d


def _group_norm_act(num_channels: int, *, groups: int, **kwargs) -> GroupNormAct:
    from timm.layers import GroupNormAct  # only EfficientNet's blocks use it: see registry.py on timm's imports

    return GroupNormAct(num_channels, num_groups=fitted_groups(groups, num_channels), **kwargs)


def norm_act_layer(norm: str, groups: int, act_layer: type[nn.Module]) -> Callable[..., nn.Module] | type:
    """``norm_layer`` argument for timm's EfficientNet.

    timm fuses norm and activation (``get_norm_act_layer``). A plain function is taken as a ready norm+act
    factory, so timm does not pass its activation on: bind the model's activation here.
    """
    if norm == "group":
        return partial(_group_norm_act, groups=groups, act_layer=act_layer)
    return nn.BatchNorm2d
