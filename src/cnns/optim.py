"""The optimisers, each declared once in one registry, and `HalfPrecisionOptimiser` for 16.16.

**The registry.** Each optimiser is one `OptimiserInfo` (as timm declares its own in
`timm/optim/_optim_factory.py`): its name, its recipe (a maintained implementation's class, the parameter
groups and the arguments it is built with), the options it reads with their defaults and help, the defaults
it gives other options (its learning-rate exponent and weight decay per model family), its rules, its state
per parameter and how the run's header names it. Everything else reads the entries: the option table (the
`--optimiser` choices, each option's flag and help, which option is unused with which optimiser),
`cnns.config.defaults` (every default), `--print-config`, the memory estimate and the builders below. An
optimiser is added as its entry, at the end of "The entries", each said there in a line or two.

No optimiser decays parameters with one dimension or fewer: normalisation scales and shifts and every bias
(`parameter_groups`).

For 16.16 training (half-precision weights, no float32 master copy) any of them is wrapped in
:class:`HalfPrecisionOptimiser`, which keeps its state in float32 and rounds each update back to the half
type stochastically.

timm's optimisers are imported when one is built, not with this module: the option table reads the registry,
and `--help` or a configuration check should not wait for timm.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Union

import torch
from torch import Tensor, nn

from cnns.errors import ConfigError
from cnns.stochastic_rounding import HALF_TYPES, stochastic_round

# Key marking the parameter group of normalisation parameters and biases: no weight decay, and
# LARS leaves them out of the trust ratio (the original's --lars-skip-list 'beta', 'gamma', 'bias').
NORM_OR_BIAS = "norm_or_bias"

# --------------------------------------------------------------------------------------------
# The registry's parts: options, entries
# --------------------------------------------------------------------------------------------

# A default: one value for every run, a mapping (its value on CIFAR-sized data under "cifar", or none) where it
# differs by model family, or None (none). On ImageNet-sized data such a default is the model family's: its
# entry's table (`cnns.models.family.OptimiserDefaults`, which `cnns.config.defaults` reads), by optimiser name.
Default = Union[float, Mapping[str, float], None]
ON_CIFAR = "cifar"


def by_family(on_cifar: float | None = None) -> Mapping[str, float]:
    """A `Default` that differs by model family: `on_cifar` on CIFAR-sized data (any model), the model family's
    table's on ImageNet-sized data."""
    return MappingProxyType({} if on_cifar is None else {ON_CIFAR: on_cifar})


def default_in(default: Default, family: str) -> float | None:
    """The value of `default` for a run of the optimisers' `family` ("cifar", or a model family's table: there a
    per-family default is the table's, `cnns.config.defaults.optimiser_default`)."""
    return default.get(family) if isinstance(default, Mapping) else default


@dataclass(frozen=True)
class OptimiserOption:
    """An option some optimisers read (besides the learning rate, which every one reads): a float, spelled
    ``--`` + dest with dashes. `within`: the values it takes, an interval ("[0, 1)", "(0, inf)"; None: any).
    `default`: see `Default`. `derive`: its value computed from the other resolved options where it is not
    given, before `default` applies (None from it: nothing derived)."""

    dest: str
    help: str
    within: str | None
    default: Default = None
    derive: Callable[[Mapping[str, Any]], float | None] | None = None

    @property
    def flag(self) -> str:
        return "--" + self.dest.replace("_", "-")

    def check(self, value: float) -> None:
        """ConfigError naming the option when `value` is outside `within`."""
        if self.within is None:
            return
        low, high = (float(end) for end in self.within[1:-1].split(","))
        above = value > low if self.within[0] == "(" else value >= low
        below = value < high if self.within[-1] == ")" else value <= high
        if not (above and below):
            raise ConfigError(f"{self.flag} must be in {self.within}, got {value}")


# A recipe: (the optimiser's class, its parameter groups, its keyword arguments) from the parameter groups of
# `parameter_groups` (or one plain group) and the spec. `build_optimiser` builds it; --rts hands the same to
# torch's ZeroRedundancyOptimizer.
Recipe = Callable[[list[dict], "OptimiserSpec"], tuple[type, list[dict], dict[str, Any]]]


