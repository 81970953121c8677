"""Graphcore's application's options: one table for the command line, configs.yml and arguments.json.

Every option of the original application's `train.py` / `validation.py` / `restore.py` /
`weight_avg.py` / `inference_embedded.py` is declared here as an argparse parser, with its
spellings and aliases, so that every command line of Graphcore's READMEs is accepted. `cnns.cli`
parses argv with these parsers; `cnns.config` checks configs.yml and arguments.json values against
the same declarations and turns the values into typed configuration objects. The table sits below
both, so that neither reaches up for the other.

Every default is left as ``None`` here and filled in by `cnns.config.defaults`, where each is declared once;
`--help` states them from there (`build_parser`'s `stated_default`), as they apply per dataset and model.
Every option that takes a number declares its domain here, once, as its argparse type (`Domain`: integer or real,
the interval, what 0 means); `cnns.config.config_files.check_domains` holds every value read to it, and --help states it.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cnns import optim
from cnns.data.formats import DATASETS
from cnns.precision import PRECISIONS
from cnns.config.strict_parser import StrictParser

# Options that only steer IPU compilation, memory planning or the Poplar runtime. They are accepted
# (so Graphcore's command lines and configurations still run), change nothing, and are named once in a
# notice. Keys are argparse dests; values are the spelled flag.
# The cadence rule in words: --help prints it under "Logging" and docs/outputs.md quotes it word for word
# (tests/test_checkpoint_cadence.py compares both, and the positions `cnns.engine.cadence.RunLength` gives with it).
CADENCE_RULE = ("Step lines and training.csv rows fall at the multiples of --log-freq F (with --iterations), or at "
                "updates floor(k x U / N), k = 1, 2, ..., for --logs-per-epoch N (with --epochs; U is the updates "
                "per epoch, the training images // the global batch). --ckpts-per-epoch N saves at updates "
                "floor(k x U / N) (N per epoch, the last at the epoch's last update) from --ckpt-epochs-offset on, "
                "the initial weights and the run's last update. The host syncs every --device-iterations D updates "
                "and wherever a line, a checkpoint or an epoch's end is due; checkpoints asked more often than every "
                "D updates (U / N below D) are saved at the first sync at or after each asked update instead.")

IPU_ONLY_OPTIONS = {
    # dest: (flag, kind) with kind "flag" (store_true), "value" (one value) or "list" (one or more values)
    "available_memory_proportion": ("--available-memory-proportion", "list"),
    "internal_exchange_optimisation_target": ("--internal-exchange-optimisation-target", "value"),
    "enable_conv_dithering": ("--enable-conv-dithering", "flag"),
    "disable_variable_offloading": ("--disable-variable-offloading", "flag"),
    "stable_norm": ("--stable-norm", "flag"),
    "force_unstable_norm": ("--force-unstable-norm", "flag"),
    "gather_conv_output": ("--gather-conv-output", "flag"),
    "num_io_tiles": ("--num-io-tiles", "value"),
    "max_cross_replica_buffer_size": ("--max-cross-replica-buffer-size", "value"),
    "max_reduce_many_buffer_size": ("--max-reduce-many-buffer-size", "value"),
    "gcl_max_broadcast_size": ("--gcl-max-broadcast-size", "value"),
    "min_remote_tensor_size": ("--min-remote-tensor-size", "value"),
    "executable_cache_path": ("--executable-cache-path", "value"),
    "force_weight_to_fp32": ("--force-weight-to-fp32", "list"),
    "only_use_slic_vmac_16": ("--only-use-slic-vmac-16", "flag"),
    "gradient_mean_reduce_re": ("--gradient-mean-reduce-re", "list"),
    "fused_preprocessing": ("--fused-preprocessing", "flag"),
    "mlperf_logging": ("--mlperf-logging", "flag"),
    "epochs_per_sync": ("--epochs-per-sync", "value"),
    "syncs_per_epoch": ("--syncs-per-epoch", "value"),
    "sharding_exclude_filter": ("--sharding-exclude-filter", "list"),
    "sharding_include_filter": ("--sharding-include-filter", "list"),
    "profile_compilation": ("--profile-compilation", "flag"),
    "xla_recompute": ("--xla-recompute", "flag"),
    "on_demand": ("--on-demand", "flag"),
    "prefetch_depth": ("--prefetch-depth", "value"),
    "saturate_on_overflow": ("--saturate-on-overflow", "flag"),
    "scheduling_algorithm": ("--scheduling-algorithm", "value"),
    "offload_fp32_weight_copy": ("--offload-fp32-weight-copy", "flag"),
    "latency": ("--latency", "flag"),
    "num_inference_thread": ("--num-inference-thread", "value"),
    "tmp_execs": ("--tmp-execs", "flag"),
    "variable_filter": ("--variable-filter", "list"),
    "lars_skip_list": ("--lars-skip-list", "list"),
}

EVAL_INTERPOLATIONS = ("bilinear", "bicubic")  # cnns.data.decoding's resamplers
SCHEDULES = ("stepped", "cosine", "exponential", "polynomial", "polynomial_decay_lr")
PIPELINE_SCHEDULES = ("Grouped", "Interleaved", "Sequential")

# Options that only some choices of another option use: dest -> (the choosing option's dest, the choices that
# use it). With any other choice such an option changes nothing: --print-config shows it as null and a
# command line that gives it gets one notice naming what would use it (`cnns.cli.parsing`). The optimisers'
# rows are their registry's (`cnns.optim`: the options each entry reads); tests/test_option_effects.py holds
# them to what each optimiser's recipe really reads.
USED_ONLY_WITH: dict[str, tuple[str, tuple[str, ...]]] = {
    **{dest: ("optimiser", users) for dest, users in optim.option_users().items()},
    "learning_rate_decay": ("lr_schedule", ("stepped",)),
    "learning_rate_schedule": ("lr_schedule", ("stepped",)),
    "lr_decay_rate": ("lr_schedule", ("exponential",)),
    "lr_drops": ("lr_schedule", ("exponential",)),
    "poly_lr_decay_power": ("lr_schedule", ("polynomial",)),
    "poly_lr_end_ratio": ("lr_schedule", ("polynomial",)),
    "abs_end_learning_rate": ("lr_schedule", ("polynomial",)),
}


def has_effect(dest: str, options) -> bool:
    """Whether option `dest` changes anything with the choices in `options`, resolved options (polynomial_decay_lr
    is polynomial there) in any mapping of dests to values."""
    if dest not in USED_ONLY_WITH:
        return True
    chooser, choices = USED_ONLY_WITH[dest]
    return options.get(chooser) in choices


def flag_of(dest: str) -> str:
    """The spelled flag of an option's dest (the table's options are spelled as their dests)."""
    return "--" + dest.replace("_", "-")


def _on_off(value: str) -> bool:
    lowered = value.strip().lower()
    # Graphcore's application's variants ON_prng_stable / RI_prng_stable are stochastic rounding too.
    if lowered in ("on", "true", "1", "yes", "on_prng_stable", "ri_prng_stable"):
        return True
    if lowered in ("off", "false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected ON or OFF, got {value!r}")


# Bounds the options' domains share: float32's largest number (what torch holds a learning rate or a loss scale in),
# torch's largest int64 (every count becomes a tensor size or an index somewhere), a length in epochs no run
# reaches (--epochs 1e308 would overflow the updates' count), a timeout the process groups' timedelta holds (a
# week: longer is a hang), more threads than any machine has cores (torch would start them all), and the
# classifier's outputs a tensor dimension takes.
FLOAT32_MAX, FLOAT32_TINY = 3.4028234663852886e38, 1.1754943508222875e-38
INT64_MAX = 2**63 - 1
EPOCHS_MAX = 1e6
DIST_TIMEOUT_MAX, THREADS_MAX = 7 * 24 * 3600.0, 4096
SEED_MAX = INT64_MAX  # torch.manual_seed takes a signed or unsigned 64-bit seed; cnns derives others by adding
CLASSES_MAX = 2**31 - 1


@dataclass(frozen=True)
class Domain:
    """The values one numeric option takes, declared with the option (its `type=`): its kind (int or float), an
    interval in the usual notation ("[1, inf)", "[0, 1)"; a float is always finite, an integer at most INT64_MAX),
    what 0 means where it means something apart (`zero`: "none", "only the last"), and words it takes besides
    numbers (`words`: "auto"). As argparse's type it only parses; `problem` is the one check every reader of
    options applies (the command line's resolution, configs.yml, a run's arguments.json read back), and --help
    states `phrase`."""

    kind: type
    within: str
    zero: str = ""
    words: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        assert self.kind in (int, float) and self.within[0] in "[(" and self.within[-1] in ")]", self

    @property
    def _ends(self) -> tuple[str, str]:
        low, high = (end.strip() for end in self.within[1:-1].split(","))
        return low, high

    @property
    def largest(self) -> float:
        """The largest magnitude torch holds of the kind: an unbounded end stands for it (and takes it)."""
        return INT64_MAX if self.kind is int else FLOAT32_MAX

    @property
    def bounds(self) -> tuple[float, float]:
        """The interval's ends, an unbounded end at `largest`."""
        low, high = (float(end) for end in self._ends)
        return max(low, -self.largest), min(high, self.largest)

    def __call__(self, text: str) -> int | float | str:
        """argparse's type: a word of `words`, or the text as the option's kind; ArgumentTypeError otherwise."""
        text = str(text).strip()
        if text.lower() in self.words:
            return text.lower()
        try:
            return self.kind(text)
        except ValueError:
            kind = "an integer" if self.kind is int else "a number"
            also = "".join(f" or {word}" for word in self.words)
            raise argparse.ArgumentTypeError(f"expected {kind}{also}, got {text!r}") from None

    def problem(self, value: Any) -> str | None:
        """What `value` must be ("must be at least 1"), or None when it lies in the domain."""
        if isinstance(value, str) and value in self.words:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float) if self.kind is float else int):
            return "must be " + ("an integer" if self.kind is int else "a number")
        if isinstance(value, float) and not math.isfinite(value):
            return "must be a finite number"
        low_text, high_text = self._ends  # an unbounded end's `largest` is itself in the domain
        if (value > self.largest and high_text == "inf") or (value < -self.largest and low_text == "-inf"):
            held = f"torch's int64 ({INT64_MAX})" if self.kind is int else f"float32 ({FLOAT32_MAX:g})"
            return f"must be {self.phrase} and within what {held} holds"
        low, high = self.bounds
        above = value > low if self.within[0] == "(" and low_text != "-inf" else value >= low
        below = value < high if self.within[-1] == ")" and high_text != "inf" else value <= high
        return None if above and below else "must be " + self.phrase

    @property
    def phrase(self) -> str:
        """The domain in words: "at least 1", "positive", "in [0, 1)", "auto or between 1 and 4096"."""
        low, high = self.bounds
        ends = [f"{end:g}" if self.kind is float else str(int(end)) for end in (low, high)]
        unbounded = self._ends[1] == "inf"
        if self._ends[0] == "-inf" and unbounded:
            words = "a finite number"
        elif unbounded and low == 0 and self.within[0] == "(":
            words = "positive"
        elif unbounded:
            words = f"at least {ends[0]}" if self.within[0] == "[" else f"greater than {ends[0]}"
        elif self.within[0] == "[" and self.within[-1] == "]":
            words = f"between {ends[0]} and {ends[1]}"
        else:
            words = f"in {self.within[0]}{ends[0]}, {ends[1]}{self.within[-1]}"
        return " or ".join([*self.words, words])

    def help(self) -> str:
        """What --help adds: "at least 0; 0: none"."""
        return self.phrase + (f"; 0: {self.zero}" if self.zero else "")


