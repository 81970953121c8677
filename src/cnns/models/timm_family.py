"""timm's image classifiers by their timm names: one generic entry (`cnns.models.family.ModelFamily`) for every
model `timm.list_models()` knows, built with ``pretrained=False`` (never a download) and the run's class count.

* **Normalisation.** --batch-norm is the model's own normalisation (whatever timm builds: batch norm, layer
  norm...); --group-norm replaces each of its batch norms by a group norm of --groups groups (fitted to the
  channels, `norms.fitted_groups`), keeping its activation and its initial scale and shift, so the parameter
  count stays. A model without batch norm, or with one group norm cannot stand for (BatchNorm1d), is refused.
* **Pipeline stages** are cut at the model's own stage boundaries, timm's ``feature_info`` modules, where its
  ``forward_features`` is a sequence of its top-level modules (nn.Sequential containers opened one level, as
  timm's feature extraction does): found once per model by running it on the meta device with a hook on each
  module, checking that each one runs once on the output of the one before. The head is ``forward_head``. A
  model whose forward is not such a sequence takes no --pipeline-splits (one line says so).
* **Export.** The timm name is the model timm builds again (`timm.create_model(name, pretrained=True,
  pretrained_cfg_overlay=...)`); with --group-norm there is none, and one line says so.

timm is imported when a name is looked up or a model built, not with this module.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from typing import Any

from .family import FamilyDefault, ModelFamily, PerModel
from .model_error import ModelError
from .resnet_family import RESNET_OPTIMISER_DEFAULTS
from .split_points import Piece


_ON_CIFAR, _ON_IMAGENET = True, False  # FamilyDefault.cifar_sized


@functools.cache
def _timm_names() -> frozenset[str]:
    import timm

    return frozenset(timm.list_models())


def list_models(pattern: str = "*") -> list[str]:
    """The models timm knows matching the fnmatch `pattern`, as `timm.list_models(pattern)` lists them."""
    import timm

    return list(timm.list_models(pattern or "*"))


def knows(name: str) -> bool:
    return name in _timm_names()


def _create(name: str, num_classes: int, image_size: int):
    import timm

    try:  # models with a fixed input grid (vision transformers) take it; the CNNs refuse the argument
        return timm.create_model(name, pretrained=False, num_classes=num_classes, img_size=image_size)
    except TypeError as error:
        if "img_size" not in str(error):
            raise
    return timm.create_model(name, pretrained=False, num_classes=num_classes)


def build(spec) -> Any:
    """timm's model `spec.arch` with the spec's class count, normalisation and (where it takes one) input size."""
    try:
        model = _create(spec.arch, spec.num_classes, spec.image_size)
    except (RuntimeError, ValueError, TypeError, AssertionError) as error:
        raise ModelError(f"timm cannot build {spec.arch} for {spec.num_classes} classes at {spec.image_size} px: "
                         f"{str(error).splitlines()[0] if str(error) else type(error).__name__}") from None
    if spec.norm == "group":
        replace_batch_norms(model, spec.groups, spec.arch)
    return model


def replace_batch_norms(model, groups: int, name: str) -> int:
    """Every BatchNorm2d (and timm's BatchNormAct2d, activation kept) of `model` made a GroupNorm (GroupNormAct) of
    `groups` groups fitted to its channels, with its scale and shift; returns how many. ModelError where there is
    none or one is left that group norm cannot stand for."""
    import torch
    from timm.layers import BatchNormAct2d, GroupNormAct
    from torch import nn

    from .norms import fitted_groups

    replaced = 0
    for owner in list(model.modules()):
        for child_name, child in list(owner.named_children()):
            if type(child) is BatchNormAct2d:
                norm = GroupNormAct(child.num_features, num_groups=fitted_groups(groups, child.num_features),
                                    eps=child.eps, affine=child.affine, act_layer=None)
                norm.act, norm.drop = child.act, child.drop
            elif type(child) is nn.BatchNorm2d:
                norm = nn.GroupNorm(fitted_groups(groups, child.num_features), child.num_features, eps=child.eps,
                                    affine=child.affine)
            else:
                continue
            if child.affine:
                with torch.no_grad():
                    norm.weight.copy_(child.weight)
                    norm.bias.copy_(child.bias)
            setattr(owner, child_name, norm.to(child.weight.device if child.affine else "cpu"))
            replaced += 1
    left = sorted({type(m).__name__ for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)})
    if not replaced:
        raise ModelError(f"--group-norm replaces batch norms, and {name} has none (it normalises its own way): "
                         "train it with its own normalisation (--batch-norm)")
    if left:
        raise ModelError(f"--group-norm cannot replace the {', '.join(left)} of {name}: train it with its own "
                         "normalisation (--batch-norm)")
    return replaced


# ------------------------------------------------------------------------------------------------
# The model as a sequence of its modules: pipeline cuts and pieces


def _entries(model) -> list[str]:
    """The model's top-level modules in order, nn.Sequential containers opened one level (timm's
    feature extraction walks them so) unless the container is itself one of the model's stages (ResNet's
    layer1): 'stem', 'stages.0', 'stages.1', ...; 'conv1', ..., 'layer1', 'layer2', ..."""
    from torch import nn

    stages = set(_feature_modules(model))
    names = []
    for name, child in model.named_children():
        if isinstance(child, nn.Sequential) and len(child) and name not in stages:
            names += [f"{name}.{grandchild}" for grandchild, _ in child.named_children()]
        else:
            names.append(name)
    return names


@functools.lru_cache(maxsize=32)
def _sequence(spec) -> tuple[tuple[str, ...], tuple[str, ...], str | None]:
    """(the modules `forward_features` runs one after the other, those `forward_head` runs, why the forward is no
    such sequence or None), found on the meta device (no memory, no arithmetic) with a hook on each module."""
    import torch

    with torch.device("meta"):
        model = spec.family.build(spec).eval()
    entries = _entries(model)
    calls: list[tuple[str, Any, Any]] = []
    hooks = [model.get_submodule(name).register_forward_hook(
        lambda module, args, output, name=name: calls.append((name, args[0] if args else None, output)))
        for name in entries]
    try:
        with torch.no_grad():
            x = torch.zeros(1, 3, spec.image_size, spec.image_size, device="meta")
            features = model.forward_features(x)
            feature_calls, calls[:] = list(calls), []
            model.forward_head(features)
            head_calls = list(calls)
    except Exception as error:  # noqa: BLE001 - any failure means: not a sequence cnns can cut
        return (), (), f"its forward does not run on a probe ({type(error).__name__})"
    finally:
        for hook in hooks:
            hook.remove()
    names = [name for name, _, _ in feature_calls]
    if len(set(names)) != len(names):
        return (), (), "its forward_features runs a module twice"
    previous = x
    for name, given, output in feature_calls:
        if given is not previous:
            return (), (), f"its forward_features does not hand {name} the output of the module before it"
        previous = output
    if previous is not features:
        return (), (), "its forward_features ends after a step outside its modules"
    head = tuple(name for name, _, _ in head_calls)
    unused = [name for name in entries if name not in names and name not in head
              and any(True for _ in model.get_submodule(name).parameters())]
    if unused:
        return (), (), f"its forward runs {unused[0]} outside forward_features and forward_head"
    return tuple(names), head, None


def not_sequential_reason(spec) -> str | None:
    """Why `spec`'s model cannot be cut into pipeline pieces, or None."""
    return _sequence(spec)[2]