@dataclass(frozen=True)
class OptimiserInfo:
    """One optimiser, all that the rest of the package knows of it.

    * `name`: as ``--optimiser`` and arguments.json spell it (any case is accepted, and the `aliases`);
    * `recipe`: how it is built (`Recipe`), from a maintained implementation;
    * `shared`: the options of `SHARED_OPTIONS` it reads; `options`: the options only it reads, declared here;
    * `defaults`: its defaults of other options, which win over theirs (the learning-rate exponent
      ``base_learning_rate_exponent``, its weight decay), each a `Default`;
    * `rules`: applied to the resolved options once every default is in (values derived from others,
      refusals of what it cannot do), or None;
    * `state_per_parameter`: the tensors of a parameter's size it keeps (float32), for the memory estimate;
    * `summary`: how the run's header names it, a format string over the resolved options.
    """

    name: str
    recipe: Recipe
    state_per_parameter: int
    summary: str
    shared: tuple[str, ...] = ()
    options: tuple[OptimiserOption, ...] = ()
    defaults: Mapping[str, Default] = field(default_factory=dict)
    rules: Callable[[dict[str, Any]], None] | None = None
    aliases: tuple[str, ...] = ()

    @property
    def reads(self) -> tuple[str, ...]:
        """Every option it reads besides the learning rate."""
        return self.shared + tuple(option.dest for option in self.options)


# Graphcore's application's L2 decay on CIFAR-sized data (each model family's on ImageNet).
L2_DECAY = by_family(1e-6)

SHARED_OPTIONS: dict[str, OptimiserOption] = {option.dest: option for option in (
    OptimiserOption("momentum", "Momentum coefficient", "[0, 1)", 0.9),
    OptimiserOption("weight_decay", "Weight decay, never of normalisation parameters or biases", "[0, inf)",
                    L2_DECAY),
)}

OPTIMISERS: dict[str, OptimiserInfo] = {}  # by name, in the order registered (--help lists them so)
OPTIONS: dict[str, OptimiserOption] = dict(SHARED_OPTIONS)  # every optimiser option by dest
_BY_SPELLING: dict[str, str] = {}  # lower-case name or alias -> name


def register(info: OptimiserInfo) -> OptimiserInfo:
    """Add `info` to the registry; a name, alias or option that another entry has already is refused."""
    spellings = [info.name.lower(), *(alias.lower() for alias in info.aliases)]
    taken = [spelling for spelling in spellings if spelling in _BY_SPELLING]
    unknown = [dest for dest in info.shared if dest not in SHARED_OPTIONS]
    clashing = [option.dest for option in info.options if option.dest in OPTIONS]
    if taken or unknown or clashing:
        raise ValueError(f"optimiser {info.name}: names taken {taken}, unknown shared options {unknown}, "
                         f"options declared already {clashing}")
    OPTIMISERS[info.name] = info
    OPTIONS.update((option.dest, option) for option in info.options)
    _BY_SPELLING.update((spelling, info.name) for spelling in spellings)
    return info


def canonical_name(spelling: str) -> str | None:
    """The registered name `spelling` means (any case, or an alias), or None."""
    return _BY_SPELLING.get(str(spelling).lower())


def optimiser_info(name: str) -> OptimiserInfo:
    """The entry of optimiser `name` (any case, or an alias); ConfigError naming the choices."""
    canonical = canonical_name(name)
    if canonical is None:
        raise ConfigError(f"unknown optimiser {name!r}; choose one of {', '.join(OPTIMISERS)}")
    return OPTIMISERS[canonical]


def option_users() -> dict[str, tuple[str, ...]]:
    """Each optimiser option's dest -> the optimisers that read it, in the registry's order."""
    return {dest: tuple(name for name, info in OPTIMISERS.items() if dest in info.reads) for dest in OPTIONS}


