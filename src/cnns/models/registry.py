"""ModelSpec -> nn.Module.

The timm-built families (ImageNet ResNets, ResNeXts, EfficientNets) are imported when one is built: timm brings
torchvision and torch._dynamo, seconds of start-up that the launcher of a CIFAR ResNet run, which builds the model
only to check its --pipeline-splits, does not need (its workers import them anyway, to train).
"""

from __future__ import annotations

from torch import nn

from .cifar_resnet import CifarResNet
from .norms import norm_layer
from .model_spec import CIFAR_RESNET_BOTTLENECK_SIZES, ModelSpec


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
    if spec.arch == "resnet" and spec.cifar:
        return cifar_resnet(spec)
    if spec.arch == "efficientnet":
        from .efficientnet import efficientnet

        return efficientnet(spec)
    from .resnet import cifar_resnext, imagenet_resnet, imagenet_resnext

    if spec.arch == "resnet":
        return imagenet_resnet(spec)
    return cifar_resnext(spec) if spec.cifar else imagenet_resnext(spec)


def count_parameters(model: nn.Module) -> int:
    """Trainable parameters, as the 'Total Parameters:' line of Graphcore's application counts them."""
    return sum(parameter.numel() for parameter in model.parameters() if parameter.requires_grad)
