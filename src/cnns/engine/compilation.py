"""Compilation (--compile): torch.compile where it wins, and its failures as one line."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from cnns.errors import ConfigError


def replays_cuda_graphs(compiled: bool, device: torch.device) -> bool:
    """Whether `maybe_compile` makes a model on `device` replay CUDA graphs: --compile on a GPU."""
    return compiled and device.type == "cuda"


def maybe_compile(model: nn.Module, enabled: bool) -> nn.Module:
    """torch.compile the model when --compile asks for it: the default on a GPU, off on a CPU
    (`cnns.config.defaults.device_defaults`). Compilation happens at the first call; a model that cannot
    compile fails there (`compilation_failures_named`), never silently eager.

    On a CPU the convolutions stay oneDNN calls and Inductor's fused batch-norm/ReLU kernels are no faster
    than ATen's, so compilation costs its time and gains nothing (docs/performance.md). On CUDA the
    reduce-overhead mode records CUDA graphs, which removes the per-kernel launch cost that small batches
    are bound by. A graph's replays write into memory of its own, so the training step keeps its gradients
    outside it (`TrainStep`'s ``keep_gradient_buffers``).
    """
    if not enabled:
        return model
    first = next(model.parameters(), None)
    if first is not None and replays_cuda_graphs(enabled, first.device):
        return torch.compile(model, mode="reduce-overhead")
    return torch.compile(model)


@contextlib.contextmanager
def compilation_failures_named():
    """torch.compile compiles at a model's first call (and again for a new shape): a model or option it cannot
    compile stops the command with one line that names the way out, instead of dynamo's traceback (dynamo's
    own fallback to eager, ``suppress_errors``, stays off: a run asked to compile never runs eager silently)."""
    from torch._dynamo.exc import TorchDynamoException

    try:
        yield
    except TorchDynamoException as exc:
        cause = getattr(exc, "inner_exception", None) or exc  # a backend's own error, under dynamo's wrapping
        reason = next((line for line in str(cause).splitlines() if line.strip()), type(cause).__name__)[:300]
        raise ConfigError(f"torch.compile could not compile the model ({reason}); run again with --no-compile "
                          "to run it eagerly") from None
