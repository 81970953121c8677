"""Options -> one resolved, validated option set -> typed configuration objects.

Resolution follows the seed: a named configuration from ``configs.yml`` supplies defaults, the command
line overrides them, then the dataset- and model-dependent defaults fill whatever is still unset, and
derived values (global batch size, learning rate, run name) are computed. The result is a flat dict
of the seed's option names: it is what ``arguments.json`` and ``--print-config`` show, and what
``restore.py`` reads back. `RunConfig.from_options` turns it into typed objects with plain field names,
which is all the rest of the package sees.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

from cnns.errors import ConfigError
from cnns.options import IPU_ONLY_OPTIONS, build_parser

REPO_CONFIGS = Path(__file__).resolve().parents[2] / "configs.yml"

CIFAR_LIKE = ("cifar-10", "cifar-100", "builtin")
NUM_CLASSES = {"imagenet": 1000, "cifar-10": 10, "cifar-100": 100, "builtin": 10}
# EfficientNet's own input sizes (Tan and Le), the seed's ImageNet default for each size.
EFFICIENTNET_IMAGE_SIZES = {"B0": 224, "B1": 240, "B2": 260, "B3": 300, "B4": 380, "B5": 456, "B6": 528, "B7": 600}
BUILTIN_DATA_DIR = "data/builtin"


# ----------------------------------------------------------------------------------------------
# configs.yml


def default_configs_path() -> Path:
    """configs.yml beside the root scripts (the repository), else the current folder's."""
    if REPO_CONFIGS.exists():
        return REPO_CONFIGS
    return Path("configs.yml")