def domain_of(action: argparse.Action) -> Domain | None:
    """The domain an option's action declares, or None for an option that takes no number."""
    return action.type if isinstance(action.type, Domain) else None


# The domains that recur: a count of things (micro-batches, updates, stages), a fraction of one, a decay.
COUNT = Domain(int, "[1, inf)")
DECAY = Domain(float, "[0, 1)")
NON_NEGATIVE = Domain(float, "[0, inf)")
EPOCHS = Domain(float, f"(0, {EPOCHS_MAX:g}]")


_BYTE_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def byte_size(value: str) -> int:
    """A size in bytes: a number, or with K, M, G or T (1024-based; KiB, KB and the like read the same): 512M, 2G."""
    text = str(value).strip().upper().removesuffix("IB").removesuffix("B")  # str(): a number from configs.yml
    number, unit = (text[:-1], text[-1]) if text[-1:].isalpha() else (text, "")
    try:
        size = int(float(number) * _BYTE_UNITS[unit])
    except (KeyError, ValueError, OverflowError):  # an unknown unit, not a number, inf or nan
        raise argparse.ArgumentTypeError(f"expected a size such as 512M or 2G, got {value!r}") from None
    if size < 1:
        raise argparse.ArgumentTypeError(f"expected a size of at least one byte, got {value!r}")
    return size


