"""Exponential moving average of the weights during training (--ema-decay).

timm's ModelEmaV3 does the work. It is kept in float32 whatever the training precision: with
half-precision weights (16.16) an update of (1 - decay) * (weights - ema) is far below the half type's
resolution and would round to zero. Integer buffers (BatchNorm's num_batches_tracked) are copied, not
averaged. The average starts from the initial weights and is updated after every weight update, with
a constant decay, so it holds no state beyond its tensors: a checkpoint's "ema" entry (a plain state
dict with the model's keys) is enough to continue it exactly.
"""

from __future__ import annotations

import torch
from timm.utils.model_ema import ModelEmaV3
from torch import nn

from cnns.errors import ConfigError


class WeightEma:
    def __init__(self, model: nn.Module, decay: float):
        if not 0.0 < decay < 1.0:
            raise ConfigError(f"--ema-decay must be between 0 and 1, got {decay}")
        self.decay = decay
        self._ema = ModelEmaV3(model, decay=decay, dtype=torch.float32)

    def update(self, model: nn.Module) -> None:
        self._ema.update(model)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self._ema.module.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self._ema.module.load_state_dict(state)


def build_ema(model: nn.Module, decay: float | None) -> WeightEma | None:
    """The moving average of `model` (the plain, unwrapped model), or None without --ema-decay."""
    return WeightEma(model, decay) if decay else None
