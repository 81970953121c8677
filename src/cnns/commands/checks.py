"""The checks every command makes before it writes anything or starts a process, and the notices that say
what a run's parallel options mean here. A command that fails one leaves no run folder behind.

The data's checks are its format's (`cnns.data.formats.check_data`); the split names' rule is the models'
(`cnns.models.split_points.stage_cuts`)."""

from __future__ import annotations

import os
from pathlib import Path

from cnns.bounded_reads import describe_size
from cnns.config import RunConfig
from cnns.config.defaults import stages_compile
from cnns.data.dali_probe import check_dali_installed
from cnns.data.formats import TrainingBatch, check_data
from cnns.devices import default_device_name
from cnns.errors import ConfigError
from cnns.parallel.world import restart_attempt
from cnns.runfolder.log import files_of_a_run


def check_supported(cfg: RunConfig, trains: bool = True) -> None:
    """Combinations that cannot run, found before any worker starts: one clear line each. Worker processes this one
    would start must fit in the machine's memory (estimated for a command that `trains` or only evaluates)."""
    from cnns.parallel.launch import check_machine_holds_workers

    p = cfg.parallel
    if p.shards > 1 or (p.pipeline and p.pipeline_splits and p.enable_recomputation):  # stages, or recomputation points
        check_pipeline_splits(cfg)
    if trains and p.BN_span > 1:
        check_spans_batch_norms(cfg)
    if cfg.train.compile and not stages_compile(p.shards):
        raise ConfigError("--compile with pipeline stages (--shards > 1) is not supported yet; "
                          "leave out --compile: pipeline stages run eagerly")
    check_optional_parts(cfg)
    check_machine_holds_workers(cfg, trains)


# The optional sinks, each with the module it needs and the line that names what to install: what train.py,
# restore.py, validation.py and weight_avg.py write besides their lines and CSV files (`cnns.runfolder.log.RunLog`).
OPTIONAL_SINKS = {
    "tensorboard": ("torch.utils.tensorboard", "--tensorboard needs the tensorboard package: pip install tensorboard "
                    "(or --no-tensorboard, also where the run's options ask for it)"),
    "wandb": ("wandb", "--wandb needs the wandb package: pip install 'cnns[wandb]' (or --no-wandb, also where the "
              "run's options ask for it)"),
}


# The options that write beside a run's lines and CSV files, by dest: what a command that writes no run folder refuses.
SINK_FLAGS = {"tensorboard": "--tensorboard", "wandb": "--wandb", "profile": "--profile"}


def asked_sinks(cfg: RunConfig) -> list[str]:
    """The flags of the sinks the run asks for (`SINK_FLAGS`)."""
    asked = {"tensorboard": cfg.log.tensorboard, "wandb": cfg.log.wandb, "profile": cfg.train.profile}
    return [flag for dest, flag in SINK_FLAGS.items() if asked[dest]]


def check_no_sinks_without_a_folder(cfg: RunConfig, why: str) -> None:
    """A command (or a use of one) that writes no run folder refuses the sinks, which would write nothing: one line
    (ConfigError) before anything runs, naming the commands that write them."""
    asked = asked_sinks(cfg)
    if asked:
        raise ConfigError(f"{' and '.join(asked)}: {why}, so there is nothing to log; they log the rows of a run "
                          "folder's training.csv and validation.csv (train.py, restore.py, validation.py with "
                          "--restore-path or --logs-path, weight_avg.py)")


def check_optional_parts(cfg: RunConfig) -> None:
    """Every optional package and device the run's options ask for, found in one place before any run folder, log
    folder or worker process exists (`check_supported`, which every command that writes a run folder calls
    first): the sinks' packages (`OPTIONAL_SINKS`), and where images are decoded (--decode-device cuda needs a
    run on a CUDA GPU, dali needs DALI). Each is one line naming what to install or change."""
    import importlib

    for dest, (module, line) in OPTIONAL_SINKS.items():
        if getattr(cfg.log, dest):
            try:
                importlib.import_module(module)
            except ImportError:
                raise ConfigError(line) from None
    if cfg.data.source != "files":  # generated and synthetic images are not decoded
        return
    device = cfg.device or default_device_name()
    if cfg.data.decode_device == "cuda" and not device.startswith("cuda"):
        raise ConfigError(f"--decode-device cuda needs a run on a CUDA GPU; this run is on {device}")
    if cfg.data.decode_device == "dali":  # the optional extra
        check_dali_installed()


