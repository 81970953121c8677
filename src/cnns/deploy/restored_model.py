"""A trained run's model rebuilt for inference: `cnns predict`, `cnns export`, inference_embedded.py and the
inference-backends benchmark start here.

The caller resolves the run's configuration as ``validation.py`` does (`cnns.cli.inference.restored_run`: the
one resolution every command goes through); the model is rebuilt from it, a checkpoint's raw or moving-average
weights are loaded, and `deployed` makes it the model training assembles (`cnns.engine.assembly.assemble`), in
eval mode, in float32 whatever the training precision (inference_embedded.py: in its compute type).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from cnns.config import RunConfig
from cnns.data.augment import IMAGENET_MEAN, IMAGENET_STD, normalise
from cnns.engine.assembly import assemble
from cnns.errors import ConfigError
from cnns.parallel.world import World
from cnns.precision import PrecisionPolicy

WEIGHT_CHOICES = ("raw", "ema")


# ----------------------------------------------------------------------------------------------
# A run's model with one checkpoint's weights


@dataclass
class RestoredModel:
    """A run's model with one checkpoint's weights, float32, eval mode, on `device`."""

    cfg: RunConfig
    model: nn.Module
    checkpoint: Path
    weights: str  # "raw" or "ema"
    trained_precision: str  # e.g. "16.16 (bfloat16)"
    saved_half_weights: bool  # the checkpoint holds half-precision weights (16.16 where the CPU computed half)
    mean: tuple[float, ...]
    std: tuple[float, ...]
    device: torch.device

    @property
    def description(self) -> str:
        from cnns.models.model_spec import display_name

        return display_name(self.cfg.model)

    @property
    def image_size(self) -> int:
        return int(self.cfg.model.image_size)

    @property
    def num_classes(self) -> int:
        return int(self.cfg.model.num_classes)


def deployed(model: nn.Module, cfg: RunConfig, device: torch.device, policy: PrecisionPolicy) -> nn.Module:
    """`model` (built from `cfg`, its weights loaded) as `assemble` makes it the run's, on one process, in the
    inference `policy` (`PrecisionPolicy.float32`, or the run's `for_inference`: no float32 master copy), in eval
    mode.

    Its `plain` model: one process has no replicas and no pipeline stage, and --compile's wrapper is not
    deployed (inference_embedded.py compiles ahead of time; predict and export run or trace the module). The
    fused passes, kernels and recomputation stay as training has them; in eval they compute what the plain
    layers compute (`cnns.engine.fusion`, `cnns.engine.kernel_choice`).
    """
    return assemble(model, cfg, World(), device, policy).plain.eval()


def input_normalisation(cfg) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(mean, std) on the 0..1 scale, as the device feed normalises training and validation batches."""
    from cnns.engine.feed import DeviceFeed

    feed = DeviceFeed(torch.device("cpu"), torch.float32, imagenet_normalisation=cfg.data.normalise_input)
    return tuple(float(v) for v in feed.mean), tuple(float(v) for v in feed.std)


def restore_model(checkpoint: Path, cfg: RunConfig, weights: str = "raw",
                  device: torch.device | str = "cpu") -> RestoredModel:
    """Rebuild the model of `cfg` (its run's configuration) and load `checkpoint`'s raw or EMA weights, in
    float32, eval mode.

    CheckpointError (one line, naming the file) for weights that do not fit the model, or --weights ema on a
    checkpoint that holds no moving average."""
    from cnns.runfolder.checkpoint import check_matches_model
    from cnns.models import build_model
    from cnns.runfolder.run_folder import checkpoint_weights

    if weights not in WEIGHT_CHOICES:
        raise ConfigError(f"--weights must be raw or ema, got {weights!r}")
    device = torch.device(device)
    state_dict = checkpoint_weights(checkpoint, weights)
    model = build_model(cfg.model)
    description = cfg.model.tag
    check_matches_model(checkpoint, state_dict, model.state_dict(), description)
    model.load_state_dict(state_dict)  # half-precision tensors are converted to the float32 parameters
    model = deployed(model, cfg, device, PrecisionPolicy.float32(device))
    mean, std = input_normalisation(cfg)
    return RestoredModel(cfg, model, checkpoint, weights, cfg.precision.describe(), holds_half_weights(state_dict),
                         mean, std, device)


def holds_half_weights(state_dict: dict[str, torch.Tensor]) -> bool:
    """Whether a checkpoint's weights are half precision: what its run really trained with, which the options
    alone do not say (a CPU without bfloat16 arithmetic trains 16.16 in float32)."""
    return any(tensor.dtype in (torch.bfloat16, torch.float16) for tensor in state_dict.values())


# ----------------------------------------------------------------------------------------------
# The model behind the graph's input: float NCHW, or uint8 NHWC normalised inside (Graphcore's application's 8-bit I/O)


class FloatClassifier(nn.Module):
    """float32 NCHW normalised images -> float32 logits (names the graph's input "images")."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(images).float()


class NormalisedClassifier(nn.Module):
    """uint8 NHWC images -> logits: the device-side normalisation folded into the exported graph."""

    def __init__(self, model: nn.Module, std: tuple[float, ...], dtype: torch.dtype):
        super().__init__()
        self.model = model
        self.std = std
        self.dtype = dtype

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(normalise(images, IMAGENET_MEAN, self.std, self.dtype)).float()


# ----------------------------------------------------------------------------------------------
# inference_embedded.py's model: what it compiles, and what the inference-backends benchmark runs


def build_inference_model(cfg: RunConfig, checkpoint: Path | None, device: torch.device) -> nn.Module:
    """The model training assembles (`deployed`) in the compute type of `cfg`'s precision, behind the
    normalisation of uint8 NHWC images; `checkpoint`'s weights, or random ones from torch's generator."""
    from cnns.runfolder.checkpoint import check_matches_model
    from cnns.models import build_model
    from cnns.runfolder.run_folder import checkpoint_weights

    model = build_model(cfg.model)
    if checkpoint is not None:  # a model the command line changed (--model-size) is one line, not a traceback
        weights = checkpoint_weights(checkpoint)
        check_matches_model(checkpoint, weights, model.state_dict(), cfg.model.tag)
        model.load_state_dict(weights)
    policy = cfg.precision.policy(device).for_inference()
    std = inference_std(cfg)
    return NormalisedClassifier(deployed(model, cfg, device, policy), std, policy.compute_dtype).eval()


def inference_dtype_and_std(cfg: RunConfig, device: torch.device) -> tuple[torch.dtype, tuple[float, ...]]:
    """The inference model's dtype and the standard deviations its normalisation divides by."""
    # Inference has no master weights to keep: half precision means half weights (float32 where the
    # CPU would only emulate the half type and none was asked for explicitly).
    return cfg.precision.policy(device).for_inference().compute_dtype, inference_std(cfg)


def inference_std(cfg: RunConfig) -> tuple[float, ...]:
    """The standard deviations the inference model's normalisation divides by."""
    return IMAGENET_STD if cfg.data.normalise_input else (1.0, 1.0, 1.0)


def inference_batch(cfg: RunConfig) -> torch.Tensor:
    """The uint8 NHWC batch inference is timed on: --micro-batch-size random images of the run's size, the
    same for the same --seed."""
    size = cfg.data.image_size
    return torch.randint(0, 256, (cfg.train.micro_batch_size, size, size, 3), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(cfg.train.seed or 0))
