"""What to build: the model description, its validation and the names Graphcore's application gives it."""

from __future__ import annotations

from dataclasses import dataclass

from .model_error import ModelError

NORMS = ("batch", "group")

# Inputs at most this large get the CIFAR-style networks (3x3 stem, no max-pool, three stages);
# larger inputs get the ImageNet definitions. CIFAR images are always 32x32 (Graphcore's application
# rejects --image-size for CIFAR), while ImageNet models are trained at reduced sizes such as 64 px.
CIFAR_MAX_IMAGE_SIZE = 32


def is_cifar_sized(image_size: int) -> bool:
    return image_size <= CIFAR_MAX_IMAGE_SIZE


def _family(arch: str):
    from .families import family_of  # the registry, whose entries build ModelSpecs

    return family_of(arch)


def valid_sizes(arch: str, cifar: bool) -> list[str]:
    """The sizes ``arch`` can be built at for CIFAR-sized (``cifar``) or ImageNet-sized inputs (its family's
    entry, `cnns.models.family`); none for a model named by its own name (timm's); ModelError for an unknown one."""
    family = _family(arch)
    return [] if family.named else list(family.sizes(cifar))


def normalise_size(arch: str, size: str | int) -> str:
    """The canonical spelling of a size (the family's): EfficientNet '4', 'b4', 'B4' -> 'B4', 'CIFAR' -> 'cifar'."""
    return _family(arch).normalise_size(str(size).strip())


@dataclass(frozen=True)
class ModelSpec:
    """Everything that decides a model's architecture (never how it is trained or run)."""

    arch: str  # --model: a family's key (`cnns.models.family`), or the name of a named family's model (timm's)
    size: str  # the family's sizes; "" for a named model
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
        family = _family(arch)  # ModelError naming the nearest names for an unknown one
        size = "" if self.size is None else str(self.size).strip()
        object.__setattr__(self, "size", family.normalise_size(size) if size else size)
        self._validate()

    @property
    def cifar(self) -> bool:
        return is_cifar_sized(self.image_size)

    @property
    def family(self):
        """The family's entry (`cnns.models.family.ModelFamily`)."""
        return _family(self.arch)

    @property
    def display_name(self) -> str:
        """A human-readable model name for messages: 'ResNet-50', 'EfficientNet-B4', 'convnext_atto'."""
        return self.family.display_name(self.arch, self.size)

    @property
    def tag(self) -> str:
        """How the header and file names give the model: 'resnet-20', 'efficientnet-B0'; a named model's name."""
        return f"{self.arch}-{self.size}" if self.size else self.arch

    def _validate(self) -> None:
        family = self.family
        if family.named and self.size:
            raise ModelError(f"{self.arch} is a model of its own, named by timm: it takes no --model-size "
                             f"(got {self.size})")
        sizes = valid_sizes(self.arch, self.cifar)
        if not family.named and self.size not in sizes:
            dataset = "CIFAR" if self.cifar else "ImageNet"
            raise ModelError(
                f"unknown {family.display} size {self.size} for {dataset}-sized images "
                f"({self.image_size}x{self.image_size}); valid sizes: {', '.join(sizes)}"
            )
        if self.norm not in NORMS:
            raise ModelError(f"unknown normalisation {self.norm!r}; valid: {', '.join(NORMS)}")
        for field in ("num_classes", "image_size", "groups", "group_dim", "expand_ratio",
                      "convolution_groups", "group_width"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ModelError(f"model option {field} must be a positive integer, got {value!r}")
        if family.check is not None:
            family.check(self)


def run_name_prefix(spec: ModelSpec) -> str:
    """The model tag at the start of a run name, as Graphcore's application writes it (its family's `prefix`):
    RN20, RN50, RNX29, RNX101, EfficientNet-B0 (Graphcore's application upper-cased the size: EfficientNet-CIFAR);
    a timm model's own name."""
    return spec.family.prefix(spec.arch, spec.size.upper())


def display_name(spec: ModelSpec) -> str:
    """A human-readable model name for messages: 'ResNet-50', 'EfficientNet-B4'."""
    return spec.display_name
