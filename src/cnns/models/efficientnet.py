"""EfficientNet B0-B7 from timm, with the group size (--group-dim) and expansion ratio (--expand-ratio) of
Graphcore's application.

timm's ``efficientnet_b*`` factories fix the expansion ratio inside their block definitions, so the model is
assembled here from timm's own parts (``decode_arch_def``, ``round_channels``, ``EfficientNet``) with the
ratio substituted and each block's group size set by the rule of Graphcore's application (see
``group_size_for``). With group_dim=1 and expand_ratio=6 the result is timm's efficientnet_b* exactly: the
same modules, names and parameter counts (B0: 5,288,548 at 1000 classes), so standard weights load.
"""

from __future__ import annotations

from functools import partial

from timm.layers import get_act_layer, make_divisible
from timm.models._efficientnet_builder import decode_arch_def, round_channels
from timm.models.efficientnet import EfficientNet

from .norms import norm_act_layer
from .model_error import ModelError

# (width multiplier, depth multiplier) of Tan & Le 2019 ("efficientnet_params" of the reference code).
# The resolution and dropout of that table are the data's and the trainer's business, not the model's.
SCALING = {
    "B0": (1.0, 1.0),
    "B1": (1.0, 1.1),
    "B2": (1.1, 1.2),
    "B3": (1.2, 1.4),
    "B4": (1.4, 1.8),
    "B5": (1.6, 2.2),
    "B6": (1.8, 2.6),
    "B7": (2.0, 3.1),
    # The unofficial size of Graphcore's application for 32x32 inputs (its Models/efficientnet.py): half of
    # B0's width, B0's depth, and stride 1 in the stem and in stage 2, so 32x32 images leave the last stage
    # as 4x4.
    "cifar": (0.5, 1.0),
}

STEM_CHANNELS = 32
HEAD_CHANNELS = 1280
CHANNEL_DIVISOR = 8


def arch_def(expand_ratio: int, stage2_stride: int = 2) -> list[list[str]]:
    """timm's EfficientNet-B0 block strings (``_gen_efficientnet``) with the inverted-residual ``e6`` replaced.

    Stage 1 is the depthwise-separable block, which has no expansion and keeps its ``e1``.
    """
    e = expand_ratio
    return [
        ["ds_r1_k3_s1_e1_c16_se0.25"],
        [f"ir_r2_k3_s{stage2_stride}_e{e}_c24_se0.25"],
        [f"ir_r2_k5_s2_e{e}_c40_se0.25"],
        [f"ir_r3_k3_s2_e{e}_c80_se0.25"],
        [f"ir_r3_k5_s1_e{e}_c112_se0.25"],
        [f"ir_r4_k5_s2_e{e}_c192_se0.25"],
        [f"ir_r1_k3_s1_e{e}_c320_se0.25"],
    ]


def group_size_for(channels: int, group_dim: int) -> int:
    """Channels per group of a grouped convolution over ``channels``, as Graphcore's application computes it.

    Graphcore's application splits the channels into max(channels // group_dim, 1) groups, so a layer
    narrower than twice the group dim becomes one group (EfficientNet-B4's second 24-channel block with
    group dim 16).
    """
    groups = max(channels // group_dim, 1)
    if channels % groups:
        raise ModelError(
            f"group dim {group_dim} cannot split a {channels}-channel convolution into equal groups "
            f"({channels} // {group_dim} = {groups} groups)"
        )
    return channels // groups


def set_group_sizes(block_args: list[list[dict]], stem_channels: int, round_chs, group_dim: int) -> None:
    """Give every block the group size of its (otherwise depthwise) convolution.

    timm takes one group size per block, so follow its builder's channel bookkeeping: each block's grouped
    convolution runs over its input channels (depthwise-separable blocks) or its expanded channels.
    """
    in_channels = stem_channels
    for stage in block_args:
        for block in stage:
            channels = in_channels if block["block_type"] == "ds" else make_divisible(in_channels * block["exp_ratio"])
            block["group_size"] = group_size_for(channels, group_dim)
            in_channels = round_chs(block["out_chs"])


def efficientnet(spec: ModelSpec) -> EfficientNet:
    width, depth = SCALING[spec.size]
    cifar = spec.size == "cifar"
    round_chs = partial(round_channels, multiplier=width, divisor=CHANNEL_DIVISOR)
    act_layer = get_act_layer("swish")
    block_args = decode_arch_def(arch_def(spec.expand_ratio, stage2_stride=1 if cifar else 2), depth)
    try:
        set_group_sizes(block_args, round_chs(STEM_CHANNELS), round_chs, spec.group_dim)
    except ModelError as error:
        raise ModelError(f"{spec.display_name} with expand ratio {spec.expand_ratio}: {error}") from None
    model = EfficientNet(
        block_args=block_args,
        num_classes=spec.num_classes,
        num_features=round_chs(HEAD_CHANNELS),
        stem_size=STEM_CHANNELS,
        round_chs_fn=round_chs,
        act_layer=act_layer,
        norm_layer=norm_act_layer(spec.norm, spec.groups, act_layer),
    )
    if cifar:
        make_stem_stride_one(model)
    return model


def make_stem_stride_one(model: EfficientNet) -> None:
    """timm hard-codes stride 2 for the stem convolution; the 'cifar' size needs stride 1.

    A 3x3 convolution pads by 1 at stride 1 and 2 alike, so changing the stride alone gives the stride-1
    convolution, with the same weights and state-dict keys.
    """
    model.conv_stem.stride = (1, 1)