@dataclass(frozen=True, init=False)
class OptimiserSpec:
    """The optimiser to build: its registered name, the learning rate and its options' values (`spec[dest]`).

    An option not given takes its default where that is one value, else it is None: `weight_decay` None
    decays nothing, `lars_weight_decay` None is `weight_decay` (the original's rule). A run's spec gives
    every option (`cnns.config.run.OptimConfig.settings`, resolved by `cnns.config.defaults`).
    """

    name: str
    lr: float
    settings: Mapping[str, float | None]

    def __init__(self, name: str, lr: float, **settings: float | None) -> None:
        info = optimiser_info(name)
        unknown = sorted(set(settings) - set(OPTIONS))
        if unknown:
            raise ConfigError(f"unknown optimiser options {unknown}; the options are {', '.join(OPTIONS)}")
        _require(lr >= 0, f"learning rate must be >= 0, got {lr}")
        values: dict[str, float | None] = {}
        for dest, option in OPTIONS.items():
            value = settings.get(dest)
            if value is None and not isinstance(option.default, Mapping):
                value = option.default
            if value is not None:
                option.check(value)
            values[dest] = value
        object.__setattr__(self, "name", info.name)
        object.__setattr__(self, "lr", lr)
        object.__setattr__(self, "settings", MappingProxyType(values))

    def __getitem__(self, dest: str) -> float | None:
        return self.settings[dest]

    @property
    def info(self) -> OptimiserInfo:
        return OPTIMISERS[self.name]


# --------------------------------------------------------------------------------------------
# The entries. Graphcore's application's four decay by an L2 term added to the gradient (g + wd * w).
# --------------------------------------------------------------------------------------------

# SGD: torch.optim.SGD without momentum (the seed's plain SGD).
def _sgd(groups: list[dict], spec: OptimiserSpec) -> tuple[type, list[dict], dict[str, Any]]:
    return torch.optim.SGD, groups, dict(lr=spec.lr, momentum=0.0, weight_decay=spec["weight_decay"] or 0.0)


register(OptimiserInfo(
    "SGD", _sgd, state_per_parameter=0, summary="SGD without momentum, weight decay {weight_decay:g}",
    shared=("weight_decay",),
    defaults={"base_learning_rate_exponent": by_family(-6.0)},
))


# momentum: torch.optim.SGD with momentum (TensorFlow's MomentumOptimizer has the same update:
# m = mu * m + g; w -= lr * m).
def _momentum(groups: list[dict], spec: OptimiserSpec) -> tuple[type, list[dict], dict[str, Any]]:
    return torch.optim.SGD, groups, dict(lr=spec.lr, momentum=spec["momentum"],
                                         weight_decay=spec["weight_decay"] or 0.0)


register(OptimiserInfo(
    "momentum", _momentum, state_per_parameter=1, summary="momentum {momentum:g}, weight decay {weight_decay:g}",
    shared=("momentum", "weight_decay"),
    defaults={"base_learning_rate_exponent": by_family(-6.0)},
))


# RMSprop: timm.optim.RMSpropTF, TensorFlow's RMSProp: epsilon inside the square root, the mean square
# initialised to 1, and the learning rate accumulated in the momentum buffer.
def _rmsprop(groups: list[dict], spec: OptimiserSpec) -> tuple[type, list[dict], dict[str, Any]]:
    from timm.optim import RMSpropTF

    return RMSpropTF, groups, dict(lr=spec.lr, alpha=spec["rmsprop_decay"], eps=spec["rmsprop_epsilon"],
                                   momentum=spec["momentum"], weight_decay=spec["weight_decay"] or 0.0,
                                   lr_in_momentum=True)


def _rmsprop_decay_from_exponent(o: Mapping[str, Any]) -> float | None:
    exponent = o.get("rmsprop_base_decay_exp")
    if exponent is None:
        return None
    try:
        decay = 1 - 2.0 ** exponent * o["global_batch_size"]
    except OverflowError:
        raise ConfigError(f"--rmsprop-base-decay-exp {exponent} is too large: 2^{exponent} overflows") from None
    if not 0 <= decay < 1:  # named as the exponent given, not as the decay it derives (which was not given)
        raise ConfigError(f"--rmsprop-base-decay-exp {exponent} gives the RMSprop decay 1 - 2^{exponent} x "
                          f"{o['global_batch_size']} = {decay:g}, outside --rmsprop-decay's [0, 1)")
    return decay