def model_help() -> str:
    """--model's help from the model families' registry (`cnns.models.family`): the families by key, and the
    models a named family (timm's) takes by their own names."""
    from cnns.models.families import family_keys

    return (f"Model: one of the families {', '.join(family_keys())}, or a timm image classifier by its timm name "
            "(convnext_atto, regnetx_002, ...; `cnns models [PATTERN]` lists them); unknown names get the nearest.")


def family_option_help(dest: str) -> str:
    """The help of a model option some families read: each one's words for it (`ModelFamily.option_help`)."""
    from cnns.models.families import registered_families

    return "; ".join(f"{family.display}: {family.option_help[dest]}" for family in registered_families()
                     if dest in family.option_help) + "."


def model_size_help() -> str:
    """--model-size's help: each sized family's sizes on CIFAR-sized and on ImageNet-sized data."""
    from cnns.models.families import registered_families

    parts = []
    for family in registered_families():
        if family.named:
            continue
        cifar, imagenet = list(family.sizes(True)), list(family.sizes(False))
        sizes = (", ".join(cifar) if cifar == imagenet
                 else f"CIFAR: {', '.join(cifar)}; ImageNet: {', '.join(imagenet)}")
        parts.append(f"{family.display} {sizes}")
    return "The family's size: " + "; ".join(parts) + " (a timm model takes none: its name says it)."


def _model_size(value: str) -> str:
    # Graphcore's application accepts 4, B4 and b4 for EfficientNet; ResNet sizes are numbers. Keep it a string.
    return str(value)