def check_data_before_writing(cfg: RunConfig, *, train: bool = True, evaluation: bool | None = None) -> None:
    """Every data error that can be found cheaply, before a run folder is created, so that a bad command leaves
    nothing behind: missing data, more classes than the model has outputs, and for the splits the command reads
    (`train`; `evaluation`, by default when the run validates) that their files are there and readable, that one
    (global) batch fits in the training set and that the first image decodes (`cnns.data.formats`).
    Generated and synthetic data have nothing to check."""
    if cfg.data.source != "files":
        return
    evaluation = cfg.train.validation if evaluation is None else evaluation
    splits = [split for split, wanted in (("train", train), ("validation", evaluation)) if wanted]
    t = cfg.train
    batch = TrainingBatch.of(t.micro_batch_size, t.gradient_accumulation_count, cfg.parallel.replicas,
                             cfg.data.dataset_percentage_to_use)
    check_data(cfg.data.dataset, cfg.data.data_dir, splits, batch, outputs=cfg.model.num_classes,
               decode=not cfg.data.skip_corrupt_images, size_limit=cfg.data.max_file_size)
    check_shared_memory(cfg, splits)
    check_open_files(cfg, splits)


def check_shared_memory(cfg: RunConfig, splits: list[str], folder: str = "/dev/shm") -> None:
    """The data workers' batch buffers fit in the machine's shared memory (`folder`, where torch keeps it; Docker
    gives a container 64 MB): ConfigError naming what to lower or raise, before the run folder. Found only when a
    worker first writes a buffer otherwise, as a bus error. CIFAR-sized data is held and augmented in this process."""
    from cnns.data.formats import dataset_facts
    from cnns.data.image_loader import shared_memory_bytes

    workers = cfg.data.pipeline_num_parallel
    if workers == 0 or dataset_facts(cfg.data.dataset).cifar_sized:
        return
    sizes = {"train": cfg.train.micro_batch_size, "validation": cfg.train.eval_batch_size}
    needed = cfg.parallel.replicas * sum(shared_memory_bytes(workers, sizes[split], cfg.data.image_size)
                                         for split in splits)  # every replica on this machine has its workers
    try:
        status = os.statvfs(folder)
    except OSError:  # no such folder (not Linux): nothing to compare with
        return
    free = status.f_bavail * status.f_frsize
    if needed > free:
        raise ConfigError(f"--pipeline-num-parallel {workers}: the data workers need {describe_size(needed)} of "
                          f"shared memory for their batches, more than the {describe_size(free)} free in {folder}: lower "
                          "--pipeline-num-parallel or --micro-batch-size (or --batch-size), or give the machine more "
                          "(a Docker container: docker run --shm-size=8g)")


# Descriptors a run holds besides its data workers' (the interpreter, torch's libraries, the run's files), and each
# worker's besides its batch buffers (its pipes, the files it reads): measured, 2 workers failed under `ulimit -n 40`
# and ran under 64 (a lower bound: only a limit that cannot hold the run is refused).
FILES_OF_A_RUN, FILES_OF_A_WORKER = 32, 4


