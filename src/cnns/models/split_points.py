"""Pipeline split names: the names Graphcore's application gives the places a model can be cut, and the
model as a sequence of pieces that a pipeline stage runs between two cuts.

A cut is identified by the qualified name of the module after which it happens (everything up to and
including that module runs in one stage, the rest in the next ones), or, inside an EfficientNet block,
by ``<block>@<child>``: after that child of the block. Cuts fall where a single tensor carries the whole
state: between residual units (ResNet/ResNeXt) or blocks (EfficientNet), and inside EfficientNet blocks
without a skip connection.

Names accepted for each cut (Graphcore's application: Models/resnet_base.py and Models/efficientnet.py):
- ResNet/ResNeXt unit u (1-based) of stage s (1-based): ``stage{s}/unit{u}/relu``, the older
  ``b{s}/{u-1}/relu`` and our module name ``layer{s}.{u-1}``; the end of a stage also as ``layer{s}``.
- EfficientNet: ``block0`` (the stem) and ``block{N}{letter}`` for block ``letter`` (a, b, ...) of stage N
  (1-based, as in Keras and Graphcore's application); our module name ``blocks.{N-1}.{i}``, a stage end
  also ``blocks.{N-1}``. As in Graphcore's application, a block without a skip connection (each stage's
  first) is cut in sub-steps: ``block{N}a`` after its expansion convolution, ``block{N}a/b`` after the
  depthwise convolution and squeeze-excitation, ``block{N}a/c`` after the projection (the whole block).
  Stage 1's first block has no expansion (a depthwise-separable block): there ``block1a`` is the whole
  block and ``block1a/b`` the depthwise part.
"""

from __future__ import annotations

from dataclasses import dataclass
from string import ascii_lowercase
from typing import Callable, Iterator, Sequence

import torch
from torch import nn

from .model_error import ModelError

# The children of timm's EfficientNet blocks in the order their forward runs them.
_INVERTED_RESIDUAL = ("conv_pw", "bn1", "conv_dw", "bn2", "aa", "se", "conv_pwl", "bn3")
_DEPTHWISE_SEPARABLE = ("conv_dw", "bn1", "aa", "se", "conv_pw", "bn2")


def split_points(spec: ModelSpec, model: nn.Module) -> dict[str, str]:
    """Every accepted split name -> the cut it names (see the module docstring), in model order: the family's
    cuts (`cnns.models.family.ModelFamily.cuts`)."""
    return {name: cut for cut, names in spec.family.cuts(spec, model) for name in names}


def recomputation_blocks(spec: ModelSpec, model: nn.Module) -> list[str]:
    """The blocks in order whose inputs recomputation keeps: the family's `recomputed`, else its whole-block
    cuts (a residual unit, an EfficientNet block; no cut inside a block), less a stem's."""
    family = spec.family
    if family.recomputed is not None:
        return family.recomputed(spec, model)
    return [cut for cut, _ in family.cuts(spec, model) if cut.startswith(("layer", "blocks")) and "@" not in cut]


def resolve_splits(spec: ModelSpec, model: nn.Module, names: Sequence[str]) -> list[str]:
    """The cuts for the given split names, checked to be known and in model order."""
    points = split_points(spec, model)
    unknown = [name for name in names if name not in points]
    if unknown:
        raise ModelError(
            f"unknown pipeline split {', '.join(unknown)} for {spec.display_name}; "
            f"valid splits: {describe_split_points(points)}"
        )
    order = {cut: position for position, cut in enumerate(dict.fromkeys(points.values()))}
    cuts = [points[name] for name in names]
    positions = [order[cut] for cut in cuts]
    if any(later <= earlier for earlier, later in zip(positions, positions[1:])):
        raise ModelError(
            f"pipeline splits {' '.join(names)} must name different cuts in the model's order "
            f"(from input to output) for {spec.display_name}"
        )
    return cuts