# Every parser takes options exactly as typed (no prefixes) and errs in one line: `cnns.config.strict_parser`.
OneLineErrorParser = StrictParser


def _add_model_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Model")
    group.add_argument("--model", type=str.lower, metavar="MODEL", help=model_help())
    group.add_argument("--model-size", type=_model_size, help=model_size_help())
    norm = group.add_mutually_exclusive_group()
    norm.add_argument("--batch-norm", action="store_true", default=None, help="Batch normalisation.")
    norm.add_argument("--group-norm", action="store_true", default=None, help="Group normalisation.")
    group.add_argument("--groups", type=COUNT, help="Number of groups for group norm.")
    group.add_argument("--BN-span", "--bn-span", dest="BN_span", type=COUNT,
                       help="Number of replicas over which batch-norm statistics are computed.")
    group.add_argument("--BN-decay", "--bn-decay", dest="BN_decay", type=DECAY,
                       help="Batch-norm moving-average decay d, torch's momentum 1 - d.")
    for flag in ("--group-dim", "--expand-ratio", "--convolution-groups"):  # the families that read each say what
        group.add_argument(flag, type=COUNT, help=family_option_help(flag[2:].replace("-", "_")))
    group.add_argument("--image-size", type=Domain(int, "[8, 8192]"),
                       help="Input image size; CIFAR's images are 32 x 32.")


def _add_data_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Dataset")
    group.add_argument("--skip-corrupt-images", action="store_true", default=None,
                       help="ImageNet: drop images that cannot be decoded and count them, instead of stopping.")
    group.add_argument("--max-file-size", type=byte_size, metavar="SIZE",
                       help="The largest image, TFRecord record or CIFAR file read, e.g. 512M or 2G; a larger one, "
                            "or anything but a regular file, is named in one line and not read.")
    group.add_argument("--dataset", choices=tuple(DATASETS), type=str.lower,
                       help=f"{', '.join(list(DATASETS)[:-1])} or {list(DATASETS)[-1]} (inferred from --data-dir "
                            "when omitted: its path's name, else its files).")
    group.add_argument("--data-dir", help="Folder holding the dataset, or WebDataset shards named as one file, a glob, "
                                          "a brace pattern or a list joined by :: (docs/datasets.md; default: the "
                                          "DATA_DIR environment variable).")
    group.add_argument("--num-classes", type=Domain(int, f"[1, {CLASSES_MAX}]"),
                       help="Outputs of the classifier, at least the data's classes (default: the data's classes: a "
                            "folder tree's class folders, a shard set's labels, a Hugging Face dataset's ClassLabel, "
                            "else the dataset's: " + ", ".join(f"{d.num_classes:,} for {d.name}" for d in DATASETS.values())
                            + ").")
    synthetic = group.add_mutually_exclusive_group()
    synthetic.add_argument("--generated-data", action="store_true",
                           help="Random data made on the host and fed through the input pipeline.")
    synthetic.add_argument("--synthetic-data", action="store_true",
                           help="Random data made once on the device: no host input pipeline at all.")
    group.add_argument("--normalise-input", action="store_true", default=None,
                       help="Normalise by the ImageNet mean and standard deviation, not only subtract the mean.")
    group.add_argument("--eval-interpolation", choices=EVAL_INTERPOLATIONS,
                       help="Evaluation (validation and predict): the filter the short side is resized with, "
                            "antialiased; bicubic is PIL's, as timm's eval transform resizes.")
    group.add_argument("--eval-crop-pct", type=Domain(float, "(0, 1]"),
                       help="Evaluation (validation and predict): the fraction of the resized short side the "
                            "centre crop keeps, timm's crop_pct (the short side is resized to the image size / "
                            "this).")
    host_norm = group.add_mutually_exclusive_group()
    host_norm.add_argument("--hostside-norm", dest="hostside_norm", action="store_true", default=None,
                           help="Normalise images on the host.")
    host_norm.add_argument("--no-hostside-norm", dest="hostside_norm", action="store_false",
                           help="Normalise images on the device (the default here: images cross as uint8).")
    group.add_argument("--eight-bit-io", action="store_true", default=None,
                       help="Images cross from host to device as uint8 and are normalised on the device: what runs "
                            "unless --hostside-norm is given without it.")
    group.add_argument("--pipeline-num-parallel", type=Domain(int, "[0, 1024]", zero="load in the main process"),
                       help="Number of host data-loading worker processes.")
    group.add_argument("--decode-device", choices=("auto", "cpu", "cuda", "dali"),
                       help="ImageNet: where JPEGs are decoded: cpu (the workers), cuda (nvJPEG on the run's GPU, "
                            "then cropped there), dali (NVIDIA DALI: the crop's region on the GPU's hardware JPEG "
                            "decoder, or DALI's CPU backend on a CPU run; the optional extra: pip install -e '.[dali]'), or auto: dali "
                            "on a GPU with a hardware JPEG decoder where DALI is installed, else the CPU decoder "
                            "where its measured rate covers the step's estimated rate, else cuda.")
    group.add_argument("--no-dataset-cache", dest="dataset_cache", action="store_false", default=None,
                       help="Do not keep decoded datasets in host memory.")
    group.add_argument("--standard-imagenet", action="store_true", default=None,
                       help="Standard (reproducible) ImageNet preprocessing.")
    group.add_argument("--dataset-percentage-to-use", type=Domain(int, "[1, 100]"),
                       help="Use only this percentage of the training set.")
    group.add_argument("--mixup-alpha", type=Domain(float, "[0, inf)", zero="none"), help="Mixup alpha.")
    group.add_argument("--cutmix-lambda", type=Domain(float, "[0, 1]"), help="Cutmix lambda, 1 for none.")
    group.add_argument("--cutmix-version", type=int, choices=(1, 2), help="Cutmix variant.")
    group.add_argument("--dataset-benchmark", action="store_true",
                       help="Run the input pipeline alone and report images/s.")


