"""The model families, one registry line each (`cnns.models.family.register_family`), in the order --help lists
them, and their look-up by the --model value. A family is added as its entry (a module beside this one) and its
line here."""

from __future__ import annotations

import difflib

from .efficientnet_family import EFFICIENTNET
from .family import FAMILIES, ModelFamily, register_family
from .model_error import ModelError
from .resnet_family import RESNET, RESNEXT
from .timm_family import TIMM

register_family(RESNET)
register_family(RESNEXT)
register_family(EFFICIENTNET)
register_family(TIMM)  # timm's image classifiers by their timm names (after the keys: a key is never a name)


def default_family() -> ModelFamily:
    """The family a run without --model trains: Graphcore's application's, the ResNets."""
    return RESNET


def _registered() -> dict[str, ModelFamily]:
    return FAMILIES


def registered_families() -> list[ModelFamily]:
    return list(_registered().values())


def family_keys() -> tuple[str, ...]:
    """The families taken by key (--model's fixed choices), in registry order."""
    return tuple(key for key, family in _registered().items() if not family.named)


def family_of(model: str) -> ModelFamily:
    """The family of the --model value `model`: the entry of that key, else the named family that knows it;
    ModelError with the nearest names where none does."""
    families = _registered()
    name = str(model).lower()
    if name in families and not families[name].named:
        return families[name]
    for family in families.values():
        if family.named and family.knows(name):
            return family
    raise ModelError(unknown_model_message(name))


def unknown_model_message(name: str) -> str:
    """One line: the name is none, and the nearest names (difflib) among the keys and every named model."""
    candidates = list(family_keys())
    for family in _registered().values():
        if family.named:
            candidates += family.names("*")
    nearest = difflib.get_close_matches(name, candidates, n=5, cutoff=0.6)
    hint = f"; nearest: {', '.join(nearest)}" if nearest else ""
    return (f"unknown model {name!r}{hint} (the families {', '.join(family_keys())}, or a timm model name: "
            f"`cnns models PATTERN` lists them)")


def model_names(pattern: str = "*") -> list[str]:
    """The names --model takes matching the fnmatch `pattern` (timm's list_models): the family keys, then each
    named family's models."""
    from fnmatch import fnmatchcase

    names = [key for key in family_keys() if fnmatchcase(key, pattern)]
    for family in _registered().values():
        if family.named:
            names += family.names(pattern)
    return names