def stage_cuts(spec: ModelSpec, model: nn.Module, names: Sequence[str], shards: int) -> list[str]:
    """The cuts of a pipeline of `shards` stages: the split names resolved (`resolve_splits`), one fewer than the
    stages. With one stage the names are recomputation points, any number of them. The one place the count is
    checked: the checks before a run and the stages both ask here."""
    cuts = resolve_splits(spec, model, names)
    if shards > 1 and len(cuts) != shards - 1:
        raise ModelError(f"--shards {shards} needs {shards - 1} --pipeline-splits, got {len(names)} "
                         f"({' '.join(names)}); valid splits: {describe_split_points(split_points(spec, model))}")
    return cuts


def describe_split_points(points: dict[str, str]) -> str:
    """One line: each cut's first name with its aliases, e.g. 'stage1/unit1/relu (b1/0/relu, layer1.0)'."""
    names_by_cut: dict[str, list[str]] = {}
    for name, cut in points.items():
        names_by_cut.setdefault(cut, []).append(name)
    return ", ".join(
        f"{names[0]} ({', '.join(names[1:])})" if len(names) > 1 else names[0]
        for names in names_by_cut.values()
    )


def main_split_names(spec: ModelSpec, model: nn.Module) -> list[str]:
    """The first name of every cut (the one Graphcore's application uses), in model order."""
    first: dict[str, str] = {}
    for name, cut in split_points(spec, model).items():
        first.setdefault(cut, name)
    return list(first.values())


# ------------------------------------------------------------------------------------------------
# The model as pieces


@dataclass(frozen=True)
class Piece:
    """A run of the model between two possible cuts: ``run(x)`` computes it, ``modules`` are the
    qualified names of the modules it uses (what a pipeline stage keeps), ``cut`` the cut after it."""

    cut: str
    modules: tuple[str, ...]
    run: Callable[[torch.Tensor], torch.Tensor]
    block: str | None = None  # for the parts of a block cut inside: the block's qualified name


def model_pieces(spec: ModelSpec, model: nn.Module, cuts: Sequence[str] = ()) -> list[Piece]:
    """The model as a sequence of pieces; running them in order is the model's forward.

    Pieces are the stem, each residual unit or block, and the head (the family's `pieces`); a block with a cut
    inside it (one of ``cuts``) is cut into its parts there.
    """
    return spec.family.pieces(spec, model, cuts)


def efficientnet_pieces(spec: ModelSpec, model: nn.Module, cuts: Sequence[str]) -> list[Piece]:
    stem = _children_piece(model, "", ("conv_stem", "bn1"), cut="bn1")
    head = _head_piece(model, ("conv_head", "bn2"))
    units = [piece for cut, _ in efficientnet_cuts(spec, model) if "@" not in cut and cut != "bn1"
             for piece in _block_pieces(model, cut, cuts)]
    return [stem, *units, head]


def resnet_pieces(spec: ModelSpec, model: nn.Module, cuts: Sequence[str]) -> list[Piece]:
    stem = _children_piece(model, "", tuple(n for n in ("conv1", "bn1", "act1", "maxpool") if hasattr(model, n)),
                           cut="stem")
    units = [_module_piece(model, cut) for cut, _ in resnet_cuts(spec, model)]
    return [stem, *units, _head_piece(model, ())]


def stage_pieces(pieces: list[Piece], cuts: Sequence[str]) -> list[list[Piece]]:
    """The pieces of each of len(cuts) + 1 stages."""
    ends = {piece.cut: index for index, piece in enumerate(pieces)}
    bounds = [0, *(ends[cut] + 1 for cut in cuts), len(pieces)]
    return [pieces[start:end] for start, end in zip(bounds, bounds[1:])]


def _module_piece(model: nn.Module, name: str) -> Piece:
    return Piece(name, (name,), model.get_submodule(name))


