"""Pipeline split names: the seed's names for the places a model can be cut, mapped to our modules.

A cut "after module M" means: everything up to and including M runs in one pipeline stage, the rest in the
next ones. Cuts fall between residual units (ResNet/ResNeXt) or blocks (EfficientNet), where no skip
connection crosses them.

Names accepted for each cut (seed code, Models/resnet_base.py and Models/efficientnet.py):
- ResNet/ResNeXt unit u (1-based) of stage s (1-based): ``stage{s}/unit{u}/relu``, the older
  ``b{s}/{u-1}/relu`` and our module name ``layer{s}.{u-1}``; the end of a stage also as ``layer{s}``.
- EfficientNet: ``block0`` (the stem) and ``block{N}{letter}`` for block ``letter`` (a, b, ...) of stage N
  (1-based, as in Keras and the seed); our module name ``blocks.{N-1}.{i}``, a stage end also ``blocks.{N-1}``.
  The seed split a first-of-stage block (no skip connection) into sub-steps, so its ``block4a`` fell after
  that block's expansion convolution; here every block name cuts after the whole block.
"""

from __future__ import annotations

from string import ascii_lowercase
from typing import Iterator, Sequence

from torch import nn

from .spec import ModelError, ModelSpec, display_name


def split_points(spec: ModelSpec, model: nn.Module) -> dict[str, str]:
    """Every accepted split name -> qualified name of the module after which the cut happens, in model order."""
    cuts = _efficientnet_cuts(model) if spec.arch == "efficientnet" else _resnet_cuts(model)
    return {name: module for module, names in cuts for name in names}


def recomputation_blocks(spec: ModelSpec, model: nn.Module) -> list[str]:
    """The residual units (ResNet/ResNeXt) or blocks (EfficientNet) in order: what recomputation keeps
    the inputs of. The same cuts as the pipeline's, less EfficientNet's stem."""
    cuts = _efficientnet_cuts(model) if spec.arch == "efficientnet" else _resnet_cuts(model)
    return [module for module, _ in cuts if module.startswith(("layer", "blocks"))]


def resolve_splits(spec: ModelSpec, model: nn.Module, names: Sequence[str]) -> list[str]:
    """The modules to cut after for the given split names, checked to be known and in model order."""
    points = split_points(spec, model)
    unknown = [name for name in names if name not in points]
    if unknown:
        raise ModelError(
            f"unknown pipeline split {', '.join(unknown)} for {display_name(spec)}; "
            f"valid splits: {describe_split_points(points)}"
        )
    order = {module: position for position, module in enumerate(dict.fromkeys(points.values()))}
    modules = [points[name] for name in names]
    positions = [order[module] for module in modules]
    if any(later <= earlier for earlier, later in zip(positions, positions[1:])):
        raise ModelError(
            f"pipeline splits {' '.join(names)} must name different cuts in the model's order "
            f"(from input to output) for {display_name(spec)}"
        )
    return modules


def describe_split_points(points: dict[str, str]) -> str:
    """One line: each cut's first name with its aliases, e.g. 'stage1/unit1/relu (b1/0/relu, layer1.0)'."""
    names_by_module: dict[str, list[str]] = {}
    for name, module in points.items():
        names_by_module.setdefault(module, []).append(name)
    return ", ".join(
        f"{names[0]} ({', '.join(names[1:])})" if len(names) > 1 else names[0]
        for names in names_by_module.values()
    )


def _resnet_cuts(model: nn.Module) -> Iterator[tuple[str, list[str]]]:
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


def _efficientnet_cuts(model: nn.Module) -> Iterator[tuple[str, list[str]]]:
    yield "bn1", ["block0"]  # timm's stem is conv_stem then bn1 (norm + activation)
    for stage_index, stage in enumerate(model.blocks):
        for block_index in range(len(stage)):
            module = f"blocks.{stage_index}.{block_index}"
            names = [f"block{stage_index + 1}{ascii_lowercase[block_index]}", module]
            if block_index == len(stage) - 1:
                names.append(f"blocks.{stage_index}")
            yield module, names
