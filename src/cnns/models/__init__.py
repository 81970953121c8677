"""Models by name: plain single-device nn.Modules ending in logits, each family one registry entry
(`cnns.models.family`, registered in `cnns.models.families`).

timm provides every architecture it has (ImageNet ResNet/ResNeXt, EfficientNet B0-B7, the ResNeXt blocks, and
its own image classifiers by their timm names); only the option-A CIFAR ResNets are written here. The models
know nothing about training, precision or parallelism; ``split_points`` names the places where a pipeline may
cut them.
"""

from .families import family_of, model_names
from .family import FamilyDefault, ModelFamily, OptimiserDefaults, register_family
from .model_spec import ModelError, ModelSpec, run_name_prefix, valid_sizes
from .split_points import describe_split_points, recomputation_blocks, resolve_splits, split_points

__all__ = [
    "FamilyDefault",
    "ModelFamily",
    "OptimiserDefaults",
    "family_of",
    "model_names",
    "register_family",
    "ModelError",
    "ModelSpec",
    "build_model",
    "count_parameters",
    "describe_split_points",
    "recomputation_blocks",
    "resolve_splits",
    "run_name_prefix",
    "split_points",
    "valid_sizes",
]


def __getattr__(name: str):
    """build_model and count_parameters on first use (PEP 562): their module imports timm, and timm torchvision
    and torch._dynamo, seconds of start-up that reading a command line's ModelSpec, or a process that only starts
    the workers of a run, does not need."""
    if name in ("build_model", "count_parameters"):
        from . import registry

        return getattr(registry, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
