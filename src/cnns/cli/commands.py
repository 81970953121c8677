"""The commands behind the root scripts and `cnns <command>`.

Each takes argv, resolves options, builds a RunConfig and calls into the package. They hold no
training logic themselves.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cnns.cli import parse_options, print_config, resolved_training_options
from cnns.config import RunConfig, resolve
from cnns.errors import CheckpointError, ConfigError
from cnns.runlog import RunLog, new_run_folder, write_arguments


def check_supported(options: dict[str, Any]) -> None:
    """Combinations that cannot run, found before any worker starts: one clear line each."""
    if options["shards"] > 1 or (options["pipeline"] and options.get("pipeline_splits")
                                 and options["enable_recomputation"]):  # stages, or recomputation points
        _check_pipeline_splits(options)
    if options["shards"] > 1 and options.get("compile"):
        raise ConfigError("--compile with pipeline stages (--shards > 1) is not supported yet; "
                          "leave out --compile (it measured no faster on a CPU)")
    if options["BN_span"] > 1 and options["replicas"] == 1:
        raise ConfigError(f"--BN-span {options['BN_span']} spans replicas: give --replicas (a multiple of it)")


def _check_pipeline_splits(options: dict[str, Any]) -> None:
    """--pipeline-splits name shards - 1 known cuts in the model's order (the stages check again), or
    `auto` for more than one stage."""
    from cnns.models import ModelError, build_model, describe_split_points, resolve_splits, split_points

    splits, shards = list(options["pipeline_splits"]), options["shards"]
    if splits == ["auto"]:
        if shards < 2:
            raise ConfigError("--pipeline-splits auto chooses where to cut stages: it needs --shards 2 or more")
        return
    cfg = RunConfig.from_options(options)
    model = build_model(cfg.model)
    try:
        resolve_splits(cfg.model, model, splits)
    except ModelError as error:
        raise ConfigError(str(error)) from None
    if shards > 1 and len(splits) != shards - 1:
        raise ConfigError(f"--shards {shards} needs {shards - 1} --pipeline-splits, got {len(splits)} "
                          f"({' '.join(splits)}); valid splits: {describe_split_points(split_points(cfg.model, model))}")


def _print_splits_and_exit(options: dict[str, Any]) -> int:
    from cnns.models import build_model, describe_split_points, split_points

    cfg = RunConfig.from_options(options)
    points = split_points(cfg.model, build_model(cfg.model))
    print(f"--pipeline-splits needs {max(1, options['shards'] - 1)} of these split names for "
          f"{cfg.model.arch}-{cfg.model.size} (aliases in brackets):")
    print(describe_split_points(points))
    return 0


def _check_data_before_writing(cfg: RunConfig) -> None:
    """Fail on missing data before a run folder is created, so a bad command leaves nothing behind."""
    from cnns.data.pipeline import resolve_dataset

    resolve_dataset(cfg.data)


def train_main(argv: list[str]) -> int:
    from cnns.engine.session import TrainingSession
    from cnns.parallel.launch import spawn_local_workers

    options, notices = resolved_training_options("train", argv)
    if options["print_config"]:
        return print_config(options)
    if options.get("pipeline_splits") == [] or (options["shards"] > 1 and not options.get("pipeline_splits")):
        return _print_splits_and_exit(options)
    check_supported(options)
    cfg = RunConfig.from_options(options)
    _check_data_before_writing(cfg)
    if options["dataset_benchmark"]:
        from cnns.bench.data import dataset_benchmark

        for notice in notices:
            print(notice)
        dataset_benchmark(cfg)  # the input pipeline alone: no model, no run folder
        return 0
    if _needs_workers(options):
        return spawn_local_workers("train", argv, options["replicas"] * options["shards"])
    world = _join_world(options, notices)
    try:
        cfg = RunConfig.from_options(options)  # with the seed every process agreed on
        folder = _run_folder(cfg, world)
        # After the launcher restarted the workers (one was lost): continue from the first attempt's
        # newest checkpoint, if it wrote one.
        restore = _newest_checkpoint(folder, world) if world.restart > 0 and folder is not None else None
        log, instance_folder = _run_log(cfg, world, folder)
        if folder is not None:
            log.print(f" Saving to {folder}")
        for notice in notices + _parallel_notices(options):
            log.notice(notice)
        log.write_arguments(options)
        if cfg.log.wandb and world.is_writer:
            log.start_wandb(cfg.log.wandb_project, cfg.log.name, options)
        try:
            return TrainingSession(cfg, log, folder, world, instance_folder).run(restore=restore)
        finally:
            log.close()
    finally:
        world.close()


def _needs_workers(options: dict[str, Any]) -> bool:
    """Several processes asked for and none started by a launcher: start them here."""
    from cnns.parallel.world import launched

    return options["replicas"] * options["shards"] > 1 and not launched()


def _join_world(options: dict[str, Any], notices: list[str] | None = None):
    """This process's place among the replicas; every process then runs rank 0's seed (and rank 0's
    choice of --pipeline-splits auto) and must have been given the same options."""
    from cnns.engine.build import resolve_device
    from cnns.parallel.world import init_world

    device = resolve_device(options.get("device"), options.get("select_ipus"))
    world = init_world(options["replicas"], options["shards"], options["BN_span"], device)
    try:
        options["seed"] = world.broadcast(options["seed"])
        _resolve_auto_splits(options, world, notices if notices is not None else [])
        world.check_same_options(options)
    except BaseException:
        world.close()
        raise
    return world


def _run_folder(cfg: RunConfig, world) -> Path | None:
    """The run folder, made by rank 0 and agreed by all (restarted workers get the first attempt's)."""
    if cfg.train.compile_only:
        return None

    def make() -> str:
        if cfg.log.logs_path:
            Path(cfg.log.logs_path).mkdir(parents=True, exist_ok=True)
            return cfg.log.logs_path
        return str(new_run_folder(cfg.log.log_dir, cfg.log.name))

    return Path(world.agree_on("run_folder", make))


def _run_log(cfg: RunConfig, world, folder: Path | None) -> tuple[RunLog, Path | None]:
    """Rank 0 writes the run folder; another rank writes <run folder>/instance_<rank> when asked to
    (--log-all-instances / --ckpt-all-instances) and is otherwise silent."""
    if world.is_writer or folder is None:
        return RunLog(folder, tensorboard=cfg.log.tensorboard), None
    if not (cfg.log.all_instances or cfg.log.ckpt_all_instances):
        return RunLog(None, quiet=True), None
    instance = folder / f"instance_{world.rank}"
    instance.mkdir(exist_ok=True)
    if cfg.log.all_instances:
        return RunLog(instance, tensorboard=cfg.log.tensorboard), instance
    write_arguments(instance, cfg.options)
    return RunLog(None, quiet=True), instance


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _parallel_notices(options: dict[str, Any]) -> list[str]:
    notices = []
    if options["offload_optimiser"] and not str(options.get("device") or _default_device()).startswith("cuda"):
        notices.append("--offload-optimiser has no effect on a CPU: the optimiser state is already in host memory")
    if options["pipeline"] and options["shards"] == 1:
        if options.get("pipeline_splits") and options["enable_recomputation"]:
            notices.append("--pipeline with --shards 1: one stage; its --pipeline-splits are the recomputation "
                           "points (only the input of each segment between them is kept for the backward pass)")
        else:
            notices.append("--pipeline with --shards 1: one stage, nothing to pipeline; the whole model runs in "
                           "each process (the --pipeline-splits are not used)")
    if options["shards"] > 1 and options.get("ckpt_all_instances"):
        notices.append("--ckpt-all-instances with pipeline stages: each process holds a part of the model, so only "
                       "rank 0 writes checkpoints (of the whole model, gathered from the stages)")
    if options["rts"] and options["replicas"] == 1:
        notices.append("--rts shards the optimiser state over replicas: with one replica it changes nothing")
    return notices


def _newest_checkpoint(folder: Path, world):
    """The newest checkpoint of the run folder, read (and so checked), or None when it has none.
    With replicas rank 0 chooses it, so every process continues from the same one."""
    from cnns.checkpoint import list_checkpoints, load_checkpoint
    from cnns.engine.session import RestorePoint

    checkpoints = list_checkpoints(folder) if world.is_writer else []
    newest = world.broadcast(str(checkpoints[-1][1]) if checkpoints else None)
    if newest is None:
        return None
    return RestorePoint(Path(newest), load_checkpoint(Path(newest)))


def _with_pipeline_layout(options: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """The run's options with the stage layout restore.py was given: checkpoints hold the whole model,
    and pipelines compute the same updates whatever the stage count, so a run continues on more or
    fewer devices."""
    if values.get("shards") is None and values.get("pipeline_splits") is None and not values.get("pipeline_schedule"):
        return options
    options = dict(options)
    if values.get("pipeline_schedule"):
        options["pipeline_schedule"] = values["pipeline_schedule"]
    if values.get("shards") is not None:
        if values["shards"] < 1:
            raise ConfigError(f"--shards must be at least 1, got {values['shards']}")
        options["shards"] = values["shards"]
        options["pipeline_splits"] = values.get("pipeline_splits") if values["shards"] > 1 else None
        options["pipeline"] = options["pipeline"] or values["shards"] > 1
    elif values.get("pipeline_splits") is not None:
        options["pipeline_splits"] = values["pipeline_splits"]
    if options["shards"] > 1:
        if not options.get("pipeline_splits"):
            raise ConfigError(f"--shards {options['shards']} needs --pipeline-splits")
        _check_pipeline_splits(options)
    return options


def _run_folder_options(restore_path: Path) -> dict[str, Any]:
    """The run's options from its arguments.json; CheckpointError naming the file when it is missing,
    unreadable, not a JSON object, or not the options of a cnns run (a missing option, a value of the
    wrong type)."""
    from cnns.config import check_option_types

    arguments = restore_path / "arguments.json"
    if not arguments.is_file():
        raise CheckpointError(f"{restore_path} has no arguments.json: not a cnns run folder")
    try:
        options = json.loads(arguments.read_bytes().decode("utf-8"))
    except OSError as exc:
        raise CheckpointError(f"cannot read {arguments}: {exc.strerror or exc}") from None
    # UnicodeDecodeError and JSONDecodeError are ValueErrors; RecursionError for absurdly deep nesting.
    except (ValueError, RecursionError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{arguments} is not valid JSON: {reason[:200]}") from None
    if not isinstance(options, dict):
        raise CheckpointError(f"{arguments} is not a JSON object of options: not a cnns run folder")
    try:
        check_option_types(options, str(arguments), strings_are_parsed=False)
    except ConfigError as exc:
        raise CheckpointError(str(exc)) from None
    try:  # every option a run needs is there (a KeyError otherwise) and of a usable kind
        RunConfig.from_options(options)
    except KeyError as exc:
        raise CheckpointError(f"{arguments} lacks the option {exc.args[0]!r}: not the arguments of a cnns run") from None
    except (TypeError, ValueError, AttributeError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{arguments} holds options that do not make a run: {reason[:200]}") from None
    return options


def restore_main(argv: list[str]) -> int:
    from cnns.engine.session import TrainingSession
    from cnns.parallel.launch import spawn_local_workers
    from cnns.parallel.world import World

    values, _ = parse_options("restore", argv)
    folder = Path(values["restore_path"])
    if not folder.is_dir():
        raise CheckpointError(f"--restore-path {folder} is not a run folder")
    options = _with_pipeline_layout(_run_folder_options(folder), values)
    if values.get("print_config"):
        return print_config(options)
    # Read the checkpoint before anything is written: a corrupt one leaves the run folder as it was.
    restore = _newest_checkpoint(folder, World())
    if restore is None:
        raise CheckpointError(f"no checkpoints (ckpt-<iteration>.pt) found in {folder}")
    if options.get("seed") is None and "seed" in restore.state:
        options["seed"] = int(restore.state["seed"])  # the data order of the run being continued
    cfg = RunConfig.from_options(options)
    _check_data_before_writing(cfg)
    if _needs_workers(options):
        return spawn_local_workers("restore", argv, options["replicas"] * options["shards"])
    world = _join_world(options)
    try:
        if world.distributed:  # every process continues from the checkpoint rank 0 chose
            restore = _newest_checkpoint(folder, world)
        log, instance_folder = _run_log(cfg, world, folder)
        try:
            return TrainingSession(cfg, log, folder, world, instance_folder).run(restore=restore)
        finally:
            log.close()
    finally:
        world.close()


def _evaluation_options(values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """validation.py / weight_avg.py: the command line over the run's arguments.json, for one process.

    Returns (resolved options, the run's arguments.json or {}). As in the seed, the training run's
    global batch size is kept (it places a checkpoint in epochs) unless --global-batch-size says otherwise.
    """
    restore_path = Path(values["restore_path"]) if values.get("restore_path") else None
    base: dict[str, Any] = {}
    if restore_path is not None:
        folder = restore_path if restore_path.is_dir() else restore_path.parent
        if (folder / "arguments.json").is_file():
            base = _run_folder_options(folder)
            base.pop("name", None)
    # Unset options are None; a False is a given --no-... flag, except for the few flags whose
    # parser default is False (they cannot be told apart from "not given").
    default_false = {"generated_data", "synthetic_data", "print_config", "dataset_benchmark", "force_recompile"}
    explicit = {k: v for k, v in values.items() if v is not None and not (v is False and k in default_false)}
    merged = {**base, **explicit}
    if "half_dtype" in explicit:
        merged["half_dtype_given"] = True
    for key in ("replicas", "shards"):
        if key not in explicit:
            merged[key] = 1  # validation runs on one unpipelined process whatever training used
    merged["pipeline"] = False
    merged["pipeline_splits"] = None
    merged["enable_recomputation"] = False
    options = resolve({**values, **merged})
    if options.get("seed") is None:
        options["seed"] = 0
    if values.get("global_batch_size"):
        options["global_batch_size"] = values["global_batch_size"]
    elif "global_batch_size" in base:
        options["global_batch_size"] = base["global_batch_size"]
    return options, base


def validate_main(argv: list[str]) -> int:
    from cnns.engine.validation import validate_command

    values, notices = parse_options("validate", argv)
    options, _ = _evaluation_options(values)
    if values["print_config"]:
        return print_config(options)
    check_supported(options)
    cfg = RunConfig.from_options(options)
    restore_path = Path(values["restore_path"]) if values.get("restore_path") else None
    if _needs_workers(options):
        from cnns.parallel.launch import spawn_local_workers

        return spawn_local_workers("validate", argv, options["replicas"] * options["shards"])
    world = _join_world(options)
    try:
        return validate_command(cfg, restore_path, repeat=values.get("repeat") or 1, notices=notices, world=world)
    finally:
        world.close()


def weight_avg_main(argv: list[str]) -> int:
    from cnns.engine.averaging import weight_avg_command

    values, notices = parse_options("weight-avg", argv)
    options, _ = _evaluation_options(values)
    if values["print_config"]:
        return print_config(options)
    if not values.get("restore_path"):
        raise ConfigError("weight_avg.py needs --restore-path <run folder>")
    options["replicas"] = 1  # averaging is file work; its one validation runs in this process
    options["BN_span"] = 1
    check_supported(options)
    cfg = RunConfig.from_options(options)
    # The training run's --no-validation does not carry over: only this command line's does.
    validate = values.get("validation") is not False
    if validate:
        _check_data_before_writing(cfg)
    return weight_avg_command(cfg, Path(values["restore_path"]), values["mode"], values.get("N"),
                              values.get("decay"), values.get("discard_last") or 0, validate, notices)


def infer_main(argv: list[str]) -> int:
    from cnns.engine.embedded import infer_command

    return infer_command(argv)


def benchmark_main(argv: list[str]) -> int:
    from cnns.bench.runner import benchmark_command

    return benchmark_command(argv)


def bench_data_main(argv: list[str]) -> int:
    from cnns.bench.data import bench_data_command

    return bench_data_command(argv)


def splits_main(argv: list[str]) -> int:
    """`cnns splits`: every cut of the model with what lies before it (parameters, activations, time
    of one micro-batch forward and backward) and the cuts that balance --shards stages (default 2)."""
    from cnns.bench.splits import format_report

    # The model's shape is all it needs: no data folder (ImageNet-sized unless --dataset says otherwise).
    if not any(a.startswith(("--data-dir", "--synthetic-data", "--generated-data")) for a in argv):
        argv = [*argv, "--synthetic-data"] + ([] if any(a.startswith("--dataset") for a in argv) else
                                              ["--dataset", "imagenet"])
    argv = argv if "--pipeline" in argv else [*argv, "--pipeline"]
    options, _ = resolved_training_options("train", argv)
    cfg = RunConfig.from_options(options)
    print(format_report(_split_proposal(cfg, stages=max(2, options["shards"]))))
    return 0


def _split_proposal(cfg: RunConfig, stages: int):
    """The profiled, balanced proposal for the run's model, micro-batch, precision and device."""
    from cnns.bench.splits import prepare_model, propose
    from cnns.engine.build import resolve_device

    device = resolve_device(cfg.device, cfg.options.get("select_ipus"))
    model, policy = prepare_model(cfg.model, device, cfg.precision.precision, cfg.precision.half_dtype)
    return propose(cfg.model, model, stages, cfg.train.micro_batch_size, device, policy.autocast)


def _resolve_auto_splits(options: dict[str, Any], world, notices: list[str]) -> None:
    """--pipeline-splits auto: rank 0 profiles the model and every process takes its proposal."""
    if options.get("pipeline_splits") != ["auto"]:
        return
    names = None
    if world.is_writer:
        proposal = _split_proposal(RunConfig.from_options(options), options["shards"])
        names = proposal.names
        times = ", ".join(f"{1000 * t:.1f}" for t in proposal.stage_seconds)
        notices.append(f"--pipeline-splits auto: {' '.join(names)} (measured forward + backward per stage and "
                       f"micro-batch: {times} ms; `cnns splits` shows every cut)")
    options["pipeline_splits"] = world.broadcast(names)


def plot_main(argv: list[str]) -> int:
    from cnns.cli.plot import plot_main as plot

    return plot(argv)


def predict_main(argv: list[str]) -> int:
    from cnns.inference.predict import predict_main as predict

    return predict(argv)


def export_main(argv: list[str]) -> int:
    from cnns.inference.export import export_main as export

    return export(argv)