def _add_training_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Training")
    # Graphcore's application's two spellings of one option, as two mutually exclusive arguments: the parser refuses
    # both on one command line (it would keep only the last, silently).
    batch = group.add_mutually_exclusive_group()
    batch.add_argument("--micro-batch-size", dest="micro_batch_size", type=COUNT,
                       help="Samples per forward/backward pass on one replica.")
    batch.add_argument("--batch-size", dest="micro_batch_size", type=COUNT,
                       help="Graphcore's spelling of --micro-batch-size.")
    group.add_argument("--gradient-accumulation-count", type=COUNT,
                       help="Micro-batches whose gradients are summed before one weight update.")
    group.add_argument("--gradient-accumulation-dtype", choices=("float32", "half", "auto"),
                       help="dtype of accumulated gradients.")
    length = group.add_mutually_exclusive_group()
    length.add_argument("--epochs", "--epoch", dest="epochs", type=EPOCHS,
                        help="Number of training epochs, without --iterations.")
    length.add_argument("--iterations", type=COUNT, help="Number of weight updates (instead of --epochs).")
    group.add_argument("--base-learning-rate-exponent", "--base-learning-rate", dest="base_learning_rate_exponent",
                       type=Domain(float, "(-inf, inf)"), help="Learning rate = 2^N x global batch size.")
    group.add_argument("--abs-learning-rate", type=Domain(float, "(0, inf)"),
                       help="Learning rate, overriding the exponent rule.")
    group.add_argument("--lr-schedule", choices=SCHEDULES, help="Learning-rate schedule.")
    group.add_argument("--warmup-epochs", type=Domain(float, f"[0, {EPOCHS_MAX:g}]", zero="none"),
                       help="Linear warm-up epochs; none with --iterations.")
    group.add_argument("--learning-rate-decay", type=Domain(float, "(0, inf)"),
                       help="Stepped: factor at each boundary.")
    group.add_argument("--learning-rate-schedule", type=str, help="Stepped: comma-separated fractions of training.")
    group.add_argument("--lr-decay-rate", type=Domain(float, "(0, inf)"), help="Exponential schedule: decay rate.")
    group.add_argument("--lr-drops", type=COUNT, help="Exponential schedule: number of decays over the whole run.")
    group.add_argument("--poly-lr-decay-power", type=NON_NEGATIVE, help="Polynomial schedule power.")
    group.add_argument("--poly-lr-end-ratio", type=NON_NEGATIVE,
                       help="Polynomial schedule: end lr as a fraction of the peak.")
    group.add_argument("--abs-end-learning-rate", type=NON_NEGATIVE, help="Polynomial schedule: absolute end lr.")
    # The optimisers and their options: the registry's entries (`cnns.optim`).
    group.add_argument("--optimiser", "--optimizer", dest="optimiser", choices=tuple(optim.OPTIMISERS),
                       type=lambda v: optim.canonical_name(v) or v, help="Optimiser.")
    for option in optim.OPTIONS.values():
        group.add_argument(option.flag, type=Domain(float, option.within or "(-inf, inf)"), help=f"{option.help}.")
    group.add_argument("--label-smoothing", type=DECAY, help="Label smoothing.")
    group.add_argument("--loss-scaling", type=Domain(float, "(0, inf)"), help="Static loss scale.")
    group.add_argument("--auto-loss-scaling", action="store_true", default=None,
                       help="Dynamic loss scaling: back off on overflow and skip that update.")
    group.add_argument("--seed", type=Domain(int, f"[0, {SEED_MAX}]"), help="Seed for a reproducible run.")
    group.add_argument("--init-path",
                       help="Start from these weights: a cnns checkpoint or run folder, or a timm-layout state dict "
                            "(.pt, .pth or .safetensors). The model only: optimiser, schedule and data order start "
                            "fresh; a classifier of another class count is initialised anew.")
    cadence = group.add_mutually_exclusive_group()
    cadence.add_argument("--ckpts-per-epoch", type=Domain(float, "[0, inf)", zero="only the last"),
                         help="Checkpoints per epoch (where: the rule under Logging).")
    cadence.add_argument("--epochs-per-ckpt", type=Domain(float, "[0, inf)", zero="by --ckpts-per-epoch"),
                         help="Epochs between checkpoints, instead of --ckpts-per-epoch.")
    group.add_argument("--ckpt-epochs-offset", type=NON_NEGATIVE,
                       help="No checkpoints of the cadence during the first N epochs (the initial weights and the "
                            "last update are saved still).")
    group.add_argument("--no-validation", dest="validation", action="store_false", default=None,
                       help="Do not validate the checkpoints after training.")
    group.add_argument("--validation-images", type=COUNT,
                       help="Generated/synthetic data only: images validated per checkpoint (default: as many as the "
                            "run trained on; validation.py: 20 batches). Real data is always validated whole.")
    group.add_argument("--weight-avg-N", "--weight-avg-n", dest="weight_avg_N", type=COUNT, nargs="+",
                       help="After training, validate the mean of the last N checkpoints.")
    group.add_argument("--weight-avg-exp", type=DECAY, nargs="+",
                       help="After training, validate the exponential average of the checkpoints with this decay.")
    group.add_argument("--ema-decay", type=Domain(float, "[0, 1)", zero="none"),
                       help="Exponential moving average of the weights during training.")
    group.add_argument("--compile", dest="compile", action="store_true", default=None,
                       help="torch.compile the model (the default on a CUDA GPU, with CUDA graphs; not on a CPU, where "
                            "it measured no faster).")
    group.add_argument("--no-compile", dest="compile", action="store_false", default=None,
                       help="Run the model eagerly, also on a GPU.")


