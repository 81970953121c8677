"""Exponential moving average of the weights during training (--ema-decay).

timm's ModelEmaV3 does the work. It is kept in float32 whatever the training precision: with
half-precision weights (16.16) an update of (1 - decay) * (weights - ema) is far below the half type's
resolution and would round to zero. Integer buffers (BatchNorm's num_batches_tracked) are copied, not
averaged. The average starts from the initial weights and is updated after every weight update, with
a constant decay, so it holds no state beyond its tensors: a checkpoint's "ema" entry (a plain state
dict with the model's keys) is enough to continue it exactly.

One code path for every timm cnns supports (pyproject.toml: timm>=1.0.29). timm 1.0.31's ModelEmaV3
takes `dtype=torch.float32` and lerps half weights into the float32 average itself; 1.0.29's has no
`dtype` argument, and its update (`torch._foreach_lerp_`, or `lerp_` per tensor) needs the average and
the weights in one dtype. So neither version is asked to mix dtypes: the copy ModelEmaV3 makes is cast
to float32 here (what 1.0.31's `dtype` does), and each update hands it the weights as float32
(`Tensor.float()`: no copy for float32 weights, one cast per update for half ones, small beside the
step). A check of ModelEmaV3's signature instead would leave two update paths, each tested by one timm.
"""

from __future__ import annotations

import torch
from torch import nn

from cnns.errors import ConfigError


class WeightEma:
    def __init__(self, model: nn.Module, decay: float):
        if not 0.0 < decay < 1.0:
            raise ConfigError(f"--ema-decay must be between 0 and 1, got {decay}")
        from timm.utils.model_ema import ModelEmaV3  # here, not with the module: timm takes seconds to import

        self.decay = decay
        self._ema = ModelEmaV3(model, decay=decay)
        self._ema.module.to(dtype=torch.float32)  # floating-point tensors only: integer buffers stay

    def update(self, model: nn.Module) -> None:
        self._ema.update(_AsFloat32(model))

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self._ema.module.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self._ema.module.load_state_dict(state)


class _AsFloat32:
    """What ModelEmaV3's update reads of a model, its state dict, with floating-point tensors as float32."""

    def __init__(self, model: nn.Module):
        self._model = model

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {key: value.float() if value.is_floating_point() else value
                for key, value in self._model.state_dict().items()}


def build_ema(model: nn.Module, decay: float | None) -> WeightEma | None:
    """The moving average of `model` (the plain, unwrapped model), or None without --ema-decay."""
    return WeightEma(model, decay) if decay else None
