"""A model family added in one file: what a new family costs (its entry; the registry line is the test's,
`register_family(TINY)`). Two convolutions and a classifier, cut between its two stages."""

from __future__ import annotations

from torch import nn

from cnns.models import FamilyDefault, ModelError, ModelFamily
from cnns.models.norms import norm_layer
from cnns.models.split_points import Piece


class TinyNet(nn.Module):
    def __init__(self, width: int, num_classes: int, norm) -> None:
        super().__init__()
        self.stage1 = nn.Sequential(nn.Conv2d(3, width, 3, stride=2, padding=1, bias=False), norm(width), nn.ReLU())
        self.stage2 = nn.Sequential(nn.Conv2d(width, 2 * width, 3, stride=2, padding=1, bias=False), norm(2 * width),
                                    nn.ReLU())
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * width, num_classes))

    def forward(self, x):
        return self.head(self.stage2(self.stage1(x)))


WIDTHS = {"s": 8, "m": 16}


def _build(spec) -> TinyNet:
    return TinyNet(WIDTHS[spec.size], spec.num_classes, norm_layer(spec.norm, spec.groups))


def _cuts(spec, model):
    yield "stage1", ["stage1", "tiny/1"]
    yield "stage2", ["stage2", "tiny/2"]


def _pieces(spec, model, cuts):
    return [Piece(name, (name,), getattr(model, name)) for name in ("stage1", "stage2", "head")]


def _no_timm_model(spec):
    raise ModelError(f"timm defines no model for {spec.display_name}")


TINY = ModelFamily(
    key="tinynet", display="TinyNet", build=_build, sizes=lambda cifar: tuple(WIDTHS),
    prefix=lambda arch, size: f"Tiny{size.upper()}", run_name="{prefix}_bs{bs}{accum}{norm}",
    defaults={"model_size": (FamilyDefault("s"),), "norm": (FamilyDefault("batch"),)},
    cuts=_cuts, pieces=_pieces, timm_name=_no_timm_model,
)