register(OptimiserInfo(
    "RMSprop", _rmsprop, state_per_parameter=2,  # TensorFlow's form: the mean square and the momentum
    summary="RMSprop with momentum {momentum:g}, weight decay {weight_decay:g}",
    shared=("momentum", "weight_decay"),
    options=(
        OptimiserOption("rmsprop_decay", "RMSprop decay", "[0, 1)", 0.9, derive=_rmsprop_decay_from_exponent),
        OptimiserOption("rmsprop_base_decay_exp", "RMSprop decay = 1 - 2^N x global batch size, where "
                        "--rmsprop-decay is not given", None),
        OptimiserOption("rmsprop_epsilon", "RMSprop epsilon, inside the square root", "[0, inf)", 0.001),
    ),
    defaults={"base_learning_rate_exponent": by_family(-6.0),
              "rmsprop_base_decay_exp": by_family()},
))


# LARS: timm.optim.Lars with the original's trust ratio eeta * ||w|| / (||g|| + wd * ||w|| + eps), norm
# parameters and biases left out of it (the original's --lars-skip-list).
def _lars(groups: list[dict], spec: OptimiserSpec) -> tuple[type, list[dict], dict[str, Any]]:
    """Per-group LARS switches: timm's Lars reads ``weight_decay`` and ``always_adapt`` per group. Groups
    marked ``NORM_OR_BIAS`` get neither trust ratio nor decay (plain momentum SGD, as the original's skip
    list); every other group gets the trust ratio and ``lars_weight_decay`` in place of its own decay. With
    ``weight_decay`` 0 and ``always_adapt`` False, timm skips the trust ratio entirely; with ``always_adapt``
    True it applies it even when the LARS decay is 0, as the original did."""
    from timm.optim import Lars

    decay = spec["weight_decay"] if spec["lars_weight_decay"] is None else spec["lars_weight_decay"]
    lars_groups = []
    for group in groups:
        skipped = bool(group.get(NORM_OR_BIAS, False))
        lars_groups.append({**group, "weight_decay": 0.0 if skipped else (decay or 0.0), "always_adapt": not skipped})
    return Lars, lars_groups, dict(lr=spec.lr, momentum=spec["momentum"], trust_coeff=spec["lars_eeta"],
                                   eps=spec["lars_epsilon"])


def _lars_rules(o: dict[str, Any]) -> None:
    if not o.get("lars_weight_decay"):  # the original's rule: no LARS decay of its own is --weight-decay's
        o["lars_weight_decay"] = o["weight_decay"]


register(OptimiserInfo(
    "LARS", _lars, state_per_parameter=1,  # a momentum buffer
    summary="LARS with momentum {momentum:g}, weight decay {lars_weight_decay:g}",
    shared=("momentum",),  # it decays by --lars-weight-decay
    options=(
        OptimiserOption("lars_eeta", "LARS trust coefficient", "(0, inf)", 0.001),
        OptimiserOption("lars_epsilon", "LARS epsilon", "[0, inf)", 0.0),
        OptimiserOption("lars_weight_decay", "LARS weight decay (0: --weight-decay's)", "[0, inf)", L2_DECAY),
    ),
    defaults={"base_learning_rate_exponent": by_family(-6.0),
              "weight_decay": 0.0},
    rules=_lars_rules,
))


# AdamW: torch.optim.AdamW with torch's betas and epsilon; its weight decay is decoupled from the gradient
# (w -= lr * wd * w beside the Adam step), never of norm parameters or biases.
ADAMW_BETAS, ADAMW_EPSILON = (0.9, 0.999), 1e-8


def _adamw(groups: list[dict], spec: OptimiserSpec) -> tuple[type, list[dict], dict[str, Any]]:
    return torch.optim.AdamW, groups, dict(lr=spec.lr, betas=ADAMW_BETAS, eps=ADAMW_EPSILON,
                                           weight_decay=spec["weight_decay"] or 0.0)


register(OptimiserInfo(
    "AdamW", _adamw, state_per_parameter=2,  # the moving averages of the gradient and of its square
    summary=f"AdamW (betas {ADAMW_BETAS[0]:g}, {ADAMW_BETAS[1]:g}), decoupled weight decay {{weight_decay:g}}",
    shared=("weight_decay",),
    # The learning rate about 2e-3 at the quick start's batch of 32, 1e-3 at ImageNet's 256; torch's weight decay.
    defaults={"base_learning_rate_exponent": by_family(-14.0),
              "weight_decay": 0.01},
))