def _add_device_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Device (IPU options mapped to CPU/CUDA)")
    group.add_argument("--precision", choices=PRECISIONS,
                       help="compute.master precision: 16.16 (half weights, stochastic rounding), 16.32 (autocast), 32.32.")
    group.add_argument("--half-dtype", choices=("bfloat16", "float16"),
                       help="The half type (default: the device's, bfloat16 on a CPU and on Ampere or later GPUs, "
                            "float16 on older GPUs).")
    rounding = group.add_mutually_exclusive_group()
    rounding.add_argument("--stochastic-rounding", type=_on_off, metavar="ON|OFF",
                          help="Stochastic rounding of 16.16 weight updates.")
    rounding.add_argument("--no-stochastic-rounding", dest="stochastic_rounding", action="store_false",
                          help="Round weight updates to nearest.")
    group.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when available).")
    group.add_argument("--select-ipus", "--select-ipu", dest="select_ipus", nargs="+", help="Graphcore's spelling of device selection: an index selects cuda:<index>.")
    group.add_argument("--replicas", type=Domain(int, "[1, inf)", words=("auto",)), help="Data-parallel replicas (processes), or auto: one per "
                       "usable core (CPU) or GPU; alone, train.py starts them itself; under torchrun, the "
                       "process count / --shards.")
    group.add_argument("--identical-replica-seeding", action="store_true", default=None,
                       help="The same random streams (mixing, dropout) on every replica.")
    group.add_argument("--log-all-instances", type=_on_off, metavar="true|false",
                       help="Every process (instance) logs, in <run folder>/instance_<rank>.")
    group.add_argument("--ckpt-all-instances", type=_on_off, metavar="true|false",
                       help="Every process (instance) saves checkpoints, in <run folder>/instance_<rank>.")
    group.add_argument("--pipeline", action="store_true", default=None, help="Pipeline the model over --shards stages.")
    _add_pipeline_layout_options(group)
    group.add_argument("--enable-recomputation", "--enable-recompute", dest="enable_recomputation",
                       action="store_true", default=None, help="Activation checkpointing at stage/block boundaries.")
    group.add_argument("--device-iterations", type=COUNT,
                       help="The most weight updates between host synchronisations, where the metrics are fetched "
                            "(the rule under Logging).")
    group.add_argument("--rts", "--replicated-tensor-sharding", dest="rts", action="store_true", default=None,
                       help="Shard optimiser state across replicas (ZeRO stage 1).")
    group.add_argument("--offload-optimiser", action="store_true", default=None,
                       help="Keep optimiser state in host memory (accelerators only).")
    group.add_argument("--enable-half-partials", action="store_true", default=None,
                       help="Allow reduced-precision reductions in half matmul/conv.")
    group.add_argument("--fp-exceptions", action="store_true", default=None,
                       help="Stop at the first NaN/Inf in loss or gradients.")
    group.add_argument("--profile", action="store_true", default=None, help="Write a PyTorch profiler trace.")
    group.add_argument("--profile-dir", help="Folder for the profiler trace (default: profile/ in the run folder).")
    group.add_argument("--compile-only", action="store_true", default=None,
                       help="Build everything, print the start-up lines and exit without training.")
    group.add_argument("--distributed", action="store_true", default=None, help="Graphcore's option: multi-process run (use --replicas).")
    _add_host_options(group)