def _children_piece(model: nn.Module, prefix: str, children: tuple[str, ...], cut: str,
                    block: str | None = None) -> Piece:
    parent = model.get_submodule(prefix) if prefix else model
    modules = [getattr(parent, child) for child in children]

    def run(x: torch.Tensor) -> torch.Tensor:
        for module in modules:
            x = module(x)
        return x

    qualified = tuple(f"{prefix}.{child}" if prefix else child for child in children)
    return Piece(cut, qualified, run, block)


def _head_piece(model: nn.Module, before: tuple[str, ...]) -> Piece:
    """Global pooling and the classifier (timm's forward_head), after the named children."""
    modules = [getattr(model, child) for child in before]
    head_children = tuple(n for n in ("global_pool", "fc", "classifier") if hasattr(model, n))

    def run(x: torch.Tensor) -> torch.Tensor:
        for module in modules:
            x = module(x)
        return model.forward_head(x)

    return Piece("head", (*before, *head_children), run)


def _block_pieces(model: nn.Module, block: str, cuts: Sequence[str]) -> list[Piece]:
    inside = [cut.split("@")[1] for cut in cuts if cut.startswith(block + "@")]
    if not inside:
        return [_module_piece(model, block)]
    children = _block_children(model.get_submodule(block))
    pieces, start = [], 0
    for child in [*inside, children[-1]]:
        end = children.index(child) + 1
        cut = f"{block}@{child}" if child != children[-1] else block
        pieces.append(_children_piece(model, block, children[start:end], cut, block=block))
        start = end
    return pieces


def _block_children(block: nn.Module) -> tuple[str, ...]:
    """The children of a timm EfficientNet block in forward order (only blocks without a skip are cut)."""
    children = _INVERTED_RESIDUAL if hasattr(block, "conv_pwl") else _DEPTHWISE_SEPARABLE
    if getattr(block, "conv_s2d", None) is not None or not all(hasattr(block, child) for child in children):
        raise ModelError(f"cannot cut inside a {type(block).__name__} block")
    return children


# ------------------------------------------------------------------------------------------------
# Cut names


def resnet_cuts(spec: ModelSpec, model: nn.Module) -> Iterator[tuple[str, list[str]]]:
    for stage, units in _numbered_stages(model, prefix="layer"):
        for unit in range(1, len(units) + 1):
            module = f"layer{stage}.{unit - 1}"
            names = [f"stage{stage}/unit{unit}/relu", f"b{stage}/{unit - 1}/relu", module]
            if unit == len(units):
                names.append(f"layer{stage}")
            yield module, names


def _numbered_stages(model: nn.Module, prefix: str) -> Iterator[tuple[int, nn.Sequential]]:
    """(1-based stage number, stage) for the children layer1, layer2, ... (timm's and our ResNets)."""
    stage = 1
    while hasattr(model, f"{prefix}{stage}"):
        yield stage, getattr(model, f"{prefix}{stage}")
        stage += 1


def efficientnet_cuts(spec: ModelSpec, model: nn.Module) -> Iterator[tuple[str, list[str]]]:
    yield "bn1", ["block0"]  # timm's stem is conv_stem then bn1 (norm + activation)
    for stage_index, stage in enumerate(model.blocks):
        for block_index, block in enumerate(stage):
            module = f"blocks.{stage_index}.{block_index}"
            name = f"block{stage_index + 1}{ascii_lowercase[block_index]}"
            whole = [module] + ([f"blocks.{stage_index}"] if block_index == len(stage) - 1 else [])
            if getattr(block, "has_skip", True):
                yield module, [name, *whole]
            elif hasattr(block, "conv_pwl"):  # inverted residual: expansion, depthwise + SE, projection
                yield f"{module}@bn1", [name]
                yield f"{module}@se", [f"{name}/b"]
                yield module, [f"{name}/c", *whole]
            else:  # depthwise separable: no expansion
                yield f"{module}@se", [f"{name}/b"]
                yield module, [name, f"{name}/c", *whole]