# LAMB: timm.optim.Lamb with timm's defaults: an Adam step (betas 0.9, 0.999, epsilon 1e-6, on the gradient clipped
# to a global norm of 1) plus the L2 decay, scaled by the layer's trust ratio ||w|| / ||step||. As timm groups
# them, norm parameters and biases (no decay) take the Adam step without the ratio (and with --weight-decay 0 no
# layer takes it: timm's rule).
LAMB_BETAS, LAMB_EPSILON, LAMB_MAX_GRAD_NORM = (0.9, 0.999), 1e-6, 1.0


def _lamb(groups: list[dict], spec: OptimiserSpec) -> tuple[type, list[dict], dict[str, Any]]:
    from timm.optim import Lamb

    return Lamb, groups, dict(lr=spec.lr, betas=LAMB_BETAS, eps=LAMB_EPSILON, max_grad_norm=LAMB_MAX_GRAD_NORM,
                              weight_decay=spec["weight_decay"] or 0.0)


def _lamb_rules(o: dict[str, Any]) -> None:
    """The norm the gradient is clipped by is the whole model's: refused where a process steps only a part of
    the model (a pipeline stage, a replica owning a shard of the state with --rts)."""
    if o.get("pipeline") or (o.get("rts") and o.get("replicas") != 1):
        raise ConfigError("--optimiser LAMB clips the gradient by the whole model's norm, which a pipeline stage or "
                          "an --rts shard does not see: train it without --pipeline and --rts")


register(OptimiserInfo(
    "LAMB", _lamb, state_per_parameter=2,  # the moving averages of the gradient and of its square
    summary=f"LAMB (betas {LAMB_BETAS[0]:g}, {LAMB_BETAS[1]:g}, gradient norm clipped to {LAMB_MAX_GRAD_NORM:g}), "
            "weight decay {weight_decay:g}",
    shared=("weight_decay",),
    # The learning rate (a step of about lr ||w|| per layer) about 8e-3 at the quick start's batch of 32 and at
    # ImageNet's 2048 (timm's ResNet recipe: 5e-3 at 2048); timm's Lamb's weight decay.
    defaults={"base_learning_rate_exponent": by_family(-12.0),
              "weight_decay": 0.01},
    rules=_lamb_rules,
))

