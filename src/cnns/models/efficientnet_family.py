"""The EfficientNet family's entry (`cnns.models.family.ModelFamily`): B0-B7 and the 'cifar' size from timm's
parts (`efficientnet`), with Graphcore's group size and expansion ratio, cut between and inside blocks."""

from __future__ import annotations

from typing import Any

from .family import FamilyDefault, ModelFamily, OptimiserDefaults
from .model_error import ModelError
from .resnet_family import timm_classifier_model
from .split_points import efficientnet_cuts, efficientnet_pieces

EFFICIENTNET_SIZES = tuple(f"B{i}" for i in range(8)) + ("cifar",)
TIMM_EFFICIENTNETS = {f"B{i}" for i in range(8)}
# EfficientNet's own input sizes (Tan and Le), Graphcore's application's ImageNet default for each size.
EFFICIENTNET_IMAGE_SIZES = {"B0": 224, "B1": 240, "B2": 260, "B3": 300, "B4": 380, "B5": 456, "B6": 528, "B7": 600}

# Graphcore's application's learning-rate exponents, RMSprop decay and L2 decay of the ImageNet EfficientNets.
EFFICIENTNET_OPTIMISER_DEFAULTS = OptimiserDefaults("ImageNet EfficientNets", {
    "base_learning_rate_exponent": {"SGD": -7.0, "momentum": -10.0, "RMSprop": -14.0, "LARS": -7.0, "AdamW": -18.0,
                                    "LAMB": -18.0},
    "rmsprop_base_decay_exp": {"RMSprop": -14.0},
    "weight_decay": {"*": 1e-5},
    "lars_weight_decay": {"*": 1e-5},
})


def normalise_size(size: str) -> str:
    """Graphcore's spellings: '4', 'b4', 'B4' -> 'B4'; 'CIFAR' -> 'cifar'."""
    text = str(size).strip()
    if text.lower() == "cifar":
        return "cifar"
    if text.isdigit():
        return f"B{text}"
    if text[:1] in "bB" and text[1:].isdigit():
        return f"B{text[1:]}"
    return text


def _timm_name(spec: ModelSpec) -> tuple[str, dict[str, Any]]:
    if spec.norm == "group" and not spec.cifar:
        raise ModelError(f"timm builds {spec.display_name} with group norm of {spec.groups} groups from code only, "
                         "not from a model name: export a --batch-norm run, or as onnx or pt2")
    if not spec.cifar and not (spec.size in TIMM_EFFICIENTNETS and spec.group_dim == 1 and spec.expand_ratio == 6):
        raise ModelError(f"timm defines no model for {spec.display_name} (only ResNet 18-152, ResNeXt 50/101 32x4d "
                         "and EfficientNet B0-B7 as the papers define them): export it as onnx or pt2")
    return timm_classifier_model(spec, f"efficientnet_{spec.size.lower()}")


def _build(spec: ModelSpec):
    from .efficientnet import efficientnet  # timm: imported when one is built

    return efficientnet(spec)


_ON_CIFAR, _ON_IMAGENET = True, False  # FamilyDefault.cifar_sized

EFFICIENTNET = ModelFamily(
    key="efficientnet", display="EfficientNet", build=_build,
    # Resolution-agnostic: every size runs on every input size; 'cifar' is merely the one meant for 32x32 inputs.
    sizes=lambda cifar: EFFICIENTNET_SIZES, normalise_size=normalise_size,
    # Graphcore's application's tag: EfficientNet-B4 (the run name keeps the size as resolved: EfficientNet-cifar).
    prefix=lambda arch, size: f"EfficientNet-{size}",
    run_name="{prefix}_bs{bs}{accum}{replicas}{norm}",
    defaults={
        "model_size": (FamilyDefault("B0"), FamilyDefault("cifar", _ON_CIFAR)),
        "groups": (FamilyDefault(4),),
        "group_dim": (FamilyDefault(1),),  # the group size of the depthwise convolutions
        "expand_ratio": (FamilyDefault(6),),
        "image_size": tuple(FamilyDefault(pixels, _ON_IMAGENET, size)
                            for size, pixels in EFFICIENTNET_IMAGE_SIZES.items() if pixels != 224),
        "micro_batch_size": (FamilyDefault(8, _ON_CIFAR),),
        "epochs": (FamilyDefault(350.0), FamilyDefault(300.0, _ON_CIFAR)),
        "label_smoothing": (FamilyDefault(0.1, _ON_IMAGENET),),
    },
    optimiser_defaults=EFFICIENTNET_OPTIMISER_DEFAULTS,
    option_help={"group_dim": "group size of the depthwise convolutions", "expand_ratio": "expansion ratio"},
    cuts=efficientnet_cuts, pieces=efficientnet_pieces, timm_name=_timm_name, first_conv="conv_stem",
)
