"""The frozen, typed configuration of one run: what every part of the package below the commands reads.

`RunConfig.from_options` turns the resolved flat options (`cnns.config.defaults.resolve`) into typed
objects, once per process; a field has its option's name (`cfg.train.gradient_accumulation_count`),
except those docs/options.md names after it. Values the processes agree on later (the random seed,
automatic pipeline splits) come back as a `dataclasses.replace` of it (`with_seed`, `with_splits`); the
flat options stay beside it, read-only, only to be written as ``arguments.json``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

import torch

from cnns.config.defaults import GENERIC_DEFAULTS, check_label_smoothing, default_for, draw_seed, model_family
from cnns.data.formats import dataset_facts
from cnns.data.data_config import DataConfig
from cnns.devices import requested_device
from cnns.errors import ConfigError
from cnns.optim import OPTIONS, OptimiserInfo, optimiser_info
from cnns.precision import PrecisionPolicy, describe_precision

# ----------------------------------------------------------------------------------------------
# Typed configuration: what the rest of the package sees


@dataclass(frozen=True)
class PrecisionConfig:
    # --precision and --half-dtype as given (arguments.json keeps them): only `cnns.precision` reads what they mean.
    precision: str
    half_dtype: str
    half_dtype_given: bool  # chosen explicitly: used even where the CPU only emulates it
    stochastic_rounding: bool
    loss_scaling: float
    auto_loss_scaling: bool
    gradient_accumulation_dtype: str
    enable_half_partials: bool

    def policy(self, device: torch.device) -> PrecisionPolicy:
        """The precision policy these options give on `device`: the one reading of --precision and --half-dtype
        that training, the split planner and the inference artefact share."""
        return PrecisionPolicy.resolve(self.precision, self.half_dtype, device, half_dtype_given=self.half_dtype_given)

    def describe(self) -> str:
        """The precision these options ask for, as messages name it: "32.32", "16.16 (bfloat16)"."""
        return describe_precision(self.precision, self.half_dtype)


@dataclass(frozen=True)
class ParallelConfig:
    replicas: int
    shards: int
    pipeline: bool
    pipeline_splits: tuple[str, ...] | None
    pipeline_schedule: str
    enable_recomputation: bool
    BN_span: int
    rts: bool
    offload_optimiser: bool
    identical_replica_seeding: bool
    threads_per_worker: int | None  # --threads-per-worker; None (auto): the usable cores shared out evenly
    dist_timeout: float  # --dist-timeout: seconds a rendezvous or collective waits for a peer


@dataclass(frozen=True)
class TrainConfig:
    micro_batch_size: int
    eval_batch_size: int  # --validation-micro-batch-size, else the micro-batch size
    gradient_accumulation_count: int
    global_batch_size: int
    epochs: float | None
    iterations: int | None
    device_iterations: int
    ckpts_per_epoch: float
    ckpt_epochs_offset: float
    logs_per_epoch: float
    log_freq: int
    seed: int  # --seed, or drawn once as the configuration is made (and recorded in arguments.json)
    seed_specified: bool  # --seed was on the command line
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
    BN_decay: float  # Graphcore's decay d; a norm layer's torch momentum is 1 - d (cnns.engine.assembly)
    validation_images: int | None  # generated data: images validated per checkpoint
    init_path: str | None  # --init-path: the weights a new run starts from
    dataset_benchmark: bool  # --dataset-benchmark: time the input pipeline alone
    fused_norm: str  # --fused-norm: "auto" | "on" | "off" (cnns.engine.fusion.fused_norms)
    malloc_tuning: bool  # glibc keeps freed host memory for reuse (cnns.engine.build.keep_freed_host_memory)


@dataclass(frozen=True)
class OptimConfig:
    optimiser: str  # a name of the optimisers' registry (`cnns.optim.OPTIMISERS`)
    learning_rate: float
    # Every optimiser option's value by its dest (`cnns.optim.OPTIONS`), resolved; those `optimiser` does not
    # read are there too, unused.
    settings: Mapping[str, Any] = field(hash=False)
    lr_schedule: str
    warmup_epochs: float
    learning_rate_decay: float
    learning_rate_schedule: tuple[float, ...]
    # The exponential schedule's; None with another schedule (`cnns.config.defaults` fills them for this one).
    lr_decay_rate: float | None
    lr_drops: int | None
    poly_lr_decay_power: float
    poly_lr_end_ratio: float  # --abs-end-learning-rate is given as this ratio (`cnns.config.defaults`)

    @property
    def info(self) -> OptimiserInfo:
        """The optimiser's entry in the registry."""
        return optimiser_info(self.optimiser)

    @property
    def summary(self) -> str:
        """The optimiser as it really updates (its entry's summary): its momentum (none for SGD) and the weight
        decay it applies."""
        return self.info.summary.format(**self.settings)

    def used(self, dest: str) -> Any:
        """An optimiser option's value where the optimiser reads it, else None."""
        return self.settings[dest] if dest in self.info.reads else None


