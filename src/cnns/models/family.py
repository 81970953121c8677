"""A model family: one `ModelFamily` entry that declares everything the rest of the package asks of it.

timm registers each model once (``@register_model``) and builds it by name (``create_model``); torchtitan
registers a whole recipe (``register_train_spec``). cnns does the same for its model families: an entry says how
the family is built, the sizes (or names) it takes, how messages and run names call it, its defaults (options,
and the optimisers' learning-rate exponents and weight decay on ImageNet-sized data), where a pipeline may cut
it, and what an export writes for it. The option table (`--model` choices and help), the defaults and --help
(`cnns.config.defaults`), the checks, the run name, the header, the memory estimate, `cnns splits`, the
initial weights and `cnns export` read the entry; nothing outside `cnns.models` spells a family's name.

The entries are registered in `cnns.models.families`, one line each, which also looks them up: by the --model
value: a key (``resnet``) or, for an entry that takes `names` (the generic timm one), a name it knows. This
module imports neither timm nor a family's builder: the option table reads the entries before any model is
built, and timm costs seconds of start-up.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any  # ModelSpec and Piece: annotations only (no import circle)

if TYPE_CHECKING:
    from torch import nn


@dataclass(frozen=True)
class PerModel:
    """A family default that each of its models gives itself (a named family's: timm's models' own pretrained_cfg):
    `of` maps the --model value to the value; `said` is how --help states it (one word)."""

    said: str
    of: Callable[[str], Any]

    def __str__(self) -> str:
        return self.said


@dataclass(frozen=True)
class FamilyDefault:
    """A default the family gives an option: `value` on CIFAR-sized data (`cifar_sized` True), on ImageNet-sized
    data (False) or on either (None), for the family's `size` only where one is named. The data's size, not a
    dataset's name: which datasets are CIFAR-sized is cnns.data.formats' to say. A family's defaults for
    one option apply in their order (the last that holds a run gives its default), after the generic ones of
    `cnns.config.defaults`."""

    value: Any  # or a `PerModel`, the run's model's own
    cifar_sized: bool | None = None
    size: str | None = None


@dataclass(frozen=True)
class OptimiserDefaults:
    """The optimisers' defaults on ImageNet-sized data for the families that share this table (on CIFAR-sized
    data every family takes the optimisers' own, `cnns.optim`, and a family may choose the optimiser there with a
    `FamilyDefault` of ``optimiser``): option dest -> {optimiser name: value}, with ``"*"`` for an option's own
    default (the weight decay every optimiser reads unless it gives its own). `name` is how --help and
    `cnns.config.defaults.family` tell the tables apart."""

    name: str
    values: Mapping[str, Mapping[str, float]]

    def value(self, dest: str, optimiser: str | None) -> float | None:
        """The table's default of `dest` for `optimiser` (None: the option's own default)."""
        return self.values.get(dest, {}).get("*" if optimiser is None else optimiser)


# Cuts: (cut id, the split names that name it) in model order; pieces: the model as `Piece`s with the given cuts.
Cuts = Callable[["ModelSpec", "nn.Module"], Iterator[tuple[str, list[str]]]]
Pieces = Callable[["ModelSpec", "nn.Module", Sequence[str]], list["Piece"]]


@dataclass(frozen=True)
class ModelFamily:
    """One model family, all the rest of the package knows of it.

    * `key`: the --model value (and arguments.json's ``model``); `display`: how messages name it ("ResNet");
    * `build`: ModelSpec -> a freshly initialised nn.Module mapping images to logits (imports what it needs);
    * `sizes`: the sizes it takes on CIFAR-sized (True) or ImageNet-sized inputs (`normalise_size` spells one);
      None for an entry that takes `names` instead (a family of named models: `names()` lists them, `knows` says
      whether it builds one, and --model takes the name itself);
    * `prefix`: (--model, size) -> the model tag of run names ("RN20", "EfficientNet-B0");
    * `run_name`: the run name's form after the tag, over ``bs``, ``accum``, ``replicas``, ``norm`` (_BN,
      _GN<groups>), ``precision`` and ``sr`` (_noSR or nothing); `own_norm_tag`: the norm tag of --batch-norm;
    * `defaults`: option dest -> its `FamilyDefault`s (``optimiser`` among them); `optimiser_defaults`: its
      `OptimiserDefaults` table;
    * `option_fields`: options that set a ModelSpec field of another name (ResNeXt's --group-dim, its group
      width), besides the model options that set their own (`cnns.config.run`); `option_help`: what each model
      option it reads means for it (--help);
    * `cuts`, `pieces`: where a pipeline may cut it and the model as pieces (`cnns.models.split_points`);
      `recomputed`: the cut ids whose modules recomputation keeps the inputs of (default: the cuts whose id
      names a module, less the stem);
    * `timm_name`: (spec) -> (timm's model name, arguments) under which timm builds the same model, for
      `cnns export --format safetensors`, or raises ModelError saying why there is none; `first_conv`: the
      stem convolution's module name (timm's pretrained_cfg);
    * `check`: (spec) -> raises ModelError for a combination it cannot build (None: any);
    * `evaluation`: (spec) -> the evaluation preprocessing of the model (timm's pretrained_cfg), or None.
    """

    key: str
    display: str
    build: Callable[["ModelSpec"], "nn.Module"]
    prefix: Callable[[str, str], str]
    run_name: str
    cuts: Cuts
    pieces: Pieces
    timm_name: Callable[["ModelSpec"], tuple[str, dict[str, Any]]]
    first_conv: str = "conv1"
    sizes: Callable[[bool], Sequence[str]] | None = None
    normalise_size: Callable[[str], str] = str
    names: Callable[[str], list[str]] | None = None
    knows: Callable[[str], bool] | None = None
    own_norm_tag: str = "_BN"
    defaults: Mapping[str, tuple[FamilyDefault, ...]] = field(default_factory=dict)
    optimiser_defaults: OptimiserDefaults | None = None
    option_fields: Mapping[str, str] = field(default_factory=dict)
    option_help: Mapping[str, str] = field(default_factory=dict)
    recomputed: Callable[["ModelSpec", "nn.Module"], list[str]] | None = None
    check: Callable[["ModelSpec"], None] | None = None
    evaluation: Callable[["ModelSpec"], Mapping[str, Any] | None] | None = None

    @property
    def named(self) -> bool:
        """Whether --model takes the names of its models (timm's) rather than its key."""
        return self.sizes is None

    def display_name(self, arch: str, size: str) -> str:
        """'ResNet-50', 'EfficientNet-B4'; a named model's own name ('convnext_atto')."""
        return arch if self.named else f"{self.display}-{size}"


FAMILIES: dict[str, ModelFamily] = {}  # by key, in the order registered (--help lists them so)


def register_family(family: ModelFamily) -> ModelFamily:
    """Add `family` to the registry (a key taken already is refused); returns it."""
    if family.key in FAMILIES:
        raise ValueError(f"model family {family.key!r} is registered already")
    if family.named and (family.names is None or family.knows is None):
        raise ValueError(f"model family {family.key!r}: an entry without sizes needs names and knows")
    FAMILIES[family.key] = family
    return family


def unregister_family(key: str) -> None:
    """Remove a family (a test's own, registered for the test)."""
    FAMILIES.pop(key, None)


