"""ModelSpec -> nn.Module: the family's entry builds it (`cnns.models.family`).

The timm-built families (ImageNet ResNets, ResNeXts, EfficientNets, timm's own models) import timm when one is
built: timm brings torchvision and torch._dynamo, seconds of start-up that the launcher of a CIFAR ResNet run,
which builds the model only to check its --pipeline-splits, does not need (its workers import them anyway, to
train).
"""

from __future__ import annotations

from torch import nn

from .model_spec import ModelSpec


def build_model(spec: ModelSpec) -> nn.Module:
    """A freshly initialised single-device model that maps images to logits (no softmax).

    ``ModelSpec`` has already checked the size against the family and the input size.
    """
    return spec.family.build(spec)


def count_parameters(model: nn.Module) -> int:
    """Trainable parameters, as the 'Total Parameters:' line of Graphcore's application counts them."""
    return sum(parameter.numel() for parameter in model.parameters() if parameter.requires_grad)
