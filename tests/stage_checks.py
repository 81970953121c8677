"""What every cut of a model into pipeline stages must hold, whatever the family (the seed's families in
test_models.py, timm's in test_timm_models.py): the pieces run in order are the model, bitwise, and every parameter
belongs to exactly one piece."""

from __future__ import annotations

import torch
from torch import nn


def assert_stages_are_the_model(model: nn.Module, stages: list[list], x: torch.Tensor) -> None:
    with torch.no_grad():
        expected, y = model(x), x
        for piece in (piece for stage in stages for piece in stage):
            y = piece.run(y)
    assert torch.equal(y, expected)
    owned = [module for stage in stages for piece in stage for module in piece.modules]
    claims = {name: [m for m in owned if name.startswith(m + ".")] for name, _ in model.named_parameters()}
    assert all(len(c) == 1 for c in claims.values()), [p for p, c in claims.items() if len(c) != 1]
