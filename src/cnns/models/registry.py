"""ModelSpec -> nn.Module."""

from __future__ import annotations

from torch import nn

from .cifar_resnet import CifarResNet
from .efficientnet import efficientnet
from .norms import norm_layer
from .resnet import cifar_resnext, imagenet_resnet, imagenet_resnext
from .spec import CIFAR_RESNET_BOTTLENECK_SIZES, ModelSpec


def cifar_resnet(spec: ModelSpec) -> CifarResNet:
    return CifarResNet(
        depth=int(spec.size),
        num_classes=spec.num_classes,
        bottleneck=spec.size in CIFAR_RESNET_BOTTLENECK_SIZES,
        norm_layer=norm_layer(spec.norm, spec.groups),
    )


def build_model(spec: ModelSpec) -> nn.Module:
    """A freshly initialised single-device model that maps images to logits (no softmax).

    ``ModelSpec`` has already checked the size against the architecture and the input size.
    """
    if spec.arch == "resnet":
        return cifar_resnet(spec) if spec.cifar else imagenet_resnet(spec)
    if spec.arch == "resnext":
        return cifar_resnext(spec) if spec.cifar else imagenet_resnext(spec)
    return efficientnet(spec)


def count_parameters(model: nn.Module) -> int:
    """Trainable parameters, as the 'Total Parameters:' line of Graphcore's application counts them."""
    return sum(parameter.numel() for parameter in model.parameters() if parameter.requires_grad)
