"""Graphcore's application's default rules: a parsed command line becomes every option, filled and checked.

Every default is applied here: the generic ones, the dataset's and the model's, the device's
(`device_defaults`, given the device's facts) and the random seed (`draw_seed`). Each is declared once, in
`GENERIC_DEFAULTS` or, where it differs by dataset, model or another option, in `by_run()`: the generic ones here
and each model family's in its entry (`cnns.models.family`); the optimisers' own in their registry, `cnns.optim`,
and on ImageNet-sized data in the model family's table. `stated_default` says them in --help from there. Resolution follows
Graphcore's application: a named configuration from ``configs.yml`` supplies defaults, the command
line overrides them, then the dataset- and model-dependent defaults fill whatever is still unset, and
derived values (global batch size, learning rate, run name) are computed. The result is a flat dict of
Graphcore's application's option names: what ``arguments.json`` and ``--print-config`` show, and what ``restore.py``
reads back. `cnns.config.run.RunConfig` is the frozen, typed form the rest of the package reads.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cnns import optim
from cnns.bounded_reads import DEFAULT_FILE_SIZE_LIMIT
from cnns.config.config_files import check_domains
from cnns.config.table import FLOAT32_MAX, FLOAT32_TINY, byte_size
from cnns.data.formats import DATASETS, dataset_facts, dataset_named_in_path
from cnns.errors import ConfigError
from cnns.models.families import default_family, family_of, registered_families
from cnns.models.family import ModelFamily, OptimiserDefaults, PerModel
from cnns.models.model_spec import ModelError
from cnns.precision import FLOAT32_PRECISION, HALF_PRECISION
# Graphcore's application's exponential schedule: the learning rate times 0.97, 146 times over the run (these
# defaults are stated only here: RunConfig and cnns.lr_schedules take them from the resolved options).
EXPONENTIAL_DECAY_RATE = 0.97
EXPONENTIAL_DROPS = 146

# ----------------------------------------------------------------------------------------------
# dataset- and model-dependent defaults (Graphcore's application's set_defaults functions)


def _dataset_defaults(o: dict[str, Any]) -> None:
    if o.get("generated_data") or o.get("synthetic_data"):
        if not o.get("dataset"):
            raise ConfigError("please name the generated or synthetic dataset with --dataset")
        o["mixup_alpha"], o["cutmix_lambda"] = 0.0, 1.0  # mixing means nothing on random data
        return
    if not o.get("data_dir"):
        own_folder = DATASETS[o["dataset"]].default_data_dir if o.get("dataset") else None
        if own_folder:
            o["data_dir"] = own_folder
        elif os.environ.get("DATA_DIR"):
            o["data_dir"] = os.environ["DATA_DIR"]
        else:
            raise ConfigError("cannot find CIFAR/ImageNet data: set the DATA_DIR environment variable or use --data-dir")
    if not o.get("dataset"):
        o["dataset"] = dataset_named_in_path(o["data_dir"])  # else decided from the folder's contents


def cifar_sized(o: Mapping[str, Any]) -> bool:
    """Whether the run's data is CIFAR-sized, or not known yet (a dataset not known yet has CIFAR's defaults)."""
    return dataset_facts(o.get("dataset")).cifar_sized


def _set_if_unset(o: dict[str, Any], key: str, value: Any) -> None:
    if o.get(key) is None:
        o[key] = value


# ----------------------------------------------------------------------------------------------
# Defaults that differ by model, dataset or another option, declared once: `resolve` applies them and
# `--help` states them (`stated_default`).


@dataclass(frozen=True)
class Runs:
    """The runs a default is given for: those of the model families `models` (their keys; None: any), on
    CIFAR-sized data (`cifar_sized` True: or data not yet known, whose model defaults are CIFAR's) or on
    ImageNet-sized data (False; None: either), of model `size`, and whose resolved `options` have these values."""

    models: tuple[str, ...] | None = None
    cifar_sized: bool | None = None
    size: str | None = None
    options: tuple[tuple[str, Any], ...] = ()

    def hold(self, o: Mapping[str, Any]) -> bool:
        """Whether the run of the resolved options `o` is one of these."""
        return ((self.models is None or family_key(o.get("model")) in self.models)
                and (self.cifar_sized is None or self.cifar_sized == cifar_sized(o))
                and (self.size is None or str(o.get("model_size")) == self.size)
                and all(o.get(dest) == value for dest, value in self.options))

    @property
    def phrase(self) -> str:
        """How --help names them: "for ResNeXt on CIFAR-sized data", "with --half-dtype float16"."""
        words = []
        if self.models is not None:
            displays = {family.key: family.display for family in registered_families()}
            names = [displays[model] + (f"-{self.size}" if self.size else "") for model in self.models]
            words.append("for " + " and ".join(names))
        if self.cifar_sized is not None:
            words.append("on CIFAR-sized data" if self.cifar_sized else "on ImageNet")
        if self.options:
            words.append("with " + " and ".join(f"--{dest.replace('_', '-')} {value}" for dest, value in self.options))
        return " ".join(words)


def family_key(model: Any) -> str | None:
    """The key of the family of the --model value `model` (`cnns.models.family`), or None for none."""
    try:
        return family_of(model).key
    except ModelError:
        return None


def model_family(o: Mapping[str, Any]) -> ModelFamily:
    """The entry of the run's model family; ConfigError in one line (with the nearest names) for an unknown one."""
    try:
        return family_of(o.get("model"))
    except ModelError as error:
        raise ConfigError(f"--model: {error}") from None


ALL_RUNS = Runs()
_CIFAR = Runs(cifar_sized=True)
_FLOAT16, _EXPONENTIAL = Runs(options=(("half_dtype", "float16"),)), Runs(options=(("lr_schedule", "exponential"),))

# The defaults that differ by run and are no family's (Graphcore's application's set_defaults functions), each a
# sequence of (runs, value): the last pair whose runs hold a run gives its default; none: the option has none there.
# Each model family's own follow them (`by_run`).
GENERIC_BY_RUN: dict[str, tuple[tuple[Runs, Any], ...]] = {
    "model_size": (),
    "norm": ((ALL_RUNS, "group"),),  # --group-norm or --batch-norm
    "groups": ((ALL_RUNS, 32), (_CIFAR, 16)),
    "group_dim": (),
    "expand_ratio": (),
    "convolution_groups": (),
    # CIFAR's images are 32 x 32 (another --image-size is refused there).
    "image_size": ((ALL_RUNS, 224), (_CIFAR, 32)),
    "micro_batch_size": ((ALL_RUNS, 4), (_CIFAR, 32)),
    "epochs": ((ALL_RUNS, 100.0), (_CIFAR, 160.0)),
    "learning_rate_schedule": ((ALL_RUNS, "0.5,0.75"),),
    "label_smoothing": ((ALL_RUNS, 0.0),),
    "normalise_input": ((ALL_RUNS, False),),  # the ImageNet mean/std, or Graphcore's mean subtraction
    "optimiser": ((ALL_RUNS, "SGD"),),  # Graphcore's
    # Evaluation's resize and centre crop (validation and predict): Graphcore's (bilinear, the short side to
    # size x 256/224: 0.875 of it kept); on CIFAR-sized data a 32-px image is taken as it is (all of it kept).
    "eval_interpolation": ((ALL_RUNS, "bilinear"),),
    "eval_crop_pct": ((ALL_RUNS, 0.875), (_CIFAR, 1.0)),
    # Graphcore's application's default loss scale (128) protects float16 gradients; bfloat16 has float32's range.
    "loss_scaling": ((ALL_RUNS, 1.0), (_FLOAT16, 128.0),
                     (Runs(options=(("half_dtype", "float16"), ("precision", FLOAT32_PRECISION))), 1.0)),
    "lr_decay_rate": ((_EXPONENTIAL, EXPONENTIAL_DECAY_RATE),),
    "lr_drops": ((_EXPONENTIAL, EXPONENTIAL_DROPS),),
}

_BY_RUN_CACHE: dict[tuple[str, ...], dict[str, tuple[tuple[Runs, Any], ...]]] = {}


def by_run() -> dict[str, tuple[tuple[Runs, Any], ...]]:
    """Every default that differs by run: the generic ones, then each family's (`ModelFamily.defaults`) in the
    registry's order. Families giving the same value on the same data one after the other are said together
    ("batch for ResNet and ResNeXt on CIFAR-sized data")."""
    families = registered_families()
    key = tuple(family.key for family in families)
    if key not in _BY_RUN_CACHE:
        table = {dest: list(pairs) for dest, pairs in GENERIC_BY_RUN.items()}
        merged: dict[str, list[tuple[tuple[str, ...], Any, bool | None, str | None]]] = {}
        for family in families:
            for dest, defaults in family.defaults.items():
                rows = merged.setdefault(dest, [])
                for default in defaults:
                    data = default.cifar_sized
                    last = rows[-1] if rows else None
                    if (last is not None and last[0][-1] != family.key and default.size is None
                            and last[1:] == (default.value, data, None)
                            and all(family.key != key for key in last[0])):
                        rows[-1] = ((*last[0], family.key), *last[1:])
                    else:
                        rows.append(((family.key,), default.value, data, default.size))
        for dest, rows in merged.items():
            table.setdefault(dest, []).extend((Runs(models, data, size), value) for models, value, data, size in rows)
        _BY_RUN_CACHE[key] = {dest: tuple(pairs) for dest, pairs in table.items()}
    return _BY_RUN_CACHE[key]


def family_runs() -> dict[str, Runs]:
    """The optimisers' model families (as `family` tells a run's) as runs: any model on CIFAR-sized data, then on
    ImageNet-sized data the families sharing each table of the optimisers' defaults
    (`cnns.models.family.OptimiserDefaults`: the ImageNet ResNets and ResNeXts, the ImageNet EfficientNets...)."""
    runs: dict[str, list[str]] = {}
    for family in registered_families():
        if family.optimiser_defaults is not None:
            runs.setdefault(family.optimiser_defaults.name, []).append(family.key)
    return {"cifar": _CIFAR, **{name: Runs(tuple(models), False) for name, models in runs.items()}}


def optimiser_tables() -> dict[str, OptimiserDefaults]:
    """The tables of the optimisers' defaults on ImageNet-sized data, by name."""
    return {family.optimiser_defaults.name: family.optimiser_defaults for family in registered_families()
            if family.optimiser_defaults is not None}


def default_for(dest: str, o: Mapping[str, Any]) -> Any:
    """The default of option `dest` (`by_run`) for the run of the options `o`, or None where it has none."""
    value = None
    for runs, candidate in by_run()[dest]:
        if runs.hold(o):
            value = candidate
    return value.of(str(o.get("model")).lower()) if isinstance(value, PerModel) else value


def stated_default(action: argparse.Action) -> str:
    """What --help says of an option's default, from where it is declared: `by_run`, `GENERIC_DEFAULTS` or the
    optimisers' registry (`cnns.optim`: the option's own default, then each optimiser's own where it differs).
    " (default 32; 16 on CIFAR-sized data; 4 for EfficientNet)": parts separated by "; ", each a value for some
    runs, or values for disjoint ones separated by ", ", a part "with SGD or LARS: ..." for those optimisers
    only; where several hold a run, the last says its default. "" where none is declared or for an on/off flag
    of a plain default (off, or decided by the device)."""
    dest = action.dest
    parts: list[tuple[tuple[str, ...], list[tuple[Runs, Any]]]] = []  # (optimisers, or () for any; values)
    table = by_run()
    if dest in ("batch_norm", "group_norm"):
        parts = [((), [(runs, norm == dest.removesuffix("_norm"))]) for runs, norm in table["norm"]]
    elif dest in table:
        parts = [((), [(runs, value)]) for runs, value in table[dest] if value is not None]
    elif dest in GENERIC_DEFAULTS and not (isinstance(GENERIC_DEFAULTS[dest], bool) and action.nargs == 0):
        parts = [((), [(ALL_RUNS, GENERIC_DEFAULTS[dest])])]
    elif dest in optim.OPTIONS or any(dest in info.defaults for info in optim.OPTIMISERS.values()):
        parts = _optimiser_defaults_stated(dest)
    texts = []
    for optimisers, values in parts:
        text = ", ".join(f"{_shown(value, action)} {runs.phrase}".strip() for runs, value in values)
        texts.append(f"with {' or '.join(optimisers)}: {text}" if optimisers else text)
    return f" (default {'; '.join(texts)})" if texts else ""


def _optimiser_defaults_stated(dest: str) -> list[tuple[tuple[str, ...], list[tuple[Runs, Any]]]]:
    """The parts of `stated_default` for an option of the optimisers' registry: the option's own default, then
    the optimisers' own (those with one value named together); only its reader's own where one reads it."""
    option = optim.OPTIONS.get(dest)
    readers = [info for info in optim.OPTIMISERS.values() if option is None or dest in info.reads]
    own: dict[str, tuple[list[str], list[tuple[Runs, Any]]]] = {}
    for info in readers:
        if dest in info.defaults:
            values = _family_values(info.defaults[dest], info.name, dest)
            own.setdefault(repr(values), ([], values))[0].append(info.name)
    parts = []
    if option is not None and option.default is not None:
        # Not where its reader's defaults derive it (RMSprop's decay from its exponent on ImageNet EfficientNets).
        derived = {family for family in family_runs() for info in readers if option.derive is not None
                   and option.derive({"global_batch_size": 1, **_defaults_of(info, family)}) is not None}
        parts = [((), _family_values(option.default, None, dest, without=derived))]
    if len(readers) == 1 and not parts:
        return [((), values) for _, values in own.values()]
    return parts + [(tuple(names), values) for names, values in own.values()]


def optimiser_default(default: optim.Default, optimiser: str | None, dest: str, family: str) -> Any:
    """The default of `dest` for a run of the optimisers' `family` ("cifar", or a table's name: `family`):
    the registry's value, or where it gives one per family (`cnns.optim.Default`), on CIFAR-sized data its own and
    on ImageNet-sized data the model family's table's for `optimiser` (None: the option's own default)."""
    if not isinstance(default, Mapping) or family == "cifar":
        return optim.default_in(default, family)
    table = optimiser_tables().get(family)
    return None if table is None else table.value(dest, optimiser)


def _defaults_of(info: optim.OptimiserInfo, family: str) -> dict[str, Any]:
    return {dest: optimiser_default(default, info.name, dest, family) for dest, default in info.defaults.items()}


def _family_values(default: optim.Default, optimiser: str | None, dest: str,
                   without: set[str] = frozenset()) -> list[tuple[Runs, Any]]:
    """A registry default as values for runs: one for all, or one per model family (but those `without`)."""
    if not isinstance(default, Mapping) and not without:
        return [(ALL_RUNS, default)]
    values = []
    for name, runs in family_runs().items():
        value = optimiser_default(default, optimiser, dest, name)
        if name not in without and value is not None:
            values.append((runs, value))
    return values


def _shown(value: Any, action: argparse.Action) -> str:
    """A default as the option is spelled: yes or no for a flag, ON or OFF for an on/off value, a size in the
    units --max-file-size takes, a float in the shortest form."""
    if isinstance(value, bool) or value is None:
        return ("yes" if value else "no") if action.nargs == 0 else ("ON" if value else "OFF")
    if action.type is byte_size:
        for unit, shift in (("T", 40), ("G", 30), ("M", 20), ("K", 10)):
            if value % (1 << shift) == 0:
                return f"{value >> shift}{unit}"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _model_defaults(o: dict[str, Any]) -> None:
    family = model_family(o)  # one line naming the nearest names for an unknown --model
    size = o.get("model_size") or default_for("model_size", o)
    # The family's spelling (EfficientNet: Graphcore's 4, b4 and B4; "cifar" in any case); a named model has none.
    o["model_size"] = None if size is None else family.normalise_size(str(size).strip())
    for dest in ("micro_batch_size", "image_size", "groups", "group_dim", "expand_ratio", "convolution_groups",
                 "learning_rate_schedule", "normalise_input", "eval_interpolation", "eval_crop_pct"):
        _set_if_unset(o, dest, default_for(dest, o))
    if o["dataset"] is None:  # data not known yet: the model is CIFAR's, at CIFAR's size whatever --image-size says
        o["image_size"] = default_for("image_size", o)
    if o["epochs"] is None and o["iterations"] is None:
        o["epochs"] = default_for("epochs", o)
    smoothing = default_for("label_smoothing", o)
    # Graphcore's application's rule: EfficientNet's label smoothing replaces a smoothing of 0 as well.
    if o.get("label_smoothing") is None or (not o["label_smoothing"] and smoothing):
        o["label_smoothing"] = smoothing
    if not o.get("batch_norm") and not o.get("group_norm"):
        o[default_for("norm", o) + "_norm"] = True


GENERIC_DEFAULTS: dict[str, Any] = {
    "model": default_family().key,  # the family a run without --model trains (`cnns.models.families`)
    "lr_schedule": "stepped",
    "learning_rate_decay": 0.1,
    "warmup_epochs": 5.0,
    "poly_lr_decay_power": 2.0,
    "poly_lr_end_ratio": 1e-5,
    "gradient_accumulation_count": 1,
    "gradient_accumulation_dtype": "float32",
    "replicas": 1,
    "shards": 1,
    "pipeline": False,
    "pipeline_schedule": "Grouped",  # Graphcore's application's default
    "enable_recomputation": False,
    "precision": HALF_PRECISION,
    "stochastic_rounding": True,
    "device_iterations": 1000,
    "ckpts_per_epoch": 1.0,
    "epochs_per_ckpt": 0.0,
    "ckpt_epochs_offset": 0.0,
    "validation": True,
    "BN_span": 1,
    "BN_decay": 0.97,
    "mixup_alpha": 0.0,
    "cutmix_lambda": 1.0,
    "cutmix_version": 1,
    "dataset_percentage_to_use": 100,
    "pipeline_num_parallel": 2,
    "decode_device": "auto",
    "max_file_size": DEFAULT_FILE_SIZE_LIMIT,  # cnns.bounded_reads's
    "dataset_cache": True,
    "eight_bit_io": False,
    "log_dir": "logs",
    "logs_per_epoch": 16.0,
    "log_freq": 500,
    "wandb": False,
    "wandb_project": "cnns",
    "tensorboard": False,
    "compile": False,
    "auto_loss_scaling": False,
    "rts": False,
    "offload_optimiser": False,
    "enable_half_partials": False,
    "fp_exceptions": False,
    "profile": False,
    "compile_only": False,
    "generated_data": False,
    "synthetic_data": False,
    "dataset_benchmark": False,
    "standard_imagenet": False,
    "distributed": False,
    "threads_per_worker": "auto",  # the usable cores shared out evenly (cnns.parallel.world.threads_per_worker)
    "dist_timeout": 600.0,  # seconds: long enough for the slowest start-up measured, a bound on a hang
    "fused_norm": "auto",
    "malloc_tuning": True,
}


def record_half_dtype_given(o: dict[str, Any], decided: set[str] | frozenset[str] = frozenset()) -> None:
    """Whether --half-dtype was chosen rather than a device's default, recorded before any default fills it: an
    explicit half type runs even where the hardware would only emulate it (`cnns.precision`). Recorded once: a
    run's arguments.json (`decided`, or the options themselves) carries the answer already, and restore and
    validation keep it."""
    if "half_dtype" not in decided and o.get("half_dtype_given") is None:
        o["half_dtype_given"] = o.get("half_dtype") is not None


def _input_defaults(o: dict[str, Any]) -> None:
    """8-bit I/O is what runs unless --hostside-norm asks for float images from the host (and --eight-bit-io, given
    with it, wins): both options are recorded as the run does them, so --print-config and arguments.json say what
    crosses to the device (`cnns.engine.feed.DeviceFeed` normalises uint8 batches on the device)."""
    o["hostside_norm"] = bool(o.get("hostside_norm")) and not o["eight_bit_io"]
    o["eight_bit_io"] = not o["hostside_norm"]


def _precision_defaults(o: dict[str, Any]) -> None:
    # train.py chooses the half type from the run's device before this (`device_defaults`); options from
    # elsewhere (benchmarks, tests) without one get the CPU's.
    record_half_dtype_given(o)
    _set_if_unset(o, "half_dtype", "bfloat16")
    _set_if_unset(o, "loss_scaling", default_for("loss_scaling", o))


def _power_of_two(exponent: float, option: str) -> float:
    try:
        return 2.0 ** exponent
    except OverflowError:
        raise ConfigError(f"{option} {exponent} is too large: 2^{exponent} overflows") from None


def family(o: Mapping[str, Any]) -> str:
    """The run's model family as the optimisers' defaults are given (`family_runs` says them so in --help): any
    model on CIFAR-sized data (or on data not yet known, whose model defaults were CIFAR's), else the name of the
    model family's table of them (`cnns.models.family.OptimiserDefaults`; a family without one takes the
    optimisers' own, those of CIFAR-sized data)."""
    table = None if cifar_sized(o) else model_family(o).optimiser_defaults
    return "cifar" if table is None else table.name


def _optimiser_defaults(o: dict[str, Any]) -> None:
    """The optimiser (the model family's default where none is given: `by_run`), then its entry (`cnns.optim`)
    fills what is unset: its own defaults first (its learning-rate exponent, its weight decay), then every optimiser
    option's derived value or default, then the entry's rules. Every optimiser option given, read or not, was
    checked against its range with every option (`check_domains`: the optimiser's spec checks them all again when
    the run builds it, after its folder is written)."""
    _set_if_unset(o, "optimiser", default_for("optimiser", o))
    info = optim.optimiser_info(o["optimiser"])
    run_family = family(o)
    for dest, default in info.defaults.items():
        _set_if_unset(o, dest, optimiser_default(default, info.name, dest, run_family))
    for dest, option in optim.OPTIONS.items():
        if o.get(dest) is None and option.derive is not None:
            o[dest] = option.derive(o)
        _set_if_unset(o, dest, optimiser_default(option.default, None, dest, run_family))
    if info.rules is not None:
        info.rules(o)


def _training_defaults(o: dict[str, Any]) -> None:
    o["global_batch_size"] = o["micro_batch_size"] * o["gradient_accumulation_count"] * o["replicas"]
    _optimiser_defaults(o)
    if o.get("abs_learning_rate") is not None:
        if not FLOAT32_TINY <= o["abs_learning_rate"] <= FLOAT32_MAX:
            raise ConfigError(f"--abs-learning-rate must be positive and within float32's range, "
                              f"got {o['abs_learning_rate']}")
        o["base_learning_rate_exponent"] = math.log2(o["abs_learning_rate"] / o["global_batch_size"])
        o["learning_rate"] = float(o["abs_learning_rate"])
    else:
        exponent = o["base_learning_rate_exponent"]
        power = _power_of_two(exponent, "--base-learning-rate-exponent")
        o["learning_rate"] = power * o["global_batch_size"]
        if not FLOAT32_TINY <= o["learning_rate"] <= FLOAT32_MAX:
            raise ConfigError(f"--base-learning-rate-exponent {exponent} gives the learning rate "
                              f"{o['learning_rate']:g}, which float32 cannot hold: choose one between about -120 "
                              "and 120")
    if o.get("epochs_per_ckpt"):
        per_epoch = 1.0 / o["epochs_per_ckpt"]
        # Both on one command line are refused by the parser. A run's arguments.json (read again by
        # validation.py) holds both, the second derived from the first.
        if o["ckpts_per_epoch"] != 1 and not math.isclose(o["ckpts_per_epoch"], per_epoch):
            raise ConfigError("cannot use --epochs-per-ckpt and --ckpts-per-epoch together")
        o["ckpts_per_epoch"] = per_epoch
    if o["lr_schedule"] == "polynomial_decay_lr":
        o["lr_schedule"] = "polynomial"
    if o["lr_schedule"] == "polynomial" and o.get("abs_end_learning_rate") is not None:
        o["poly_lr_end_ratio"] = o["abs_end_learning_rate"] / o["learning_rate"]
    _set_if_unset(o, "lr_decay_rate", default_for("lr_decay_rate", o))  # the exponential schedule's
    _set_if_unset(o, "lr_drops", default_for("lr_drops", o))
    if o.get("warmup_epochs") and o.get("epochs") is None:
        o["warmup_epochs"] = 0.0  # Graphcore's application: warm-up is defined in epochs and needs --epochs


def _validate(o: dict[str, Any]) -> None:
    check_bn_span(o["BN_span"], o["replicas"])
    check_pipeline_schedule(o["pipeline_schedule"], o["gradient_accumulation_count"], o["shards"])
    if o["shards"] > 1 and not o["pipeline"]:
        raise ConfigError("--shards should be used in combination with --pipeline")
    if o.get("pipeline_splits") and len(o["pipeline_splits"]) > 0 and not o["pipeline"]:
        raise ConfigError("--pipeline-splits should be used in combination with --pipeline")
    if o["dataset"] is not None and cifar_sized(o) and o.get("image_size") not in (None, 32):
        raise ConfigError("--image-size is not supported for CIFAR-sized datasets")
    if o["dataset"] is not None and cifar_sized(o) and o.get("eval_crop_pct") not in (None, 1.0):
        raise ConfigError(f"--eval-crop-pct {o['eval_crop_pct']:g}: CIFAR-sized images are evaluated whole (their "
                          "32 x 32 pixels as they are), so no crop applies: leave it at 1")


def check_label_smoothing(smoothing: float, classes: int) -> None:
    """Graphcore's label smoothing e leaves 1 - e on the true class and spreads e over the other classes, so the true
    class keeps at least as much as each other one only up to e = (K - 1) / K (torch's own smoothing, to which it
    is converted, refuses more). The rule of --label-smoothing's domain ([0, 1) in the options table) that needs
    the class count, known once the data is: checked when the run's configuration is made, before its folder."""
    if classes > 1 and smoothing > (classes - 1) / classes:
        raise ConfigError(f"--label-smoothing {smoothing} leaves the true class less than each of the other "
                          f"{classes - 1}: at most {(classes - 1) / classes:g} with {classes} classes")


def check_pipeline_schedule(schedule: str, micro_batches: int, shards: int) -> None:
    """Interleaved (1F1B) starts each micro-batch's backward before the next forwards, so it needs a micro-batch in
    every stage at once: at least as many micro-batches per update as stages. Checked as the options resolve,
    before any run folder is written."""
    if schedule == "Interleaved" and shards > 1 and micro_batches < shards:
        raise ConfigError(f"--pipeline-schedule Interleaved needs at least as many micro-batches per update as "
                          f"stages: --gradient-accumulation-count {micro_batches} < --shards {shards}")


def check_bn_span(span: int, replicas: int | str) -> None:
    """--BN-span's rule: a span is that many replicas of one stage, so it divides --replicas. The only place it
    is checked: every command resolves its options here before a process joins the world (`cnns.cli` makes
    `--replicas auto` a number first; a replica count still "auto" is not one to check yet)."""
    if span > 1 and replicas == 1:
        raise ConfigError(f"--BN-span {span} spans replicas: give --replicas (a multiple of it)")
    if span > 1 and isinstance(replicas, int) and replicas > 1 and replicas % span:
        raise ConfigError(f"--BN-span {span} must divide --replicas {replicas}")


def stages_compile(shards: int) -> bool:
    """Whether a run of `shards` pipeline stages may use --compile: not yet (a stage runs eagerly; its updates
    are the same). The one statement of that rule: the default, restore.py's new --shards and the check before
    a run all ask here."""
    return shards == 1


def device_defaults(values: dict[str, Any], device_type: str, device_half_dtype: str,
                    decided: set[str] | frozenset[str] = frozenset()) -> None:
    """What the run's device decides when the command line does not: --half-dtype (`device_half_dtype`: bfloat16
    on a CPU and on a GPU with bfloat16 arithmetic, float16 with loss scaling on one without) and --compile (on
    a GPU, as Graphcore's application always compiled its graph; not on a CPU, where it gains nothing, nor with
    pipeline stages: `stages_compile`). Decided once, so that arguments.json records it and every later
    command keeps it; `decided` names options another source (a run's arguments.json) already gives."""
    record_half_dtype_given(values, decided)
    if values.get("half_dtype") is None and "half_dtype" not in decided:
        values["half_dtype"] = device_half_dtype
    if values.get("compile") is None and "compile" not in decided:
        values["compile"] = device_type == "cuda" and stages_compile(values.get("shards") or 1)


def draw_seed() -> int:
    """A fresh random seed for a run not given --seed; recorded in arguments.json so the run can be replayed
    and restore.py continues the same data order. The only place a seed is drawn."""
    return int.from_bytes(os.urandom(4), "little")


def run_name(o: dict[str, Any]) -> str:
    """Graphcore's application's run name, e.g. RN20_bs32_BN_16.16 or EfficientNet-B0_bs4x16a_GN4: the model
    family's tag and form (`cnns.models.family.ModelFamily.run_name`), then the image size and the suffix."""
    family = model_family(o)
    accumulation = o["gradient_accumulation_count"]
    name = family.run_name.format(
        prefix=family.prefix(o["model"], str(o.get("model_size") or "")), bs=o["micro_batch_size"],
        accum=f"x{accumulation}p" if o["pipeline"] else (f"x{accumulation}a" if accumulation > 1 else ""),
        replicas=f"x{o['replicas']}r" if o["replicas"] > 1 else "",
        norm=f"_GN{o['groups']}" if o.get("group_norm") else family.own_norm_tag,
        precision=o["precision"], sr="_noSR" if not o["stochastic_rounding"] else "")
    if o.get("image_size") and not cifar_sized(o) and o["image_size"] != 224:
        name += f"_{o['image_size']}x{o['image_size']}"
    if o.get("name_suffix"):
        name += f"_{o['name_suffix']}"
    return name


def resolve(cli_values: dict[str, Any]) -> dict[str, Any]:
    """Fill every option: generic defaults, dataset/model defaults, derived values. Pure: no I/O."""
    o = dict(cli_values)
    check_domains(o)
    for key, value in GENERIC_DEFAULTS.items():
        _set_if_unset(o, key, value)
    _dataset_defaults(o)
    _model_defaults(o)
    _input_defaults(o)
    _precision_defaults(o)
    _training_defaults(o)
    _validate(o)
    o["name"] = run_name(o)
    return o

