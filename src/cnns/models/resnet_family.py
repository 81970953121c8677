"""The ResNet and ResNeXt families' entries (`cnns.models.family.ModelFamily`): the CIFAR ResNets written here
(`cifar_resnet`), the ImageNet ResNets and every ResNeXt from timm (`resnet`), cut between residual units."""

from __future__ import annotations

from typing import Any

from .family import FamilyDefault, ModelFamily, OptimiserDefaults
from .model_error import ModelError
from .split_points import resnet_cuts, resnet_pieces

# He et al. 2015: 6n+2 layers with basic blocks, 9n+2 with bottleneck blocks.
CIFAR_RESNET_BASIC_SIZES = ("8", "14", "20", "32", "44", "56", "110")
CIFAR_RESNET_BOTTLENECK_SIZES = ("11", "29", "38", "47", "65")
IMAGENET_RESNET_SIZES = ("10", "14", "18", "26", "34", "50", "101", "152")
# ResNeXt-29 is Xie et al.'s; Graphcore's application also built the other 9n+2 depths
# (its default was 11).
CIFAR_RESNEXT_SIZES = ("11", "29", "38", "47", "56", "65")
IMAGENET_RESNEXT_SIZES = ("14", "26", "50", "101", "152")

# timm's model names for the ImageNet models cnns builds from its definitions, by size.
TIMM_RESNETS = {"18", "34", "50", "101", "152"}
TIMM_RESNEXTS = {"50", "101"}

# Graphcore's application's learning-rate exponents and L2 decay of the ImageNet ResNets (ResNeXts too); timm's
# models take the same (`cnns.models.timm_family`).
RESNET_OPTIMISER_DEFAULTS = OptimiserDefaults("ImageNet ResNets", {
    "base_learning_rate_exponent": {"SGD": -8.0, "momentum": -11.0, "RMSprop": -8.0, "LARS": -8.0, "AdamW": -18.0,
                                    "LAMB": -18.0},
    "weight_decay": {"*": 1e-4},
    "lars_weight_decay": {"*": 1e-4},
})

_ON_CIFAR, _ON_IMAGENET = True, False  # FamilyDefault.cifar_sized
# Batch norm on CIFAR-sized data (the generic default is group norm), and the ImageNet step schedule.
_RESNET_RECIPE = {
    "norm": (FamilyDefault("batch", _ON_CIFAR),),
    "learning_rate_schedule": (FamilyDefault("0.3,0.6,0.8,0.9", _ON_IMAGENET),),
}


def timm_classifier_model(spec: ModelSpec, name: str) -> tuple[str, dict[str, Any]]:
    """(timm's `name`, the arguments that give the spec's normalisation) where timm builds the model by name."""
    if spec.cifar:
        raise ModelError(f"timm defines no model for {spec.display_name}: the CIFAR models are cnns' own "
                         "(export them as onnx or pt2)")
    if spec.norm != "group":
        return name, {}
    if spec.groups != 32:
        raise ModelError(f"timm builds {spec.display_name} with group norm of {spec.groups} groups from code only, "
                         "not from a model name: export a --batch-norm run, or as onnx or pt2")
    return name, {"norm_layer": "groupnorm"}  # timm's GroupNorm: 32 groups


def _no_timm_model(spec: ModelSpec) -> ModelError:
    return ModelError(f"timm defines no model for {spec.display_name} (only ResNet 18-152, ResNeXt 50/101 32x4d "
                      "and EfficientNet B0-B7 as the papers define them): export it as onnx or pt2")


def _resnet_timm_name(spec: ModelSpec) -> tuple[str, dict[str, Any]]:
    name, arguments = timm_classifier_model(spec, f"resnet{spec.size}")
    if spec.size not in TIMM_RESNETS:
        raise _no_timm_model(spec)
    return name, arguments


def _resnext_timm_name(spec: ModelSpec) -> tuple[str, dict[str, Any]]:
    name, arguments = timm_classifier_model(spec, f"resnext{spec.size}_32x4d")
    if not (spec.size in TIMM_RESNEXTS and spec.convolution_groups == 32 and spec.group_width == 4):
        raise _no_timm_model(spec)
    return name, arguments


def _build_resnet(spec: ModelSpec):
    if spec.cifar:
        from .cifar_resnet import CifarResNet
        from .norms import norm_layer

        return CifarResNet(depth=int(spec.size), num_classes=spec.num_classes,
                           bottleneck=spec.size in CIFAR_RESNET_BOTTLENECK_SIZES,
                           norm_layer=norm_layer(spec.norm, spec.groups))
    from .resnet import imagenet_resnet  # timm: imported when one is built

    return imagenet_resnet(spec)


def _build_resnext(spec: ModelSpec):
    from .resnet import cifar_resnext, imagenet_resnext

    return cifar_resnext(spec) if spec.cifar else imagenet_resnext(spec)


RESNET = ModelFamily(
    key="resnet", display="ResNet", build=_build_resnet,
    sizes=lambda cifar: CIFAR_RESNET_BASIC_SIZES + CIFAR_RESNET_BOTTLENECK_SIZES if cifar else IMAGENET_RESNET_SIZES,
    prefix=lambda arch, size: f"RN{size}",
    run_name="{prefix}_bs{bs}{replicas}{accum}{norm}_{precision}{sr}",
    defaults={"model_size": (FamilyDefault("18"), FamilyDefault("20", _ON_CIFAR)), **_RESNET_RECIPE},
    optimiser_defaults=RESNET_OPTIMISER_DEFAULTS,
    cuts=resnet_cuts, pieces=resnet_pieces, timm_name=_resnet_timm_name, first_conv="conv1",
)

RESNEXT = ModelFamily(
    key="resnext", display="ResNeXt", build=_build_resnext,
    sizes=lambda cifar: CIFAR_RESNEXT_SIZES if cifar else IMAGENET_RESNEXT_SIZES,
    prefix=lambda arch, size: f"RNX{size}",
    run_name="{prefix}_bs{bs}{replicas}{accum}{norm}_{precision}{sr}",
    defaults={
        "model_size": (FamilyDefault("50"), FamilyDefault("29", _ON_CIFAR)),
        # the group width (channels per group) and the cardinality
        "group_dim": (FamilyDefault(4), FamilyDefault(16, _ON_CIFAR)),
        "convolution_groups": (FamilyDefault(32), FamilyDefault(8, _ON_CIFAR)),
        **_RESNET_RECIPE,
    },
    optimiser_defaults=RESNET_OPTIMISER_DEFAULTS,
    option_fields={"group_dim": "group_width"},  # --group-dim is ResNeXt's group width
    option_help={"group_dim": "channels per group", "convolution_groups": "cardinality"},
    cuts=resnet_cuts, pieces=resnet_pieces, timm_name=_resnext_timm_name, first_conv="conv1",
)
