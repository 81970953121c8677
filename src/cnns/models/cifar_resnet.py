"""ResNets for CIFAR-sized inputs (He et al. 2015, section 4.2), written by hand.

No library has them: timm and torchvision only build the ImageNet ResNets (7x7 stem, max-pool, four stages,
projection shortcuts). These have a 3x3 16-channel stem, no max-pool, three stages of width 16/32/64 and
option-A shortcuts: where a unit changes shape, the identity is subsampled by the stride and zero-padded to
the new channel count, so the shortcuts have no parameters (ResNet-20: 269,722 parameters at 10 classes).
The 9n+2 depths use bottleneck units of width 16/32/64 expanded fourfold to 64/128/256 channels with 1x1
projection shortcuts where the shape changes, as the CIFAR bottleneck ResNets of Graphcore's application did.

Module names follow timm's ResNet (conv1/bn1/act1, layer1..layer3, global_pool, fc) so that the split
naming and any code that walks ResNets treats both alike.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

STAGE_WIDTHS = (16, 32, 64)


class ZeroPadShortcut(nn.Module):
    """Option-A shortcut: stride subsampling plus zero channels, no parameters."""

    def __init__(self, stride: int, extra_channels: int) -> None:
        super().__init__()
        self.stride = stride
        self.extra_channels = extra_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stride > 1:
            x = x[:, :, :: self.stride, :: self.stride]
        # F.pad pads the last dimensions first: (W, W, H, H, C_before, C_after).
        return F.pad(x, (0, 0, 0, 0, 0, self.extra_channels))


def option_a_shortcut(in_channels: int, out_channels: int, stride: int) -> nn.Module:
    if stride == 1 and in_channels == out_channels:
        return nn.Identity()
    return ZeroPadShortcut(stride, out_channels - in_channels)


def projection_shortcut(
    in_channels: int, out_channels: int, stride: int, norm_layer: Callable[[int], nn.Module]
) -> nn.Module:
    """Option-B shortcut: strided 1x1 convolution and norm, as Graphcore's application's bottleneck units have."""
    if stride == 1 and in_channels == out_channels:
        return nn.Identity()
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
        norm_layer(out_channels),
    )


def conv3x3(in_channels: int, out_channels: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)


def conv1x1(in_channels: int, out_channels: int) -> nn.Conv2d:
    return nn.Conv2d(in_channels, out_channels, 1, bias=False)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions; ReLU after the addition (He et al. 2015, figure 2)."""

    expansion = 1

    def __init__(self, in_channels: int, width: int, stride: int, norm_layer: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.conv1 = conv3x3(in_channels, width, stride)
        self.bn1 = norm_layer(width)
        self.act1 = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(width, width)
        self.bn2 = norm_layer(width)
        self.shortcut = option_a_shortcut(in_channels, width, stride)
        self.act2 = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.act1(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.act2(out + self.shortcut(x))


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (strided), 1x1 expand by 4 (He et al. 2015, figure 5, right); projection shortcut."""

    expansion = 4

    def __init__(self, in_channels: int, width: int, stride: int, norm_layer: Callable[[int], nn.Module]) -> None:
        super().__init__()
        out_channels = width * self.expansion
        self.conv1 = conv1x1(in_channels, width)
        self.bn1 = norm_layer(width)
        self.act1 = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(width, width, stride)
        self.bn2 = norm_layer(width)
        self.act2 = nn.ReLU(inplace=True)
        self.conv3 = conv1x1(width, out_channels)
        self.bn3 = norm_layer(out_channels)
        self.shortcut = projection_shortcut(in_channels, out_channels, stride, norm_layer)
        if isinstance(self.shortcut, nn.Identity):
            # As in Graphcore's application, identity units start as identities: the residual branch's last
            # scale at zero.
            nn.init.zeros_(self.bn3.weight)
        self.act3 = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.act1(self.bn1(self.conv1(x)))
        out = self.act2(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.act3(out + self.shortcut(x))


def units_per_stage(depth: int, block: type[nn.Module]) -> int:
    """n in depth = 6n+2 (basic blocks: 2 layers per unit) or 9n+2 (bottlenecks: 3 layers per unit).

    The block type is an explicit choice, not inferred from the depth: 20, 38, 56 and 110 fit both forms.
    """
    layers_per_unit = 3 if block is Bottleneck else 2
    units, remainder = divmod(depth - 2, 3 * layers_per_unit)
    if remainder or units < 1:
        raise ValueError(f"CIFAR ResNet depth {depth} is not {3 * layers_per_unit}n+2")
    return units


class CifarResNet(nn.Module):
    def __init__(
        self,
        depth: int,
        num_classes: int,
        bottleneck: bool = False,
        norm_layer: Callable[[int], nn.Module] = nn.BatchNorm2d,
    ) -> None:
        super().__init__()
        block = Bottleneck if bottleneck else BasicBlock
        units = units_per_stage(depth, block)
        self.conv1 = conv3x3(3, STAGE_WIDTHS[0])
        self.bn1 = norm_layer(STAGE_WIDTHS[0])
        self.act1 = nn.ReLU(inplace=True)
        in_channels = STAGE_WIDTHS[0]
        for stage, width in enumerate(STAGE_WIDTHS, start=1):
            stage_units = []
            for unit in range(units):
                stride = 2 if stage > 1 and unit == 0 else 1
                stage_units.append(block(in_channels, width, stride, norm_layer))
                in_channels = width * block.expansion
            self.add_module(f"layer{stage}", nn.Sequential(*stage_units))
        self.global_pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_channels, num_classes)
        self._init_weights()

    def _init_weights(self) -> None:
        # He et al. initialise convolutions with their "MSRA" scheme; the classifier keeps PyTorch's
        # default and the norms theirs (scale 1, shift 0; bottleneck identity units zero their last scale).
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act1(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.forward_head(x)

    def forward_head(self, x: torch.Tensor) -> torch.Tensor:
        """Pooling and classifier (timm's name, so pipeline stages cut every model the same way)."""
        return self.fc(torch.flatten(self.global_pool(x), 1))
