"""ResNet and ResNeXt from timm: the standard ImageNet definitions, and ResNeXt-29 for CIFAR."""

from __future__ import annotations

import timm
import torch
from timm.models.resnet import BasicBlock, Bottleneck, ResNet
from torch import nn

from .norms import norm_layer

# ResNeXt-29 (Xie et al. 2017, section 5.3): three stages of three bottleneck units, output widths 256/512/1024
# (the --widenet layout of Graphcore's application); other 9n+2 depths have n units per stage.
CIFAR_RESNEXT_PLANES = (64, 128, 256)  # timm's Bottleneck expands each by 4
CIFAR_STEM_WIDTH = 64  # Xie et al.'s stem; also the width timm's single-conv stem hands to layer1


# The shallow ImageNet depths of Graphcore's application, which timm has no named model for: units per
# stage of basic (2 convolutions) or bottleneck (3) blocks, depth = convolutions per unit x units + stem + classifier.
# Every stage's first unit has a projection shortcut, as in timm's ResNet (ResNeXt-14: 9,411,880
# parameters: Graphcore's application counted a 4th stem input channel).
GRAPHCORE_ONLY_DEPTHS = {"10": (BasicBlock, (1, 1, 1, 1)), "14": (Bottleneck, (1, 1, 1, 1)),
                         "26": (Bottleneck, (2, 2, 2, 2))}


def imagenet_resnet(spec: ModelSpec) -> ResNet:
    """timm's resnet{18,34,50,101,152}: the torchvision layout, so standard weights load; ResNet-10/14/26
    (Graphcore's application's own depths) from timm's ResNet with its unit counts."""
    if spec.size in GRAPHCORE_ONLY_DEPTHS:
        block, layers = GRAPHCORE_ONLY_DEPTHS[spec.size]
        return ResNet(block=block, layers=layers, num_classes=spec.num_classes,
                      norm_layer=norm_layer(spec.norm, spec.groups))
    return timm.create_model(
        f"resnet{spec.size}",
        pretrained=False,
        num_classes=spec.num_classes,
        norm_layer=norm_layer(spec.norm, spec.groups),
    )


def imagenet_resnext(spec: ModelSpec) -> ResNet:
    """timm's resnext{50,101}_32x4d (and Graphcore's application's 14, 26 and 152 with timm's ResNet and the same
    bottleneck units: 152 has 3/8/36/3 of them) with the spec's cardinality and group width (32, 4)."""
    if spec.size in ("14", "26", "152"):
        layers = {"14": (1, 1, 1, 1), "26": (2, 2, 2, 2), "152": (3, 8, 36, 3)}[spec.size]
        return ResNet(block=Bottleneck, layers=layers, num_classes=spec.num_classes,
                      cardinality=spec.convolution_groups, base_width=spec.group_width,
                      norm_layer=norm_layer(spec.norm, spec.groups))
    return timm.create_model(
        f"resnext{spec.size}_32x4d",
        pretrained=False,
        num_classes=spec.num_classes,
        cardinality=spec.convolution_groups,
        base_width=spec.group_width,
        norm_layer=norm_layer(spec.norm, spec.groups),
    )


class CifarResNeXt(ResNet):
    """timm's ResNet with three stages: timm's forward_features calls a fourth (layer4) that this one lacks."""

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.act1(self.bn1(self.conv1(x))))
        return self.layer3(self.layer2(self.layer1(x)))


def cifar_resnext(spec: ModelSpec) -> CifarResNeXt:
    """ResNeXt-29 (or another 9n+2 depth) for 32x32 inputs: timm's ResNet with three stages and a CIFAR stem.

    timm's grouped Bottleneck already matches Xie et al. (projection shortcuts, stride in the grouped 3x3;
    width per unit = planes * group_width / 64 * cardinality, so 8x64d gives the paper's 512/1024/2048).
    Only the stem differs from ImageNet: one 3x3 stride-1 convolution and no max-pool, so timm's 7x7
    stride-2 stem and pool are replaced after construction; the module names stay timm's.
    """
    units_per_stage = (int(spec.size) - 2) // 9
    model = CifarResNeXt(
        block=Bottleneck,
        layers=(units_per_stage,) * len(CIFAR_RESNEXT_PLANES),
        channels=CIFAR_RESNEXT_PLANES,
        num_classes=spec.num_classes,
        cardinality=spec.convolution_groups,
        base_width=spec.group_width,
        norm_layer=norm_layer(spec.norm, spec.groups),
    )
    model.conv1 = nn.Conv2d(3, CIFAR_STEM_WIDTH, kernel_size=3, stride=1, padding=1, bias=False)
    nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")  # as timm's init_weights
    model.maxpool = nn.Identity()
    return model