def _feature_modules(model) -> list[str]:
    info = getattr(model, "feature_info", None)
    if info is None:
        return []
    return [entry["module"] for entry in (info.info if hasattr(info, "info") else info)]


def cuts(spec, model) -> Iterator[tuple[str, list[str]]]:
    """The model's own stage boundaries (timm's feature_info modules) that its sequence of modules passes, in
    order; each named by its module name and 'stage<i>' (1-based, the order of the cuts)."""
    features, _, _ = _sequence(spec)
    boundaries = set(_feature_modules(model))
    stage = 0
    for name in features:
        if name in boundaries:
            stage += 1
            yield name, [name, f"stage{stage}"]


def pieces(spec, model, cut_ids: Sequence[str]) -> list[Piece]:
    """Each module of the sequence a piece (its own cut), then the head (`forward_head`)."""
    features, head, reason = _sequence(spec)
    if reason is not None:
        raise ModelError(f"{spec.arch} cannot be cut into pipeline stages or recomputed per stage: {reason}")
    units = [Piece(name, (name,), model.get_submodule(name)) for name in features]
    return [*units, Piece("head", head, model.forward_head)]


def recomputed(spec, model) -> list[str]:
    """Recomputation keeps the inputs of the model's stages (its feature_info modules that have parameters)."""
    return [cut for cut, _ in cuts(spec, model) if any(True for _ in model.get_submodule(cut).parameters())]


