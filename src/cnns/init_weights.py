"""Weights that cross the project's border: read for `train.py --init-path`, written for timm.

* `read_weight_file`: a cnns checkpoint (its ``"model"`` entry) or run folder (its newest checkpoint),
  or a plain state dict in timm's layout, as ``.pt`` / ``.pth`` (``torch.load``, weights only) or
  ``.safetensors``. cnns builds its ImageNet models from timm's definitions, so timm's key names are
  cnns' own.
* `initial_weights`: those weights checked against the model a run builds (on the meta device: no
  memory, no arithmetic). A classifier of another class count is left out, to be initialised anew;
  any other missing, foreign or misshapen tensor is one line naming the first.
* `timm_model`: the name (and the arguments) under which timm builds the same model, for `cnns export
  --format safetensors`; or why there is none.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cnns.errors import CheckpointError, first_line
from cnns.models import ModelError, ModelSpec, build_model
from cnns.runfolder.checkpoint import list_checkpoints, load_checkpoint

SAFETENSORS_SUFFIX = ".safetensors"


def read_weight_file(path: str | Path) -> tuple[dict[str, torch.Tensor], Path]:
    """(the state dict at `path`, the file it was read from: a run folder's newest checkpoint); see the
    module docstring. CheckpointError in one line when it is none."""
    path = Path(path)
    if path.is_dir():
        checkpoints = list_checkpoints(path)
        if not checkpoints:
            raise CheckpointError(f"--init-path {path}: a folder without checkpoints (ckpt-<iteration>.pt)")
        path = checkpoints[-1][1]
    if not path.is_file():
        raise CheckpointError(f"--init-path {path}: no such file or folder")
    if path.suffix == SAFETENSORS_SUFFIX:
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(path), path
        except (SafetensorError, OSError, ValueError) as error:
            raise CheckpointError(f"--init-path {path}: not a safetensors file ({first_line(error)})") from None
    try:
        state = load_checkpoint(path)  # a cnns checkpoint, checked
        return state["model"], path
    except CheckpointError:
        pass
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - torch.load raises many kinds for a file that is not one
        reason = ("it holds Python objects, not only tensors" if "Weights only load failed" in str(error)
                  else first_line(error))
        raise CheckpointError(f"--init-path {path}: not a checkpoint or state dict ({reason})") from None
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]  # the common {"state_dict": ...} wrapping
    if not (isinstance(state, dict) and state and all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                      for k, v in state.items())):
        raise CheckpointError(f"--init-path {path}: not a state dict of tensors, nor a cnns checkpoint")
    return state, path


@dataclass
class InitialWeights:
    """Weights to start a run from: every tensor of the model but a classifier left to initialise."""

    path: Path
    weights: dict[str, torch.Tensor]
    notes: list[str] = field(default_factory=list)

    def load_into(self, model: nn.Module) -> None:
        """Copy the weights into `model` (a pipeline stage holds some of the model's tensors: those), then let
        the file's copy go: the run holds them in its model from here."""
        own = model.state_dict()
        with torch.no_grad():
            for name, tensor in self.weights.items():
                if name in own:
                    own[name].copy_(tensor)
        self.weights = {}


def initial_weights(path: str | Path, spec: ModelSpec) -> InitialWeights:
    """The weights at `path` checked against the model built from `spec` (see the module docstring)."""
    weights, path = read_weight_file(path)
    with torch.device("meta"):
        model = build_model(spec)
    expected = model.state_dict()
    notes = [f"Initialised from {path} (--init-path); optimiser, schedule and data order start fresh"]
    anew = [head for head in classifier_names(model) if _other_class_count(weights, expected, head)]
    if anew:
        theirs = weights[f"{anew[0]}.weight"]
        heads = {f"{head}.{part}" for head in anew for part in ("weight", "bias")}
        weights = {k: v for k, v in weights.items() if k not in heads}
        expected = {k: v for k, v in expected.items() if k not in heads}
        notes.append(f"Classifier ({', '.join(anew)}) initialised anew: {spec.num_classes} classes here, "
                     f"{theirs.shape[0]} in {path.name}")
    foreign = [k for k in weights if k not in expected]
    if foreign:
        raise CheckpointError(f"--init-path {path} does not fit {_described(spec)}: it has {foreign[0]!r}, which the "
                              f"model has not ({len(foreign)} such tensors)")
    missing = [k for k in expected if k not in weights]
    if missing:
        raise CheckpointError(f"--init-path {path} does not fit {_described(spec)}: it lacks {missing[0]!r} "
                              f"({len(missing)} tensors missing)")
    for name, tensor in expected.items():
        if tuple(weights[name].shape) != tuple(tensor.shape):
            raise CheckpointError(f"--init-path {path} does not fit {_described(spec)}: {name} is "
                                  f"{tuple(weights[name].shape)} there, {tuple(tensor.shape)} here")
    return InitialWeights(Path(path), weights, notes)


def classifier_names(model: nn.Module) -> list[str]:
    """The module names of the model's classifier: timm's own answer where the model is timm's (`get_classifier`,
    which every timm model has: a Linear, a 1x1 convolution (DLA), or two heads (a distilled DeiT's)), else its last
    linear layer (the CIFAR ResNets)."""
    asked = getattr(model, "get_classifier", None)
    heads = asked() if callable(asked) else None
    heads = [head for head in (heads if isinstance(heads, tuple) else (heads,))
             if isinstance(head, nn.Module) and any(True for _ in head.parameters())]
    if heads:
        names = {id(module): name for name, module in model.named_modules()}
        return [names[id(head)] for head in heads if id(head) in names]
    return [name for name, module in model.named_modules() if isinstance(module, nn.Linear)][-1:]


def classifier_name(model: nn.Module) -> str:
    """The module name of the model's (first) classifier (timm's fc / classifier / head.fc)."""
    return classifier_names(model)[0]


def _other_class_count(weights: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], head: str) -> bool:
    """Whether the file's classifier `head` is the model's for another class count: the same inputs, other outputs."""
    theirs, ours = weights.get(f"{head}.weight"), expected.get(f"{head}.weight")
    return (theirs is not None and ours is not None and theirs.dim() == ours.dim()
            and theirs.shape[0] != ours.shape[0] and theirs.shape[1:] == ours.shape[1:])


def timm_model(spec: ModelSpec) -> tuple[str, dict[str, Any]]:
    """(timm's model name, the model arguments beyond the class count) for the model `spec` builds (its family's
    `timm_name`); CheckpointError saying why when timm defines none."""
    try:
        return spec.family.timm_name(spec)
    except ModelError as error:
        raise CheckpointError(str(error)) from None


def _described(spec: ModelSpec) -> str:
    return spec.display_name