def check_open_files(cfg: RunConfig, splits: list[str]) -> None:
    """The descriptors the data workers' shared batches take (one per batch buffer, held open in this process)
    fit under this process's limit on open files: the soft limit is raised to the hard one where that is enough
    (as a user would, with `ulimit -n`), else ConfigError naming both what to raise and what to lower, before the
    run folder. CIFAR-sized data is held and augmented in this process."""
    import resource

    from cnns.data.formats import dataset_facts
    from cnns.data.image_loader import BATCH_BUFFERS_PER_WORKER

    workers = cfg.data.pipeline_num_parallel
    if workers == 0 or dataset_facts(cfg.data.dataset).cifar_sized:
        return
    needed = FILES_OF_A_RUN + workers * (FILES_OF_A_WORKER + BATCH_BUFFERS_PER_WORKER * len(splits))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if needed <= soft:
        return
    if hard == resource.RLIM_INFINITY or needed <= hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        return
    raise ConfigError(f"--pipeline-num-parallel {workers}: the data workers' batches need about {needed} open files, "
                      f"more than this process may open ({hard}): raise the limit (ulimit -n) or lower "
                      "--pipeline-num-parallel")


def check_pipeline_splits(cfg: RunConfig) -> None:
    """--pipeline-splits name the cuts of --shards stages (`cnns.models.split_points.stage_cuts`, the rule the stages
    apply), or `auto` for more than one stage."""
    from cnns.models import ModelError, build_model
    from cnns.models.split_points import stage_cuts

    splits, shards = list(cfg.parallel.pipeline_splits or ()), cfg.parallel.shards
    if splits == ["auto"]:
        if shards < 2:
            raise ConfigError("--pipeline-splits auto chooses where to cut stages: it needs --shards 2 or more")
        return
    try:
        stage_cuts(cfg.model, build_model(cfg.model), splits, shards)
    except ModelError as error:
        raise ConfigError(str(error)) from None


def check_spans_batch_norms(cfg: RunConfig) -> None:
    """--BN-span spans batch norms' statistics: a model without one (group norm, a timm model's layer norm) would
    train as without the option, which a run that asks for it would not know. The model is built on the meta device
    (no memory, no arithmetic) and its modules looked at, whatever family built it."""
    import torch
    from torch.nn.modules.batchnorm import _BatchNorm

    from cnns.models import build_model

    with torch.device("meta"):
        model = build_model(cfg.model)
    if any(isinstance(module, _BatchNorm) for module in model.modules()):
        return
    how = "--group-norm replaced them" if cfg.model.norm == "group" else "it normalises its own way"
    raise ConfigError(f"--BN-span {cfg.parallel.BN_span} spans the statistics of batch norms over replicas, and "
                      f"{cfg.model.display_name} has none ({how}): leave out --BN-span")


def wants_split_names(cfg: RunConfig) -> bool:
    """train.py --pipeline-splits with no names, or --shards without them: print the names it takes."""
    p = cfg.parallel
    return p.pipeline_splits == () or (p.shards > 1 and not p.pipeline_splits)


def print_split_points(cfg: RunConfig) -> int:
    from cnns.models import build_model, describe_split_points, split_points

    points = split_points(cfg.model, build_model(cfg.model))
    print(f"--pipeline-splits needs {max(1, cfg.parallel.shards - 1)} of these split names for "
          f"{cfg.model.tag} (aliases in brackets):")
    print(describe_split_points(points))
    return 0


def check_run_folder_place(cfg: RunConfig) -> None:
    """Where train.py makes its run folder (--log-dir, or --logs-path) is a folder, or can become one, that this
    process may write in: checked before any process starts or any file is written. (What only trying shows, a
    folder in /proc say, is one line too: `cnns.runfolder.run_folder.agree_on_run_folder`.)"""
    if cfg.train.compile_only:  # writes nothing
        return
    if not cfg.log.logs_path:
        check_run_name(cfg.log.name, cfg.log.log_dir, cfg.arguments.get("name_suffix"))
    option, target = ("--logs-path", cfg.log.logs_path) if cfg.log.logs_path else ("--log-dir", cfg.log.log_dir)
    path = Path(target)
    if cfg.log.logs_path:
        check_holds_no_run(path, option, continue_with="restore.py")
    existing = path
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        where = "is a file" if existing == path else f"cannot be made: {existing} is a file"
        raise ConfigError(f"{option} {target} {where}, not a folder")
    check_writable(existing, f"{option} {target}")
    check_disk_room(cfg, existing, f"{option} {target}")