def timm_name(spec) -> tuple[str, dict[str, Any]]:
    if spec.norm == "group":
        raise ModelError(f"timm builds {spec.arch} with its own normalisation, not with the group norms of this run: "
                         "export a --batch-norm run as safetensors, or this one as onnx or pt2")
    return spec.arch, {}


def pretrained_cfg(name: str) -> dict[str, Any]:
    """timm's pretrained_cfg of the model `name` as a dict ({} where timm has none)."""
    import timm

    cfg = timm.models.get_pretrained_cfg(name)
    return {} if cfg is None else cfg.to_dict()


def evaluation(spec) -> dict[str, Any]:
    """timm's pretrained_cfg of the model: its evaluation interpolation, crop, mean and std."""
    cfg = pretrained_cfg(spec.arch)
    return {key: cfg[key] for key in ("interpolation", "crop_pct", "mean", "std", "first_conv") if key in cfg}


def _own(key: str, fallback: Any) -> PerModel:
    """The model's own pretrained_cfg `key` (`fallback` where its cfg has none)."""
    return PerModel("pretrained_cfg", lambda name: pretrained_cfg(name).get(key) or fallback)


TIMM = ModelFamily(
    key="timm", display="timm's models", build=build,
    names=list_models, knows=knows,
    prefix=lambda arch, size: arch,
    run_name="{prefix}_bs{bs}{replicas}{accum}{norm}_{precision}{sr}", own_norm_tag="",
    # Its own normalisation (--batch-norm) wherever it trains, and timm's input statistics (ImageNet's); on
    # ImageNet-sized data the evaluation resize and crop of its pretrained_cfg, as timm's eval transform
    # (timm.data.create_transform(**resolve_data_config(model=...))) prepares its images: on CIFAR-sized data no
    # resize or crop applies (the generic defaults: a 32-px image taken as it is).
    defaults={"norm": (FamilyDefault("batch"),), "normalise_input": (FamilyDefault(True),),
              "eval_interpolation": (FamilyDefault(_own("interpolation", "bicubic"), _ON_IMAGENET),),
              "eval_crop_pct": (FamilyDefault(_own("crop_pct", 0.875), _ON_IMAGENET),),
              # AdamW on CIFAR-sized data, at its own learning rate there (2^-14 x the batch): of SGD at the CIFAR
              # ResNets' 0.5 and AdamW at 2^-14 and 2^-12, the one that learnt the digits best in 2 epochs
              # (docs/models.md, "The timm family's optimiser defaults"). On ImageNet-sized data Graphcore's SGD
              # with the ImageNet ResNets' table (not measured here).
              "optimiser": (FamilyDefault("AdamW", _ON_CIFAR),)},
    optimiser_defaults=RESNET_OPTIMISER_DEFAULTS,
    cuts=cuts, pieces=pieces, recomputed=recomputed, timm_name=timm_name, first_conv="",
    evaluation=evaluation,
)