def _add_host_options(group: argparse._ArgumentGroup) -> None:
    """How the processes use the machine: threads, waiting for peers, the CPU's fused passes and its allocator."""
    group.add_argument("--threads-per-worker", type=Domain(int, f"[1, {THREADS_MAX}]", words=("auto",)), metavar="N|auto",
                       help="CPU threads of each of several worker processes on one machine; auto shares the "
                            "usable cores out evenly.")
    group.add_argument("--dist-timeout", type=Domain(float, f"(0, {DIST_TIMEOUT_MAX:g}]"), metavar="SECONDS",
                       help="How long a rendezvous or collective waits for a peer before the run ends naming it.")
    group.add_argument("--fused-norm", choices=("auto", "on", "off"),
                       help="CPU: the fused norm + activation and squeeze-excitation passes: auto where they were "
                            "measured faster (the AVX-512 build), on wherever the kernels are built, off nowhere.")
    group.add_argument("--no-malloc-tuning", dest="malloc_tuning", action="store_false", default=None,
                       help="CPU: leave glibc's allocator as it is (by default it keeps freed tensor memory for "
                            "the next step instead of returning it to the kernel).")


def _add_pipeline_layout_options(group: argparse._ArgumentGroup, new_layout: bool = False) -> None:
    """--shards, --pipeline-splits and --pipeline-schedule, declared once: for train.py (and the scripts sharing its
    options), and for restore.py, which may continue a run with a `new_layout`. train.py's --pipeline-splits may
    come without names, to print the names it takes; restore.py's names the cuts of the new layout."""
    group.add_argument("--shards", type=COUNT, help="Pipeline stages from now on (1: the whole model per process)."
                       if new_layout else "Pipeline stages (processes) the model is split over.")
    group.add_argument("--pipeline-splits", "--pipeline-split", dest="pipeline_splits", nargs="+" if new_layout else "*",
                       help="Split points for the new --shards (one fewer than the shards)." if new_layout else
                       "Split points, one fewer than the shards; without values the valid names are printed.")
    group.add_argument("--pipeline-schedule", choices=PIPELINE_SCHEDULES, help="Grouped, Interleaved or Sequential.")


def _add_ipu_only_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("IPU-only options (accepted, no effect here)")
    for dest, (flag, kind) in IPU_ONLY_OPTIONS.items():
        if kind == "list":
            group.add_argument(flag, dest=dest, nargs="+", help=argparse.SUPPRESS)
        elif kind == "flag":
            group.add_argument(flag, dest=dest, action="store_true", default=None, help=argparse.SUPPRESS)
        else:
            group.add_argument(flag, dest=dest, help=argparse.SUPPRESS)
    group.description = "Accepted for compatibility with Graphcore's application, no effect here: " + ", ".join(
        sorted(flag for flag, _ in IPU_ONLY_OPTIONS.values()))


def _add_logging_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Logging", description=CADENCE_RULE)
    group.add_argument("--log-dir", help="Folder for run folders.")
    group.add_argument("--name-suffix", help="Appended to the run name.")
    group.add_argument("--logs-per-epoch", type=Domain(float, "[0, inf)", zero="one at the end of training"),
                       help="Step lines per epoch, with --epochs.")
    group.add_argument("--log-freq", type=COUNT, help="Updates between step lines, with --iterations.")
    group.add_argument("--logs-path", help="Exact run folder to write (instead of a generated name under --log-dir).")
    group.add_argument("--wandb", action="store_true", default=None, help="Log to Weights & Biases (offline by default).")
    group.add_argument("--wandb-project", help="Weights & Biases project name.")
    group.add_argument("--tensorboard", action="store_true", default=None, help="Also write TensorBoard event files.")
    _add_sinks_off(group)


def _add_sinks_off(group: argparse._ArgumentGroup) -> None:
    """--no-wandb and --no-tensorboard: a later command on a run (restore.py, validation.py, weight_avg.py) takes
    the run's own sinks from its arguments.json, and these leave them out (a machine without the package)."""
    group.add_argument("--no-wandb", dest="wandb", action="store_false", default=None,
                       help="No Weights & Biases, also where the run's options ask for it.")
    group.add_argument("--no-tensorboard", dest="tensorboard", action="store_false", default=None,
                       help="No TensorBoard event files, also where the run's options ask for them.")


def _add_config_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Configuration")
    group.add_argument("--config", help="Named configuration from configs.yml.")
    group.add_argument("--config-path", help="YAML file of named configurations (default: configs.yml).")
    group.add_argument("--print-config", action="store_true",
                       help="Print the resolved options as JSON and exit without reading data.")