def check_disk_room(cfg: RunConfig, folder: Path, what: str) -> None:
    """The file system the run folder goes on has room for the run's first checkpoint, its weights at least
    (`cnns.parallel.launch.model_memory`, on the CPU as it is saved): ConfigError before the run folder, naming the
    free space. A disk that fills later ends in one line with the checkpoints already written whole
    (`cnns.safe_writes`)."""
    import torch

    from cnns.parallel.launch import model_memory

    try:
        status = os.statvfs(folder)
    except OSError:  # not looked at here: the writes say what is wrong
        return
    if status.f_blocks == 0:  # a file system of no size (/proc, some network mounts): its writes say
        return
    free, needed = status.f_bavail * status.f_frsize, model_memory(cfg, False, torch.device("cpu"))
    if needed > free:
        raise ConfigError(f"{what}: the run's checkpoints need at least {describe_size(needed)} each, more than the "
                          f"{describe_size(free)} free there: free some space or choose another folder")


def check_holds_no_run(folder: Path, option: str, continue_with: str) -> None:
    """A new run's folder holds no other run (`cnns.runfolder.log.files_of_a_run`): writing there would replace its
    checkpoints and options and mix its rows with the new run's. Workers torchrun restarted after a failure
    continue their own first attempt's folder, which this does not refuse."""
    if restart_attempt() > 0:
        return
    found = files_of_a_run(folder)
    if found:
        shown = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
        raise ConfigError(f"{option} {folder} holds another run ({shown}): nothing was written; choose a new folder, "
                          f"or continue that run with {continue_with} --restore-path {folder}")


def check_run_name(name: str, log_dir: str, suffix: str | None) -> None:
    """The run name (the model options and --name-suffix) is one folder name: the run folder stays a folder of
    --log-dir. A '/' would make sub-folders, and '..' among them a run folder anywhere; a NUL byte no path holds."""
    separators = {"/", "\0"} | ({os.altsep} if os.altsep else set())
    found = sorted(separator for separator in separators if separator in name)
    if not found:
        return
    what = f"--name-suffix {suffix!r}" if suffix and any(s in suffix for s in found) else f"the run name {name!r}"
    shown = " or ".join(repr(s) for s in found)
    raise ConfigError(f"{what} holds {shown}: a run name is one folder name inside --log-dir {log_dir}, not a path")


def check_writable(folder: Path, what: str) -> None:
    """ConfigError unless this process may create files in `folder` (a read-only folder or file system)."""
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"{what}: cannot write in {folder} (read-only, or no permission)")


def parallel_notices(cfg: RunConfig) -> list[str]:
    """What a training run's parallel options mean here, where that is not what a reader expects."""
    p, notices = cfg.parallel, []
    if p.offload_optimiser and not (cfg.device or default_device_name()).startswith("cuda"):
        notices.append("--offload-optimiser has no effect on a CPU: the optimiser state is already in host memory")
    if p.pipeline and p.shards == 1:
        if p.pipeline_splits and p.enable_recomputation:
            notices.append("--pipeline with --shards 1: one stage; its --pipeline-splits are the recomputation "
                           "points (only the input of each segment between them is kept for the backward pass)")
        else:
            notices.append("--pipeline with --shards 1: one stage, nothing to pipeline; the whole model runs in "
                           "each process (the --pipeline-splits are not used)")
    if p.shards > 1 and cfg.log.ckpt_all_instances:
        notices.append("--ckpt-all-instances with pipeline stages: each process holds a part of the model, so only "
                       "rank 0 writes checkpoints (of the whole model, gathered from the stages)")
    if p.rts and p.replicas == 1:
        notices.append("--rts shards the optimiser state over replicas: with one replica it changes nothing")
    return notices
