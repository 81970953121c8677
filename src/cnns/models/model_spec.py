"""What to build: the model description, its validation and the names Graphcore's application gives it."""

from __future__ import annotations

from dataclasses import dataclass

from cnns.errors import CnnsError

ARCHITECTURES = ("resnet", "resnext", "efficientnet")
NORMS = ("batch", "group")

# Inputs at most this large get the CIFAR-style networks (3x3 stem, no max-pool, three stages);
# larger inputs get the ImageNet definitions. CIFAR images are always 32x32 (Graphcore's application
# rejects --image-size for CIFAR), while ImageNet models are trained at reduced sizes such as 64 px.
CIFAR_MAX_IMAGE_SIZE = 32

# He et al. 2015: 6n+2 layers with basic blocks, 9n+2 with bottleneck blocks.
CIFAR_RESNET_BASIC_SIZES = ("8", "14", "20", "32", "44", "56", "110")
CIFAR_RESNET_BOTTLENECK_SIZES = ("11", "29", "38", "47", "65")
IMAGENET_RESNET_SIZES = ("10", "14", "18", "26", "34", "50", "101", "152")
# ResNeXt-29 is Xie et al.'s; Graphcore's application also built the other 9n+2 depths
# (its default was 11).
CIFAR_RESNEXT_SIZES = ("11", "29", "38", "47", "56", "65")
IMAGENET_RESNEXT_SIZES = ("14", "26", "50", "101", "152")
EFFICIENTNET_SIZES = tuple(f"B{i}" for i in range(8)) + ("cifar",)

_DISPLAY_NAMES = {"resnet": "ResNet", "resnext": "ResNeXt", "efficientnet": "EfficientNet"}


class ModelError(CnnsError):
    """An unknown architecture, size, option combination or split name."""


def is_cifar_sized(image_size: int) -> bool:
    return image_size <= CIFAR_MAX_IMAGE_SIZE


def valid_sizes(arch: str, cifar: bool) -> list[str]:
    """The sizes ``arch`` can be built at for CIFAR-sized (``cifar``) or ImageNet-sized inputs."""
    if arch == "resnet":
        return list(CIFAR_RESNET_BASIC_SIZES + CIFAR_RESNET_BOTTLENECK_SIZES if cifar else IMAGENET_RESNET_SIZES)
    if arch == "resnext":
        return list(CIFAR_RESNEXT_SIZES if cifar else IMAGENET_RESNEXT_SIZES)
    if arch == "efficientnet":
        # EfficientNet is resolution-agnostic: every size runs on every input size; 'cifar' is merely
        # the one meant for 32x32 inputs.
        return list(EFFICIENTNET_SIZES)
    raise ModelError(f"unknown model {arch!r}; valid models: {', '.join(ARCHITECTURES)}")


def normalise_size(arch: str, size: str | int) -> str:
    """The canonical spelling of a size: EfficientNet '4', 'b4', 'B4' -> 'B4', 'CIFAR' -> 'cifar'."""
    text = str(size).strip()
    if arch != "efficientnet":
        return text
    if text.lower() == "cifar":
        return "cifar"
    if text.isdigit():
        return f"B{text}"
    if text[:1] in "bB" and text[1:].isdigit():
        return f"B{text[1:]}"
    return text


@dataclass(frozen=True)
class ModelSpec:
    """Everything that decides a model's architecture (never how it is trained or run)."""

    arch: str  # "resnet" | "resnext" | "efficientnet"
    size: str  # resnet "8".."152", resnext "29"/"50"/"101", efficientnet "B0".."B7" or "cifar"
    num_classes: int
    image_size: int  # <= 32: CIFAR-style networks; else ImageNet definitions
    norm: str = "batch"  # "batch" | "group"
    groups: int = 32  # GroupNorm groups (--groups)
    group_dim: int = 1  # EfficientNet: group size of the depthwise convolutions (--group-dim; 1 = depthwise)
    expand_ratio: int = 6  # EfficientNet expansion ratio of the inverted-residual blocks (--expand-ratio)
    convolution_groups: int = 32  # ResNeXt cardinality (--convolution-groups)
    group_width: int = 4  # ResNeXt channels per group (the "4d" of 32x4d)

    def __post_init__(self) -> None:
        arch = str(self.arch).lower()
        object.__setattr__(self, "arch", arch)
        object.__setattr__(self, "size", normalise_size(arch, self.size))
        self._validate()

    @property
    def cifar(self) -> bool:
        return is_cifar_sized(self.image_size)

    def _validate(self) -> None:
        sizes = valid_sizes(self.arch, self.cifar)  # also rejects an unknown arch
        if self.size not in sizes:
            dataset = "CIFAR" if self.cifar else "ImageNet"
            raise ModelError(
                f"unknown {_DISPLAY_NAMES[self.arch]} size {self.size} for {dataset}-sized images "
                f"({self.image_size}x{self.image_size}); valid sizes: {', '.join(sizes)}"
            )
        if self.norm not in NORMS:
            raise ModelError(f"unknown normalisation {self.norm!r}; valid: {', '.join(NORMS)}")
        for field in ("num_classes", "image_size", "groups", "group_dim", "expand_ratio",
                      "convolution_groups", "group_width"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ModelError(f"model option {field} must be a positive integer, got {value!r}")


def run_name_prefix(spec: ModelSpec) -> str:
    """The model tag at the start of a run name, as Graphcore's application writes it: RN20, RN50, RNX29,
    RNX101, EfficientNet-B0."""
    if spec.arch == "resnet":
        return f"RN{spec.size}"
    if spec.arch == "resnext":
        return f"RNX{spec.size}"
    # Graphcore's application upper-cased the size: EfficientNet-B4, EfficientNet-CIFAR.
    return f"EfficientNet-{spec.size.upper()}"


def display_name(spec: ModelSpec) -> str:
    """A human-readable model name for messages: 'ResNet-50', 'EfficientNet-B4'."""
    return f"{_DISPLAY_NAMES[spec.arch]}-{spec.size}"