def _add_validation_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Validation")
    group.add_argument("--restore-path", help="A run folder or one checkpoint file.")
    group.add_argument("--global-batch-size", type=COUNT, help="Global batch size of the training run (for the epoch).")
    group.add_argument("--repeat", type=COUNT,
                       help="Inference benchmark: passes over the data (generated/synthetic data).")
    group.add_argument("--validation-micro-batch-size", type=COUNT,
                       help="Batch size for validation (default: micro-batch).")


StatedDefault = Callable[[argparse.Action], str]  # an option's default as its help says it: " (default ...)" or ""


def build_parser(script: str, stated_default: StatedDefault | None = None) -> OneLineErrorParser:
    """The parser of one of Graphcore's scripts: train, validation, restore, weight_avg or inference_embedded.

    `stated_default` (`cnns.config.defaults.stated_default`, which the command line hands down: the defaults sit
    above this table) says an option's default in its help, " (default ...)" or ""; an option this table gives an
    argparse default of its own states that one."""
    prog = {"train": "train.py", "validate": "validation.py", "restore": "restore.py",
            "weight-avg": "weight_avg.py", "infer": "inference_embedded.py"}[script]
    parser = OneLineErrorParser(prog=prog, description=_DESCRIPTIONS[script])
    if script == "restore":
        parser.add_argument("--restore-path", required=True, help="The run folder to continue.")
        parser.add_argument("--print-config", action="store_true", help="Print the resolved options and exit.")
        # The pipeline's layout may change (the same updates on another device count); nothing else.
        _add_pipeline_layout_options(parser.add_argument_group("Continue with another pipeline layout"),
                                     new_layout=True)
        _add_sinks_off(parser.add_argument_group("Leave out the run's sinks"))
        return parser
    _add_config_options(parser)
    _add_model_options(parser)
    _add_data_options(parser)
    _add_training_options(parser)
    _add_device_options(parser)
    _add_logging_options(parser)
    if script in ("validate", "weight-avg", "infer"):
        _add_validation_options(parser)
    if script == "weight-avg":
        group = parser.add_argument_group("Weight averaging")
        group.add_argument("--mode", choices=("mean", "exponential"), default="mean")
        group.add_argument("-N", "--N", dest="N", type=COUNT, help="Average the last N checkpoints (default: all).")
        group.add_argument("--decay", type=DECAY, help="Exponential decay (default 0.97).")
        group.add_argument("--discard-last", type=Domain(int, "[0, inf)"), default=0,
                           help="Ignore the last k checkpoints.")
    if script == "infer":
        group = parser.add_argument_group("Embedded inference")
        group.add_argument("--force-recompile", action="store_true", help="Rebuild the compiled artefact.")
        group.add_argument("--artefact-path", help="Where the compiled model is kept.")
    _add_ipu_only_options(parser)
    _state_defaults(parser, stated_default)
    return parser


def _state_defaults(parser: argparse.ArgumentParser, stated_default: StatedDefault | None) -> None:
    """Each option's domain and default at the end of its help (before its last full stop): said once, by the first
    of the arguments an option has (--micro-batch-size, not --batch-size)."""
    seen: set[str] = set()
    for action in parser._actions:
        if action.dest in seen or action.help in (None, argparse.SUPPRESS):
            continue
        seen.add(action.dest)
        own = action.default not in (None, argparse.SUPPRESS) and not isinstance(action.default, bool)
        stated = f" (default {action.default})" if own else (stated_default(action) if stated_default else "")
        if domain_of(action) is not None:  # the values it takes, before its default
            stated = f"; {domain_of(action).help()}{stated}"
        if stated:
            action.help = (f"{action.help[:-1]}{stated}." if action.help.endswith(".") else action.help + stated)


def option_defaults(script: str) -> dict[str, object]:
    """Every option of a script at its default, as parsing an empty command line gives them (without
    reading one): the values of a command that was given nothing but what its caller sets."""
    defaults: dict[str, object] = {}
    for action in build_parser(script)._actions:
        if action.dest != "help":
            defaults.setdefault(action.dest, action.default)  # as argparse: an option's first action wins
    return defaults


_DESCRIPTIONS = {
    "train": "Train a CNN image classifier (the families of --model, or a timm model by name) on CIFAR or ImageNet.",
    "validate": "Validate the checkpoints of a run, or measure inference throughput on generated data. Options "
                "not given are the run's (its arguments.json); the defaults shown are those of a new run.",
    "restore": "Continue a training run from its newest checkpoint.",
    "weight-avg": "Average the weights of a run's checkpoints and validate the result. Options not given are the "
                  "run's (its arguments.json); the defaults shown are those of a new run.",
    "infer": "Inference from an ahead-of-time compiled model (torch.export + AOTInductor). With --restore-path, the "
             "model's options not given are the run's; the defaults shown are those of a new run.",
}