def load_named_config(name: str, path: str | os.PathLike | None = None) -> dict[str, Any]:
    """The options of configuration `name`, YAML merge keys resolved.

    ConfigError, naming the file, when it cannot be read, is not YAML, is not a mapping of
    configuration names to mappings of options, or gives an option a value of the wrong type."""
    path = Path(path) if path else default_configs_path()
    try:
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(f"configuration file not found: {path}") from None
    except OSError as exc:
        raise ConfigError(f"cannot read configuration file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"configuration file {path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    try:
        configs = yaml.safe_load(text)
    # PyYAML raises YAMLError for most bad text, but ValueError, TypeError or RecursionError from its
    # constructors for some (an impossible date, a too deeply nested value): all mean "not valid YAML".
    except Exception as exc:  # noqa: BLE001
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"configuration file {path} is not valid YAML: {reason}") from None
    if not isinstance(configs, dict):
        raise ConfigError(f"configuration file {path} does not map configuration names to options")
    if name not in configs:
        import difflib

        names = sorted(str(key) for key in configs)
        near = difflib.get_close_matches(str(name), names, n=3, cutoff=0.6)
        if near:
            raise ConfigError(f"unknown config {name!r} in {path}; did you mean {' or '.join(map(repr, near))}?")
        raise ConfigError(f"unknown config {name!r} in {path}; available configs: {', '.join(names) or 'none'}")
    config = configs[name]
    where = f"config {name!r} in {path}"
    if not isinstance(config, dict) or not all(isinstance(key, str) for key in config):
        raise ConfigError(f"{where} is not a mapping of option names to values")
    for first, second in (("batch_size", "micro_batch_size"), ("epochs", "iterations"),
                          ("epochs_per_ckpt", "ckpts_per_epoch")):
        if config.get(first) is not None and config.get(second) is not None:
            raise ConfigError(f"{where} gives both {first} and {second}: keep one of them")
    check_option_types(config, where, strings_are_parsed=True)
    return dict(config)


def check_option_types(values: dict[str, Any], where: str, strings_are_parsed: bool) -> None:
    """ConfigError naming `where` and the option when a value has a type its option cannot take: an
    integer option given a list, a flag given a number, a value outside an option's choices.

    For configs.yml (`strings_are_parsed`), a string is left to the argument parser, which converts
    it as it would on the command line; in a run's arguments.json values are already typed. None
    (unset) is accepted everywhere; options the parsers do not declare are not checked, except the
    few values that resolution derives (global batch size, learning rate, seed, ...)."""
    actions = _option_actions()
    for key, value in values.items():
        if value is None:
            continue
        if key in _DERIVED_TYPES:
            kinds = _DERIVED_TYPES[key]
            if isinstance(value, bool) != (kinds == (bool,)) or not isinstance(value, kinds):
                raise ConfigError(f"{where}: {key} must be {_kind_name(kinds)}, got {_shown(value)}")
            continue
        action = actions.get(_CONFIG_ALIASES.get(key, key))
        if action is None:
            continue
        problem = _option_value_problem(action, value, strings_are_parsed)
        if problem:
            raise ConfigError(f"{where}: {key} must be {problem}, got {_shown(value)}")


# configs.yml keys that are another option's (the seed's deprecated spelling, see cnns.cli.parse_options).
_CONFIG_ALIASES = {"batch_size": "micro_batch_size"}
# Values that resolve() derives, as arguments.json holds them.
_DERIVED_TYPES: dict[str, tuple[type, ...]] = {
    "global_batch_size": (int,), "learning_rate": (int, float), "seed_specified": (bool,),
    "half_dtype_given": (bool,), "name": (str,), "command": (str,),
}


def _kind_name(kinds: tuple[type, ...]) -> str:
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string", list: "a list"}
    return " or ".join(dict.fromkeys(names.get(kind, kind.__name__) for kind in kinds))


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _option_value_problem(action, value: Any, strings_are_parsed: bool) -> str | None:
    """What `value` should be for the parser action, or None when it fits."""
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return None if isinstance(value, bool) else "true or false"
    if action.nargs in ("+", "*") or isinstance(action.nargs, int):
        if not isinstance(value, list) and action.dest not in IPU_ONLY_OPTIONS:  # those are ignored anyway
            return "a list"
        items = value if isinstance(value, list) else [value]
        for item in items:
            problem = _scalar_problem(action, item, strings_are_parsed=False)
            if problem:
                return f"a list of {problem.removeprefix('a ').removeprefix('an ')}s"
        return None
    return _scalar_problem(action, value, strings_are_parsed)


def _scalar_problem(action, value: Any, strings_are_parsed: bool) -> str | None:
    if not isinstance(value, (str, int, float, bool)):
        return "a single value"
    parsed_string = isinstance(value, str) and strings_are_parsed
    if not parsed_string:  # a string for configs.yml is converted (or refused) by the parser itself
        if action.type is int and (isinstance(value, bool) or not isinstance(value, int)):
            return "an integer"
        if action.type is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
            return "a number"
    if action.choices is not None:
        candidate = value
        if parsed_string and callable(action.type):
            try:
                candidate = action.type(value)
            except (TypeError, ValueError, argparse.ArgumentTypeError):
                pass
        if isinstance(candidate, bool) or candidate not in action.choices:
            return "one of " + ", ".join(repr(choice) for choice in action.choices)
    return None


@lru_cache(maxsize=None)
def _option_actions() -> dict[str, Any]:
    """argparse actions by destination, over the scripts that take training options."""
    actions: dict[str, Any] = {}
    for script in ("train", "validate", "weight-avg", "infer"):
        for action in build_parser(script)._actions:
            if action.dest != "help":
                # The first action of a destination is the option's own (--stochastic-rounding ON|OFF),
                # whose type the parser uses for a default; later ones are its --no-... spellings.
                actions.setdefault(action.dest, action)
    return actions


# ----------------------------------------------------------------------------------------------
# dataset- and model-dependent defaults (the seed's set_defaults functions)


def _dataset_defaults(o: dict[str, Any]) -> None:
    if o.get("generated_data") or o.get("synthetic_data"):
        if not o.get("dataset"):
            raise ConfigError("please name the generated or synthetic dataset with --dataset")
        o["mixup_alpha"], o["cutmix_lambda"] = 0.0, 1.0  # mixing means nothing on random data
        return
    if not o.get("data_dir"):
        if o.get("dataset") == "builtin":
            o["data_dir"] = BUILTIN_DATA_DIR
        elif os.environ.get("DATA_DIR"):
            o["data_dir"] = os.environ["DATA_DIR"]
        else:
            raise ConfigError("cannot find CIFAR/ImageNet data: set the DATA_DIR environment variable or use --data-dir")
    if not o.get("dataset"):
        o["dataset"] = infer_dataset_from_name(o["data_dir"])


def infer_dataset_from_name(data_dir: str) -> str | None:
    """The seed's rule: the dataset is named in the folder's path. Contents are checked later."""
    lowered = str(data_dir).lower()
    if "imagenet" in lowered:
        return "imagenet"
    if "cifar100" in lowered or "cifar-100" in lowered:
        return "cifar-100"
    if "cifar" in lowered:
        return "cifar-10"
    if "builtin" in lowered:
        return "builtin"
    return None  # decided from the folder's contents once data is read


def _set_if_unset(o: dict[str, Any], key: str, value: Any) -> None:
    if o.get(key) is None:
        o[key] = value


def _model_defaults(o: dict[str, Any]) -> None:
    cifar = o["dataset"] in CIFAR_LIKE or o["dataset"] is None
    model = o["model"]
    lars = o["optimiser"] == "LARS"
    if model == "efficientnet":
        size = str(o.get("model_size") or ("cifar" if cifar else "B0"))
        o["model_size"] = f"B{size}" if size.isdigit() else (size.upper() if size.lower() != "cifar" else "cifar")
        _set_if_unset(o, "micro_batch_size", 8 if cifar else 4)
        if not cifar:
            _set_if_unset(o, "image_size", EFFICIENTNET_IMAGE_SIZES.get(o["model_size"], 224))
        _set_if_unset(o, "weight_decay", 0.0 if lars else (1e-6 if cifar else 1e-5))
        _set_if_unset(o, "lars_weight_decay", 1e-6 if cifar else 1e-5)
        exponents = {"SGD": -7.0, "momentum": -10.0, "RMSprop": -14.0, "LARS": -7.0}
        _set_if_unset(o, "base_learning_rate_exponent", -6.0 if cifar else exponents[o["optimiser"]])
        if o["optimiser"] == "RMSprop" and not cifar:
            _set_if_unset(o, "rmsprop_base_decay_exp", -14.0)
        if o["epochs"] is None and o["iterations"] is None:
            o["epochs"] = 300.0 if cifar else 350.0
        if not cifar and not o.get("label_smoothing"):
            o["label_smoothing"] = 0.1
        if o["lr_schedule"] == "exponential":
            _set_if_unset(o, "lr_decay_rate", 0.97)
            _set_if_unset(o, "lr_drops", 146)
        if not o.get("batch_norm") and not o.get("group_norm"):
            o["group_norm"] = True
        _set_if_unset(o, "groups", 4)
        _set_if_unset(o, "group_dim", 1)
        _set_if_unset(o, "expand_ratio", 6)
        return
    # ResNet and ResNeXt
    resnext = model == "resnext"
    default_size = ("29" if cifar else "50") if resnext else ("20" if cifar else "18")
    o["model_size"] = str(o.get("model_size") or default_size)
    _set_if_unset(o, "micro_batch_size", 32 if cifar else 4)
    _set_if_unset(o, "weight_decay", 0.0 if lars else (1e-6 if cifar else 1e-4))
    _set_if_unset(o, "lars_weight_decay", 1e-6 if cifar else 1e-4)
    if cifar:
        _set_if_unset(o, "base_learning_rate_exponent", -6.0)
    else:
        _set_if_unset(o, "base_learning_rate_exponent", {"momentum": -11.0}.get(o["optimiser"], -8.0))
    if o["epochs"] is None and o["iterations"] is None:
        o["epochs"] = 160.0 if cifar else 100.0
    _set_if_unset(o, "learning_rate_schedule", "0.5,0.75" if cifar else "0.3,0.6,0.8,0.9")
    if not o.get("batch_norm") and not o.get("group_norm"):
        o["batch_norm" if cifar else "group_norm"] = True
    _set_if_unset(o, "groups", 16 if cifar else 32)
    if resnext:
        _set_if_unset(o, "convolution_groups", 8 if cifar else 32)
        _set_if_unset(o, "group_dim", 16 if cifar else 4)


GENERIC_DEFAULTS: dict[str, Any] = {
    "model": "resnet",
    "optimiser": "SGD",
    "momentum": 0.9,
    "rmsprop_epsilon": 0.001,
    "lars_eeta": 0.001,
    "lars_epsilon": 0.0,
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
    "pipeline_schedule": "Grouped",  # the seed's default
    "enable_recomputation": False,
    "precision": "16.16",
    "stochastic_rounding": True,
    "device_iterations": 1000,
    "label_smoothing": 0.0,
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
    "dataset_cache": True,
    "normalise_input": False,
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
}


def _precision_defaults(o: dict[str, Any]) -> None:
    # An explicit --half-dtype runs that type even where the hardware would only emulate it.
    # (A run's arguments.json carries the answer already: restore and validation keep it.) train.py
    # chooses it from the run's device before this (cnns.cli.parsing.half_type_of_the_device); options
    # from elsewhere (benchmarks, tests) without one get the CPU's.
    o.setdefault("half_dtype_given", o.get("half_dtype") is not None)
    _set_if_unset(o, "half_dtype", "bfloat16")
    # The seed's default loss scale (128) protects float16 gradients; bfloat16 has float32's range.
    _set_if_unset(o, "loss_scaling", 128.0 if o["half_dtype"] == "float16" and o["precision"] != "32.32" else 1.0)


def _power_of_two(exponent: float, option: str) -> float:
    try:
        return 2.0 ** exponent
    except OverflowError:
        raise ConfigError(f"{option} {exponent} is too large: 2^{exponent} overflows") from None


def _training_defaults(o: dict[str, Any]) -> None:
    o["global_batch_size"] = o["micro_batch_size"] * o["gradient_accumulation_count"] * o["replicas"]
    if o.get("abs_learning_rate") is not None:
        if o["abs_learning_rate"] <= 0:
            raise ConfigError(f"--abs-learning-rate must be positive, got {o['abs_learning_rate']}")
        o["base_learning_rate_exponent"] = math.log2(o["abs_learning_rate"] / o["global_batch_size"])
        o["learning_rate"] = float(o["abs_learning_rate"])
    else:
        exponent = o["base_learning_rate_exponent"]
        power = _power_of_two(exponent, "--base-learning-rate-exponent")
        o["learning_rate"] = power * o["global_batch_size"]
        if power == 0 or not math.isfinite(o["learning_rate"]):
            raise ConfigError(f"--base-learning-rate-exponent {exponent} gives the learning rate "
                              f"{o['learning_rate']}: choose one between about -1000 and 1000")
    if o.get("rmsprop_base_decay_exp") is not None and o.get("rmsprop_decay") is None:
        o["rmsprop_decay"] = 1 - _power_of_two(o["rmsprop_base_decay_exp"], "--rmsprop-base-decay-exp") * \
            o["global_batch_size"]
    _set_if_unset(o, "rmsprop_decay", 0.9)
    if o["optimiser"] == "LARS" and not o.get("lars_weight_decay"):
        o["lars_weight_decay"] = o["weight_decay"]
    for key in ("epochs_per_ckpt", "ckpts_per_epoch"):
        if o.get(key) is not None and o[key] < 0:
            raise ConfigError(f"--{key.replace('_', '-')} must not be negative, got {o[key]}")
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
    if o["lr_schedule"] == "exponential":
        _set_if_unset(o, "lr_decay_rate", 0.97)
        _set_if_unset(o, "lr_drops", 146)
    if o.get("warmup_epochs") and o.get("epochs") is None:
        o["warmup_epochs"] = 0.0  # seed: warm-up is defined in epochs and needs --epochs
    _set_if_unset(o, "learning_rate_schedule", "0.5,0.75")
    _set_if_unset(o, "pipeline_num_parallel", 2)


def _check_finite(o: dict[str, Any]) -> None:
    """Numbers that are not finite (--epochs nan), before anything uses them."""
    for key, action in _option_actions().items():
        value = o.get(key)
        if action.type is float and isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{action.option_strings[0]} must be a finite number, got {value}")


def _validate(o: dict[str, Any]) -> None:
    for key in ("micro_batch_size", "gradient_accumulation_count", "replicas", "shards", "device_iterations"):
        if o[key] is not None and o[key] < 1:
            raise ConfigError(f"--{key.replace('_', '-')} must be at least 1, got {o[key]}")
    if o.get("epochs") is not None and o["epochs"] <= 0:
        raise ConfigError(f"--epochs must be positive, got {o['epochs']}")
    if o.get("iterations") is not None and o["iterations"] < 1:
        raise ConfigError(f"--iterations must be at least 1, got {o['iterations']}")
    if o.get("num_classes") is not None and o["num_classes"] < 1:
        raise ConfigError(f"--num-classes must be at least 1, got {o['num_classes']}")
    if o["BN_span"] > 1 and isinstance(o["replicas"], int) and o["replicas"] > 1 and o["replicas"] % o["BN_span"]:
        raise ConfigError(f"--BN-span {o['BN_span']} must divide --replicas {o['replicas']}")
    if o["shards"] > 1 and not o["pipeline"]:
        raise ConfigError("--shards should be used in combination with --pipeline")
    if o.get("pipeline_splits") and len(o["pipeline_splits"]) > 0 and not o["pipeline"]:
        raise ConfigError("--pipeline-splits should be used in combination with --pipeline")
    if o["dataset"] in CIFAR_LIKE and o.get("image_size") not in (None, 32):
        raise ConfigError("--image-size is not supported for CIFAR-sized datasets")
    if not 1 <= o["dataset_percentage_to_use"] <= 100:
        raise ConfigError("--dataset-percentage-to-use must be between 1 and 100")
    if o["label_smoothing"] < 0 or o["label_smoothing"] >= 1:
        raise ConfigError(f"--label-smoothing must be in [0, 1), got {o['label_smoothing']}")


def run_name(o: dict[str, Any]) -> str:
    """The seed's run name, e.g. RN20_bs32_BN_16.16 or EfficientNet-B0_bs4x16a_GN4."""
    accumulation = o["gradient_accumulation_count"]
    accum_tag = f"x{accumulation}p" if o["pipeline"] else (f"x{accumulation}a" if accumulation > 1 else "")
    replica_tag = f"x{o['replicas']}r" if o["replicas"] > 1 else ""
    norm_tag = f"_GN{o['groups']}" if o.get("group_norm") else "_BN"
    if o["model"] == "efficientnet":
        name = f"EfficientNet-{o['model_size']}_bs{o['micro_batch_size']}{accum_tag}{replica_tag}{norm_tag}"
    else:
        prefix = "RNX" if o["model"] == "resnext" else "RN"
        name = f"{prefix}{o['model_size']}_bs{o['micro_batch_size']}{replica_tag}{accum_tag}{norm_tag}"
        name += f"_{o['precision']}" + ("_noSR" if not o["stochastic_rounding"] else "")
    if o.get("image_size") and o["dataset"] == "imagenet" and o["image_size"] != 224:
        name += f"_{o['image_size']}x{o['image_size']}"
    if o.get("name_suffix"):
        name += f"_{o['name_suffix']}"
    return name


def resolve(cli_values: dict[str, Any]) -> dict[str, Any]:
    """Fill every option: generic defaults, dataset/model defaults, derived values. Pure: no I/O."""
    o = dict(cli_values)
    _check_finite(o)
    for key, value in GENERIC_DEFAULTS.items():
        _set_if_unset(o, key, value)
    _dataset_defaults(o)
    _model_defaults(o)
    _precision_defaults(o)
    _training_defaults(o)
    _validate(o)
    o["name"] = run_name(o)
    return o


# ----------------------------------------------------------------------------------------------
# Typed configuration: what the rest of the package sees


@dataclass(frozen=True)
class DataConfig:
    dataset: str | None
    data_dir: str | None
    source: str  # "files" | "generated" | "synthetic"
    num_classes: int
    image_size: int | None
    workers: int
    normalise_imagenet: bool  # ImageNet mean/std; otherwise the seed's mean subtraction
    host_normalisation: bool
    percentage: int
    cache: bool
    mixup_alpha: float
    cutmix_lambda: float
    cutmix_version: int
    skip_corrupt: bool = False  # --skip-corrupt-images: drop and count undecodable images


@dataclass(frozen=True)
class PrecisionConfig:
    precision: str  # "32.32" | "16.32" | "16.16"
    half_dtype: str  # "bfloat16" | "float16"
    half_dtype_given: bool  # chosen explicitly: used even where the CPU only emulates it
    stochastic_rounding: bool
    loss_scaling: float
    auto_loss_scaling: bool
    grad_accum_dtype: str
    half_partials: bool


@dataclass(frozen=True)
class ParallelConfig:
    replicas: int
    shards: int
    pipeline: bool
    splits: tuple[str, ...] | None
    schedule: str
    recomputation: bool
    bn_span: int
    rts: bool
    offload_optimiser: bool
    identical_seeding: bool  # --identical-replica-seeding


@dataclass(frozen=True)
class TrainConfig:
    micro_batch_size: int
    grad_accum: int
    global_batch_size: int
    epochs: float | None
    iterations: int | None
    device_iterations: int
    ckpts_per_epoch: float
    ckpt_epochs_offset: float
    logs_per_epoch: float
    log_freq: int
    seed: int | None
    seed_given: bool  # --seed was on the command line (the seed is recorded either way)
    validation: bool
    label_smoothing: float
    weight_avg_N: tuple[int, ...]
    weight_avg_exp: tuple[float, ...]
    ema_decay: float | None
    compile: bool
    fp_exceptions: bool
    profile: bool
    profile_dir: str | None
    compile_only: bool
    bn_momentum: float


@dataclass(frozen=True)
class OptimConfig:
    optimiser: str
    learning_rate: float
    momentum: float
    weight_decay: float
    rmsprop_decay: float
    rmsprop_epsilon: float
    lars_eeta: float
    lars_epsilon: float
    lars_weight_decay: float
    lr_schedule: str
    warmup_epochs: float
    learning_rate_decay: float
    learning_rate_schedule: tuple[float, ...]
    lr_decay_rate: float | None
    lr_drops: int | None
    poly_power: float
    poly_end_ratio: float


@dataclass(frozen=True)
class LogConfig:
    log_dir: str
    logs_path: str | None
    name: str
    wandb: bool
    wandb_project: str
    tensorboard: bool
    all_instances: bool  # --log-all-instances: every process logs, not only rank 0
    ckpt_all_instances: bool  # --ckpt-all-instances: every process saves checkpoints


@dataclass(frozen=True)
class RunConfig:
    model: Any  # cnns.models.ModelSpec
    data: DataConfig
    precision: PrecisionConfig
    parallel: ParallelConfig
    train: TrainConfig
    optim: OptimConfig
    log: LogConfig
    device: str | None
    options: dict[str, Any] = field(repr=False, compare=False, default_factory=dict)

    @classmethod
    def from_options(cls, o: dict[str, Any]) -> "RunConfig":
        from cnns.models import ModelSpec  # models are optional for pure option handling

        dataset = o["dataset"]
        # None: a folder whose name and contents show no dataset (missing or empty, reported when the
        # data is read); the model defaults were CIFAR's (_model_defaults), so the model is built so too.
        cifar = dataset in CIFAR_LIKE or dataset is None
        source = "synthetic" if o["synthetic_data"] else ("generated" if o["generated_data"] else "files")
        image_size = 32 if cifar else o.get("image_size")
        # The run's class count (arguments.json records it; a run of an older version: the dataset's).
        num_classes = o.get("num_classes") or NUM_CLASSES.get(dataset, 10)
        model = ModelSpec(
            arch=o["model"], size=str(o["model_size"]), num_classes=num_classes,
            image_size=image_size or 224, norm="group" if o.get("group_norm") else "batch",
            groups=o["groups"], group_dim=o.get("group_dim") or 1, expand_ratio=o.get("expand_ratio") or 6,
            convolution_groups=o.get("convolution_groups") or 32,
            **({"group_width": o["group_dim"]} if o["model"] == "resnext" and o.get("group_dim") else {}),
        )
        data = DataConfig(
            dataset=dataset, data_dir=o.get("data_dir"), source=source,
            num_classes=num_classes, image_size=image_size,
            workers=o["pipeline_num_parallel"], normalise_imagenet=bool(o["normalise_input"]),
            host_normalisation=bool(o.get("hostside_norm")) and not o["eight_bit_io"],
            percentage=o["dataset_percentage_to_use"], cache=o["dataset_cache"],
            mixup_alpha=o["mixup_alpha"], cutmix_lambda=o["cutmix_lambda"], cutmix_version=o["cutmix_version"],
            skip_corrupt=bool(o.get("skip_corrupt_images")),
        )
        precision = PrecisionConfig(
            precision=o["precision"], half_dtype=o["half_dtype"],
            half_dtype_given=bool(o.get("half_dtype_given")), stochastic_rounding=o["stochastic_rounding"],
            loss_scaling=o["loss_scaling"], auto_loss_scaling=o["auto_loss_scaling"],
            grad_accum_dtype=o["gradient_accumulation_dtype"], half_partials=o["enable_half_partials"],
        )
        parallel = ParallelConfig(
            replicas=o["replicas"], shards=o["shards"], pipeline=o["pipeline"],
            splits=tuple(o["pipeline_splits"]) if o.get("pipeline_splits") is not None else None,
            schedule=o["pipeline_schedule"], recomputation=o["enable_recomputation"], bn_span=o["BN_span"],
            rts=o["rts"], offload_optimiser=o["offload_optimiser"],
            identical_seeding=bool(o.get("identical_replica_seeding")),
        )
        train = TrainConfig(
            micro_batch_size=o["micro_batch_size"], grad_accum=o["gradient_accumulation_count"],
            global_batch_size=o["global_batch_size"], epochs=o.get("epochs"), iterations=o.get("iterations"),
            device_iterations=o["device_iterations"], ckpts_per_epoch=o["ckpts_per_epoch"],
            ckpt_epochs_offset=o["ckpt_epochs_offset"] or 0.0,
            logs_per_epoch=o["logs_per_epoch"], log_freq=o["log_freq"],
            seed=int(o["seed"]) if o.get("seed") is not None else None,
            seed_given=bool(o.get("seed_specified", False)), validation=o["validation"],
            label_smoothing=o["label_smoothing"], weight_avg_N=tuple(o.get("weight_avg_N") or ()),
            weight_avg_exp=tuple(o.get("weight_avg_exp") or ()), ema_decay=o.get("ema_decay"),
            compile=o["compile"], fp_exceptions=o["fp_exceptions"], profile=o["profile"],
            profile_dir=o.get("profile_dir"), compile_only=o["compile_only"],
            bn_momentum=1.0 - o["BN_decay"],
        )
        optim = OptimConfig(
            optimiser=o["optimiser"], learning_rate=o["learning_rate"], momentum=o["momentum"],
            weight_decay=o["weight_decay"], rmsprop_decay=o["rmsprop_decay"], rmsprop_epsilon=o["rmsprop_epsilon"],
            lars_eeta=o["lars_eeta"], lars_epsilon=o["lars_epsilon"], lars_weight_decay=o["lars_weight_decay"],
            lr_schedule=o["lr_schedule"], warmup_epochs=o["warmup_epochs"] or 0.0,
            learning_rate_decay=o["learning_rate_decay"],
            learning_rate_schedule=parse_fractions(o["learning_rate_schedule"]),
            lr_decay_rate=o.get("lr_decay_rate"), lr_drops=o.get("lr_drops"),
            poly_power=o["poly_lr_decay_power"], poly_end_ratio=o["poly_lr_end_ratio"],
        )
        log = LogConfig(log_dir=o["log_dir"], logs_path=o.get("logs_path"), name=o["name"], wandb=o["wandb"],
                        wandb_project=o["wandb_project"], tensorboard=o["tensorboard"],
                        all_instances=bool(o.get("log_all_instances")),
                        ckpt_all_instances=bool(o.get("ckpt_all_instances")))
        return cls(model=model, data=data, precision=precision, parallel=parallel, train=train, optim=optim,
                   log=log, device=o.get("device"), options=dict(o))


def parse_fractions(value: Any) -> tuple[float, ...]:
    if isinstance(value, (list, tuple)):
        return tuple(float(v) for v in value)
    try:
        return tuple(float(v) for v in str(value).split(",") if v.strip())
    except ValueError:
        raise ConfigError(f"--learning-rate-schedule must be comma-separated fractions, got {value!r}") from None