@dataclass(frozen=True)
class LogConfig:
    log_dir: str
    logs_path: str | None
    name: str
    wandb: bool
    wandb_project: str
    tensorboard: bool
    log_all_instances: bool  # every process logs, not only rank 0
    ckpt_all_instances: bool  # --ckpt-all-instances: every process saves checkpoints
    command: str  # the command line, as the run's log shows it


@dataclass(frozen=True)
class RunConfig:
    model: Any  # cnns.models.ModelSpec
    data: DataConfig
    precision: PrecisionConfig
    parallel: ParallelConfig
    train: TrainConfig
    optim: OptimConfig
    log: LogConfig
    device: str | None  # --device (or --select-ipus N as cuda:N); None: the machine's default
    # The resolved flat options, read-only: written as arguments.json (and compared between processes),
    # never read by the engine.
    arguments: Mapping[str, Any] = field(repr=False, compare=False, default_factory=lambda: MappingProxyType({}))

    @classmethod
    def from_options(cls, o: dict[str, Any]) -> "RunConfig":
        from cnns.models import ModelSpec  # models are optional for pure option handling

        if o.get("seed") is None:  # recorded in `arguments`, so a run can be replayed and continued
            o = {**o, "seed": draw_seed(), "seed_specified": False}
        dataset = o["dataset"]
        source = "synthetic" if o["synthetic_data"] else ("generated" if o["generated_data"] else "files")
        # The size resolved (`cnns.config.defaults`: 32 on CIFAR-sized data, and where the dataset is not known
        # yet, whose model defaults are CIFAR's); the arguments.json of a run of an older version, which
        # left it unset, trained at the default.
        image_size = o["image_size"] if o.get("image_size") is not None else default_for("image_size", o)
        # The run's class count (arguments.json records it; a run of an older version: the dataset's).
        num_classes = o.get("num_classes") or dataset_facts(dataset).num_classes
        check_label_smoothing(o["label_smoothing"], num_classes)
        # The architecture options its model reads (those its family gives defaults, `cnns.config.defaults`; none
        # of them for a ResNet, which takes the model's own), and those its family reads under another name.
        shape = {key: o[key] for key in ("group_dim", "expand_ratio", "convolution_groups") if o.get(key)}
        family = model_family(o)
        shape.update({field: o[dest] for dest, field in family.option_fields.items() if o.get(dest)})
        model = ModelSpec(
            arch=o["model"], size=str(o.get("model_size") or ""), num_classes=num_classes,
            image_size=image_size, norm="group" if o.get("group_norm") else "batch", groups=o["groups"], **shape,
        )
        data = DataConfig(
            dataset=dataset, data_dir=o.get("data_dir"), source=source,
            num_classes=num_classes, image_size=image_size,
            pipeline_num_parallel=o["pipeline_num_parallel"], normalise_input=bool(o["normalise_input"]),
            hostside_norm=bool(o.get("hostside_norm")) and not o["eight_bit_io"],
            dataset_percentage_to_use=o["dataset_percentage_to_use"], dataset_cache=o["dataset_cache"],
            mixup_alpha=o["mixup_alpha"], cutmix_lambda=o["cutmix_lambda"], cutmix_version=o["cutmix_version"],
            skip_corrupt_images=bool(o.get("skip_corrupt_images")), decode_device=o.get("decode_device") or "auto",
            max_file_size=o.get("max_file_size"),
            eval_interpolation=o.get("eval_interpolation") or default_for("eval_interpolation", o),
            eval_crop_pct=float(o.get("eval_crop_pct") or default_for("eval_crop_pct", o)),
        )
        precision = PrecisionConfig(
            precision=o["precision"], half_dtype=o["half_dtype"],
            half_dtype_given=bool(o.get("half_dtype_given")), stochastic_rounding=o["stochastic_rounding"],
            loss_scaling=o["loss_scaling"], auto_loss_scaling=o["auto_loss_scaling"],
            gradient_accumulation_dtype=o["gradient_accumulation_dtype"],
            enable_half_partials=o["enable_half_partials"],
        )
        parallel = ParallelConfig(
            replicas=o["replicas"], shards=o["shards"], pipeline=o["pipeline"],
            pipeline_splits=tuple(o["pipeline_splits"]) if o.get("pipeline_splits") is not None else None,
            pipeline_schedule=o["pipeline_schedule"], enable_recomputation=o["enable_recomputation"],
            BN_span=o["BN_span"],
            rts=o["rts"], offload_optimiser=o["offload_optimiser"],
            identical_replica_seeding=bool(o.get("identical_replica_seeding")),
            threads_per_worker=None if _setting(o, "threads_per_worker") == "auto" else int(o["threads_per_worker"]),
            dist_timeout=float(_setting(o, "dist_timeout")),
        )
        train = TrainConfig(
            micro_batch_size=o["micro_batch_size"],
            eval_batch_size=o.get("validation_micro_batch_size") or o["micro_batch_size"],
            gradient_accumulation_count=o["gradient_accumulation_count"],
            global_batch_size=o["global_batch_size"], epochs=o.get("epochs"), iterations=o.get("iterations"),
            device_iterations=o["device_iterations"], ckpts_per_epoch=o["ckpts_per_epoch"],
            ckpt_epochs_offset=o["ckpt_epochs_offset"] or 0.0,
            logs_per_epoch=o["logs_per_epoch"], log_freq=o["log_freq"],
            seed=int(o["seed"]),
            seed_specified=bool(o.get("seed_specified", False)), validation=o["validation"],
            label_smoothing=o["label_smoothing"], weight_avg_N=tuple(o.get("weight_avg_N") or ()),
            weight_avg_exp=tuple(o.get("weight_avg_exp") or ()), ema_decay=o.get("ema_decay"),
            compile=o["compile"], fp_exceptions=o["fp_exceptions"], profile=o["profile"],
            profile_dir=o.get("profile_dir"), compile_only=o["compile_only"],
            BN_decay=o["BN_decay"], validation_images=o.get("validation_images"),
            init_path=o.get("init_path"), dataset_benchmark=bool(o.get("dataset_benchmark")),
            fused_norm=_setting(o, "fused_norm"), malloc_tuning=bool(_setting(o, "malloc_tuning")),
        )
        optim = OptimConfig(
            optimiser=o["optimiser"], learning_rate=o["learning_rate"],
            settings=MappingProxyType({dest: o.get(dest) for dest in OPTIONS}),
            lr_schedule=o["lr_schedule"], warmup_epochs=o["warmup_epochs"] or 0.0,
            learning_rate_decay=o["learning_rate_decay"],
            learning_rate_schedule=parse_fractions(o["learning_rate_schedule"]),
            lr_decay_rate=o.get("lr_decay_rate"), lr_drops=o.get("lr_drops"),
            poly_lr_decay_power=o["poly_lr_decay_power"], poly_lr_end_ratio=o["poly_lr_end_ratio"],
        )
        log = LogConfig(log_dir=o["log_dir"], logs_path=o.get("logs_path"), name=o["name"], wandb=o["wandb"],
                        wandb_project=o["wandb_project"], tensorboard=o["tensorboard"],
                        log_all_instances=bool(o.get("log_all_instances")),
                        ckpt_all_instances=bool(o.get("ckpt_all_instances")), command=o.get("command", ""))
        return cls(model=model, data=data, precision=precision, parallel=parallel, train=train, optim=optim,
                   log=log, device=requested_device(o.get("device"), o.get("select_ipus")),
                   arguments=MappingProxyType(dict(o)))

    def with_seed(self, seed: int) -> "RunConfig":
        """The configuration with the random seed every process agreed on (rank 0's), or a restored run's."""
        return dataclasses.replace(self, train=dataclasses.replace(self.train, seed=int(seed)),
                                   arguments=MappingProxyType({**self.arguments, "seed": int(seed)}))

    def with_splits(self, names: list[str]) -> "RunConfig":
        """The configuration with the pipeline's cut points chosen (--pipeline-splits auto)."""
        return dataclasses.replace(self, parallel=dataclasses.replace(self.parallel, pipeline_splits=tuple(names)),
                                   arguments=MappingProxyType({**self.arguments, "pipeline_splits": list(names)}))


def _setting(o: Mapping[str, Any], key: str) -> Any:
    """An option that a run of an older version did not record (its arguments.json lacks it): the default, which
    is what that run used."""
    return o[key] if o.get(key) is not None else GENERIC_DEFAULTS[key]


def parse_fractions(value: Any) -> tuple[float, ...]:
    if isinstance(value, (list, tuple)):
        return tuple(float(v) for v in value)
    try:
        return tuple(float(v) for v in str(value).split(",") if v.strip())
    except ValueError:
        raise ConfigError(f"--learning-rate-schedule must be comma-separated fractions, got {value!r}") from None
