"""Models by name: ResNet, ResNeXt and EfficientNet as plain single-device nn.Modules ending in logits.

timm provides every architecture it has (ImageNet ResNet/ResNeXt, EfficientNet B0-B7, the ResNeXt blocks);
only the option-A CIFAR ResNets are written here. The models know nothing about training, precision or
parallelism; ``split_points`` names the places where a pipeline may cut them.
"""

from .model_spec import ModelError, ModelSpec, run_name_prefix, valid_sizes
from .split_points import describe_split_points, recomputation_blocks, resolve_splits, split_points

__all__ = [
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