# --------------------------------------------------------------------------------------------
# Building one
# --------------------------------------------------------------------------------------------


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two parameter groups: decayed weights, and normalisation parameters plus biases.

    A parameter with ``ndim <= 1`` is a bias or a normalisation scale/shift; decaying those only
    fights the normalisation, so its group has ``weight_decay`` 0 and is marked ``NORM_OR_BIAS``.
    Frozen parameters (``requires_grad=False``) are left out. Both groups are always returned (one may
    be empty) so that optimiser checkpoints have a fixed layout.
    """
    decayed: list[nn.Parameter] = []
    norm_or_bias: list[nn.Parameter] = []
    for param in model.parameters():
        if param.requires_grad:
            (norm_or_bias if param.ndim <= 1 else decayed).append(param)
    return [
        {"params": decayed, "weight_decay": weight_decay, NORM_OR_BIAS: False},
        {"params": norm_or_bias, "weight_decay": 0.0, NORM_OR_BIAS: True},
    ]


def parameter_names(model: nn.Module) -> list[str]:
    """The names of the parameters an optimiser over `parameter_groups(model)` holds, in its order
    (how its state dict numbers them)."""
    names = {id(param): name for name, param in model.named_parameters()}
    return [names[id(param)] for group in parameter_groups(model, 0.0) for param in group["params"]]


def build_optimiser(params_or_groups: Iterable, spec: OptimiserSpec) -> torch.optim.Optimizer:
    """The optimiser ``spec`` names, over ``params_or_groups``.

    Groups keep their own ``weight_decay`` (see :func:`parameter_groups`); plain parameters get
    ``spec["weight_decay"]``. ``foreach`` is left to the implementations, which use the multi-tensor kernels
    wherever they exist (CUDA). On the CPU the per-parameter loop is faster than foreach=True
    (docs/performance.md): each parameter's few operations run while it is still in cache, where a foreach
    operation sweeps all of them each time.
    """
    cls, groups, arguments = optimiser_recipe(params_or_groups, spec)
    return cls(groups, **arguments)


def build_sharded_optimiser(params_or_groups: Iterable, spec: OptimiserSpec, group=None) -> torch.optim.Optimizer:
    """--rts: the same optimiser with its state sharded over the replicas (ZeRO stage 1).

    torch's ZeroRedundancyOptimizer gives each process whole parameters to own (about 1/R of the
    state), steps only those and broadcasts the results. Its consolidated state dict
    (`consolidate_state_dict` on every process, then `state_dict` on rank 0) has the plain
    optimiser's layout, so a checkpoint restores at any replica count.
    """
    from torch.distributed.optim import ZeroRedundancyOptimizer

    cls, groups, arguments = optimiser_recipe(params_or_groups, spec)
    return ZeroRedundancyOptimizer(groups, optimizer_class=cls, process_group=group, **arguments)


def optimiser_recipe(params_or_groups: Iterable, spec: OptimiserSpec) -> tuple[type, list[dict], dict[str, Any]]:
    """(optimiser class, parameter groups, keyword arguments) of the optimiser ``spec`` names: its entry's
    recipe."""
    return spec.info.recipe(_as_groups(params_or_groups), spec)


def _as_groups(params_or_groups: Iterable) -> list[dict]:
    items = list(params_or_groups)
    if not items:
        raise ConfigError("the optimiser got no parameters")
    if all(isinstance(item, dict) for item in items):
        return [dict(group) for group in items]
    if any(isinstance(item, dict) for item in items):
        raise ConfigError("pass either parameters or parameter groups to the optimiser, not a mixture")
    return [{"params": items}]


def set_lr(optimiser: Any, lr: float) -> None:
    """Set the learning rate of every parameter group (the schedule drives it step by step)."""
    for group in optimiser.param_groups:
        group["lr"] = lr


# --------------------------------------------------------------------------------------------
# 16.16: half-precision weights, updated through float32 and rounded back (`cnns.stochastic_rounding`)
# --------------------------------------------------------------------------------------------


class HalfPrecisionOptimiser:
    """Wraps an optimiser for models whose parameters are half precision (16.16).

    Keeps float32 working copies of the half parameters, re-read from the half weights before every
    step so the half weights stay the only truth (IPU 16.16 has no master copy); hands float32
    gradients to the inner torch optimiser (whose state, e.g. momentum, stays float32); and writes
    the result back with stochastic rounding (round-to-nearest when ``stochastic_rounding=False``).

    Gradients: by default each parameter's ``.grad``. A training loop that accumulates micro-batch
    gradients in float32 itself passes them to :meth:`step` instead, one per parameter in the order of
    :attr:`params` (``None`` for a parameter to leave untouched). Half gradients are converted here.

    Parameters that are already float32 are optimised in place, without copies or rounding.
    ``param_groups`` is the inner optimiser's, so :func:`set_lr` works on the wrapper.

    Speed (the update runs over every weight at every step): the working copies of the half
    parameters are views of one flat float32 buffer, laid out like the parameters (channels_last
    convolution weights included), so reading the weights in, converting the gradients and rounding
    back are a few multi-tensor or whole-buffer operations in memory order, rather than several small
    operations per parameter, each paying its own dispatch and a fresh pass over memory.
    The inner optimiser sees one tensor per parameter (LARS needs per-layer norms); its state dict
    has the usual layout.
    """

    def __init__(
        self,
        half_params_or_groups: Iterable,
        make_inner: Callable[[list], torch.optim.Optimizer],
        *,
        stochastic_rounding: bool,
        seed: int,
        offload_to: torch.device | None = None,
    ) -> None:
        groups = _as_groups(half_params_or_groups)
        self.params: list[Tensor] = [p for group in groups for p in group["params"]]
        for param in self.params:
            if param.dtype != torch.float32 and param.dtype not in HALF_TYPES:
                raise ConfigError(
                    f"half-precision optimiser expects bfloat16, float16 or float32 parameters, got {param.dtype}")
        devices = {p.device for p in self.params}
        if len(devices) > 1:
            raise ConfigError(f"half-precision parameters must share one device, found {sorted(map(str, devices))}")
        param_device = devices.pop() if devices else torch.device("cpu")
        # --offload-optimiser: every parameter gets a float32 working copy in host memory, where the
        # inner optimiser and its state live; gradients come over, updated weights go back.
        self.offloaded = offload_to is not None
        copied = (*HALF_TYPES, torch.float32) if self.offloaded else HALF_TYPES
        device = offload_to if self.offloaded else param_device
        # Flat layout: the copied parameters grouped by dtype, in parameter order within each dtype, so
        # any run of consecutive parameters is one stretch of the buffer per dtype.
        self._offsets: dict[int, int] = {}
        offset = 0
        for dtype in copied:
            for i, param in enumerate(self.params):
                if param.dtype == dtype:
                    self._offsets[i] = offset
                    offset += param.numel()
        # Offloaded from a GPU: pinned, as gradients and weights cross to and from it every update.
        self._flat = torch.empty(offset, dtype=torch.float32, device=device,
                                 pin_memory=self.offloaded and param_device.type == "cuda")
        self._flat_grad: Tensor | None = None  # made on first use: callers passing float32 gradients never need it
        self._working: list[Tensor] = list(self.params)  # float32 tensor the inner optimiser updates
        for i, start in self._offsets.items():
            view = in_layout_of(self._flat[start:start + self.params[i].numel()], self.params[i])
            view.copy_(self.params[i].detach())
            self._working[i] = view
        by_param = {id(p): w for p, w in zip(self.params, self._working)}
        working_groups = [{**group, "params": [by_param[id(p)] for p in group["params"]]} for group in groups]
        # One stretch of the buffer per half dtype: (dtype, parameter indices in order, start, end).
        self._segments: list[tuple[torch.dtype, list[int], int, int]] = []
        for dtype in copied:
            indices = [i for i in self._offsets if self.params[i].dtype == dtype]
            if indices:
                end = self._offsets[indices[-1]] + self.params[indices[-1]].numel()
                self._segments.append((dtype, indices, self._offsets[indices[0]], end))
        self.stochastic_rounding = stochastic_rounding
        self._generator = torch.Generator(device=device)
        self._generator.manual_seed(seed)
        self.streams_restarted = False  # set by load_state_dict
        self.inner = make_inner(working_groups)

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    @torch.no_grad()
    def step(self, grads: Sequence[Tensor | None] | None = None) -> None:
        """One update. ``grads``: gradients aligned with :attr:`params`, or None for ``.grad``."""
        if grads is not None and len(grads) != len(self.params):
            raise ValueError(f"expected {len(self.params)} gradients, got {len(grads)}")
        convert_to, convert_from = [], []
        for i, (param, working) in enumerate(zip(self.params, self._working)):
            grad = param.grad if grads is None else grads[i]
            if working is param:
                param.grad = grad
            elif grad is None or (grad.dtype == torch.float32 and grad.device == working.device):
                working.grad = grad
            else:
                working.grad = self._grad_view(i)
                convert_to.append(working.grad)
                convert_from.append(grad)
        if convert_to:
            torch._foreach_copy_(convert_to, convert_from)
        for dtype, indices, _, _ in self._segments:
            if dtype == torch.float32:
                continue  # an offloaded float32 weight: the host copy is the truth, the device's a copy of it
            # The half weight is the truth: drop the previous update's rounding residue.
            torch._foreach_copy_([self._working[i] for i in indices], [self.params[i] for i in indices])
        self.inner.step()
        # One rounding over each dtype's whole buffer. Parameters without a gradient were not
        # moved, and rounding a representable value (their working copy) returns it unchanged.
        for dtype, indices, start, end in self._segments:
            rounded = self._round(self._flat[start:end], dtype)
            sizes = [self.params[i].numel() for i in indices]
            pieces = [in_layout_of(part, self.params[i]) for part, i in zip(rounded.split(sizes), indices)]
            torch._foreach_copy_([self.params[i] for i in indices], pieces)

    def _grad_view(self, i: int) -> Tensor:
        if self._flat_grad is None:
            self._flat_grad = torch.empty_like(self._flat)
        start = self._offsets[i]
        return in_layout_of(self._flat_grad[start:start + self.params[i].numel()], self.params[i])

    def _round(self, value: Tensor, dtype: torch.dtype) -> Tensor:
        if self.stochastic_rounding and dtype in HALF_TYPES:
            return stochastic_round(value, dtype, self._generator)
        return value.to(dtype)  # round to nearest even

    def zero_grad(self, set_to_none: bool = True) -> None:
        # Float32 parameters are their own working copy; the identity check avoids zeroing twice.
        tensors = self.params + [w for w, p in zip(self._working, self.params) if w is not p]
        for tensor in tensors:
            if tensor.grad is None:
                continue
            if set_to_none:
                tensor.grad = None
            else:
                tensor.grad.zero_()

    def owned_elements(self) -> tuple[int, int]:
        """(parameter elements whose optimiser state this process holds, all of them): equal unless
        the inner optimiser is sharded (--rts)."""
        total = sum(p.numel() for p in self._working)
        local = getattr(self.inner, "optim", None)  # ZeroRedundancyOptimizer's own partition
        if local is None:
            return total, total
        return sum(p.numel() for group in local.param_groups for p in group["params"]), total

    def consolidate(self) -> None:
        """Gather a sharded (--rts) inner optimiser's state on rank 0; call on every process before
        rank 0's `state_dict`. Nothing to do for an unsharded one."""
        if hasattr(self.inner, "consolidate_state_dict"):
            self.inner.consolidate_state_dict(to=0)

    def state_dict(self) -> dict:
        """Inner optimiser state plus the rounding generator, so a restored run is bitwise identical."""
        return {
            "inner": self.inner.state_dict(),
            "rounding_generator": self._generator.get_state(),
            "stochastic_rounding": self.stochastic_rounding,
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """The inner state and the rounding generator's. A generator of another device kind (a CUDA run's
        Philox state on a CPU, or the reverse) cannot take the saved state: it restarts from a seed
        derived from it, and `streams_restarted` says so (exactness is for the same device kind)."""
        self.inner.load_state_dict(state_dict["inner"])
        self.streams_restarted = not set_or_derive_generator_state(self._generator, state_dict["rounding_generator"])
        self.stochastic_rounding = state_dict["stochastic_rounding"]


def set_or_derive_generator_state(generator: torch.Generator, state: Tensor) -> bool:
    """Load a saved generator state; when it is another device kind's (it has another size), seed the
    generator from the saved bytes instead, so the stream is still a function of the checkpoint.
    True when the state itself was loaded."""
    try:
        generator.set_state(state)
        return True
    except RuntimeError:
        import hashlib

        digest = hashlib.sha256(state.cpu().contiguous().numpy().tobytes()).digest()
        generator.manual_seed(int.from_bytes(digest[:8], "little"))
        return False


def in_layout_of(flat: Tensor, like: Tensor) -> Tensor:
    """`flat` (1-D, numel of `like`) viewed with `like`'s shape and memory order: element k of `flat` is the
    k-th element of `like` in memory, as DDP's gradient buckets and this module's flat buffers store them.

    Convolution weights are channels_last: a working copy, gradient or rounded result laid out the same
    way makes every copy between them a straight pass in memory order (a copy that also permutes the
    layout measured several times slower). Reading such a buffer as if it were contiguous
    (``flat.view(like.shape)``) silently permutes the elements: torch's own ``GradBucket.gradients()`` does
    that (torch 2.14.1), which is why the float32 all-reduce hook reads its buckets through this function.
    A tensor whose elements do not tile their memory (expanded, overlapping) is read as contiguous, as DDP
    then lays it out.
    """
    if _dense_in_memory(like):
        return flat.as_strided(like.shape, like.stride())
    return flat.view(like.shape)


def _dense_in_memory(tensor: Tensor) -> bool:
    """Whether `tensor`'s elements fill numel() consecutive places of memory, each once, in some order of its
    dimensions (contiguous, channels_last or any permutation): `torch._prims_common.is_non_overlapping_and_dense`,
    which is private."""
    expected = 1
    for size, stride in sorted(zip(tensor.shape, tensor.stride()), key=lambda d: d[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)
