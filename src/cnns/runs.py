"""A run folder, made and read back: the one place that knows what a run folder holds.

Training writes ``<log-dir>/<run name>/`` (or ``--logs-path``): ``arguments.json`` (the resolved
options), ``ckpt-<iteration>.pt`` checkpoints (each may hold an ``"ema"`` moving average),
``weight_avg_*.pt`` averages, and the logs. Every later command starts from it: `restore.py`
continues the run, `validation.py` and `weight_avg.py` evaluate it, `cnns predict` and `cnns export`
rebuild its model, `inference_embedded.py` loads a checkpoint. `RunFolder` is that folder read back,
and the merge rules here say which options of the run each of them keeps and which of its own
command line's values override them:

* **evaluation** (`evaluation_options`: validation.py, weight_avg.py, predict, export): the run's
  options overridden by every value the command line gives; one unpipelined process (replicas,
  shards, pipeline and recomputation reset) unless the command line asks for replicas; the training
  run's global batch size kept (it places a checkpoint in epochs) unless ``--global-batch-size``.
* **restore** (`restore_options`: restore.py): the run's options exactly, except the pipeline
  layout (``--shards``, ``--pipeline-splits``, ``--pipeline-schedule``), which may change because
  checkpoints hold the whole model and pipelines compute the same updates at any stage count.
* **inference_embedded.py** (`inference_run_options`): the run's model, dataset and precision under the
  command line's values; the rest (generated images, one process) is its own. **cnns benchmark** takes no run
  folder; **train.py** makes a new folder (`open_new_run`).

Every one of them reads --restore-path one way, `open_restore_path` (a run folder or a checkpoint in one, with
the same one line for nothing there, a folder that is not a run and a run without checkpoints), and the commands
that write a run folder hold its lock while they do (`cnns.runlock`).

This module sits below `cli/` (which parses argv into the values these rules take), `commands/`, the engine
and `bench/`, and above the modules that read the files (`checkpoint`, `config`, `runlog`).
"""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from cnns.checkpoint import list_checkpoints, list_weight_averages, load_checkpoint
from cnns.config import RunConfig, check_option_types, resolve
from cnns.config.defaults import stages_compile
from cnns.errors import CheckpointError, ConfigError, first_line
from cnns.files import may_write, own_run_folder
from cnns.runlock import run_folder_lock
from cnns.runlog import RunLog, new_run_folder, read_run_text, write_arguments

# Flags whose parser default is False: a False there cannot be told apart from "not given".
_FALSE_BY_DEFAULT = {"generated_data", "synthetic_data", "print_config", "dataset_benchmark", "force_recompile"}


@dataclass(frozen=True)
class RestorePoint:
    """The checkpoint a run continues from, read (and so checked) before anything is written, and the newer
    ones that could not be read (path, reason)."""

    path: Path
    state: dict[str, Any]
    skipped: tuple[tuple[Path, str], ...] = ()


# ----------------------------------------------------------------------------------------------
# The folder read back


@dataclass(frozen=True)
class RunFolder:
    """A finished (or interrupted) run's folder: its options, checkpoints and weights."""

    path: Path
    options: dict[str, Any]  # arguments.json, checked to make a RunConfig

    @classmethod
    def open(cls, path: str | Path) -> "RunFolder":
        """restore.py's and weight_avg.py's --restore-path, which take the whole run: `open_restore_path`, and a
        CheckpointError (one line) for a checkpoint file."""
        target = open_restore_path(path)
        if target.file is not None:
            raise CheckpointError(f"--restore-path {path} is a checkpoint file: give its run folder {target.run.path}")
        return target.run

    @property
    def config(self) -> RunConfig:
        """The training run's configuration, as it trained."""
        return RunConfig.from_options(self.options)

    def checkpoints(self) -> list[Path]:
        """ckpt-<iteration>.pt files, oldest first."""
        return [path for _, path in list_checkpoints(self.path)]

    def newest_checkpoint(self) -> Path | None:
        found = self.checkpoints()
        return found[-1] if found else None

    def require_checkpoints(self) -> list[Path]:
        """`checkpoints`, or the one line every command says for a run that has none."""
        found = self.checkpoints()
        if not found:
            raise CheckpointError(f"no checkpoints (ckpt-<iteration>.pt) found in {self.path}")
        return found

    def weight_averages(self) -> list[Path]:
        """weight_avg_*.pt files written by weight_avg.py (or by training with --weight-avg-*)."""
        return list_weight_averages(self.path)

    def weights(self, checkpoint: Path | None = None, which: str = "raw") -> dict[str, Any]:
        """A checkpoint's model state dict (the newest by default): its raw weights, or with "ema" the
        float32 moving average that --ema-decay runs keep beside them."""
        return checkpoint_weights(checkpoint or self.require_checkpoints()[-1], which)

    def class_names(self) -> tuple[list[str] | None, str]:
        """(class names in class-index order or None, where they come from); see `class_names`."""
        return class_names(self.config, self.path)


def read_run_options(folder: Path) -> dict[str, Any]:
    """The run's options from its arguments.json; CheckpointError naming the file when it is missing,
    unreadable, not a JSON object, or not the options of a cnns run (a missing option, a value of the
    wrong type)."""
    arguments = folder / "arguments.json"
    if not arguments.is_file():
        raise CheckpointError(f"{folder} has no arguments.json: not a cnns run folder")
    text = read_run_text(arguments)  # bounded, UTF-8, or one line
    try:
        options = json.loads(text)
    # JSONDecodeError is a ValueError; RecursionError for absurdly deep nesting.
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(f"{arguments} is not valid JSON: {first_line(exc)}") from None
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
        raise CheckpointError(f"{arguments} holds options that do not make a run: {first_line(exc)}") from None
    return options


@dataclass(frozen=True)
class RestoreTarget:
    """What --restore-path names: a run, and one checkpoint file of it or (None) the whole folder."""

    run: RunFolder
    file: Path | None

    def checkpoints(self) -> list[Path]:
        """The file named, or the run's checkpoints oldest first (CheckpointError, one line, when it has none)."""
        return [self.file] if self.file is not None else self.run.require_checkpoints()

    def checkpoint(self) -> Path:
        """The file named, or the run's newest checkpoint: what a command that loads one checkpoint loads."""
        return self.checkpoints()[-1]


def open_restore_path(restore_path: str | Path) -> RestoreTarget:
    """--restore-path as every command that starts from a trained run reads it (restore.py, validation.py,
    weight_avg.py, inference_embedded.py, cnns predict and export): a run folder, or a checkpoint file inside
    one; the run's arguments.json (read and checked) gives the model and the dataset. One line
    (CheckpointError) for a path with nothing there, a folder that is not a cnns run (`read_run_options`), a
    file whose folder is not one, and anything else (a FIFO, a device); a run without checkpoints is said by
    `RestoreTarget.checkpoints`, since reading a run's options needs none."""
    path = Path(restore_path)
    if path.is_dir():
        return RestoreTarget(RunFolder(path, read_run_options(path)), None)
    if path.is_file():
        return RestoreTarget(RunFolder(path.parent, read_run_options(path.parent)), path)
    if not path.exists():
        raise CheckpointError(f"--restore-path {path} is not a run folder: nothing is there")
    raise CheckpointError(f"--restore-path {path} is neither a run folder nor a checkpoint file")


def checkpoint_weights(checkpoint: Path, which: str = "raw") -> dict[str, Any]:
    """The state dict of a checkpoint (or weight-average) file: "raw" its "model" entry, "ema" its
    moving average; CheckpointError naming the file when it has none."""
    state = load_checkpoint(checkpoint)
    if which == "ema":
        if "ema" not in state:
            raise CheckpointError(f"{checkpoint} holds no moving average ('ema' entry): the run was trained "
                                  "without --ema-decay; use --weights raw")
        return state["ema"]
    return state["model"]


def newest_restore_point(folder: Path, world) -> RestorePoint | None:
    """The newest readable checkpoint of the run folder, or None when it has none. A newer one that cannot be
    read (a copy cut short, a crash of the disk) is skipped and named; none readable is a CheckpointError.
    With replicas rank 0 chooses, so every process continues from the same one."""
    chosen: tuple[str | None, list[tuple[str, str]]] = (None, [])
    state = None
    if world.is_writer:
        skipped = []
        for _, path in reversed(list_checkpoints(folder)):
            try:
                state = load_checkpoint(path)
            except CheckpointError as exc:
                skipped.append((str(path), str(exc)))
                continue
            chosen = (str(path), skipped)
            break
        else:
            chosen = (None, skipped)
    newest, skipped = world.broadcast(chosen)
    if newest is None:
        if skipped:
            raise CheckpointError(f"no readable checkpoint in {folder}: {skipped[0][1]}")
        return None
    if state is None:
        state = load_checkpoint(Path(newest))
    return RestorePoint(Path(newest), state, tuple((Path(path), reason) for path, reason in skipped))


# ----------------------------------------------------------------------------------------------
# The merge rules: the run's options, overridden by a later command's


def evaluation_options(values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """validation.py / weight_avg.py / predict / export: the command line's values over the run's
    arguments.json, for one process.

    `values` are the values of a parser of Graphcore's scripts (None where not given). Returns (resolved options, the
    run's arguments.json or {}). As in Graphcore's application, the training run's global batch size is kept (it
    places a checkpoint in epochs) unless --global-batch-size says otherwise.
    """
    base = _options_of_the_run(values)
    explicit = _given(values)
    merged = {**base, **explicit}
    if "half_dtype" in explicit and "half_dtype_given" not in explicit:  # not the device's default
        merged["half_dtype_given"] = True
    for key in ("replicas", "shards"):
        if key not in explicit:
            merged[key] = 1  # validation runs on one unpipelined process whatever training used
    if "replicas" not in explicit and "BN_span" not in explicit:
        merged["BN_span"] = 1  # evaluation uses the running statistics: no batch statistics to span
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


# What inference_embedded.py keeps of a run: what its checkpoint holds and how the model's inputs are scaled.
# The rest (data files, run length, parallelism) is the command line's: it times generated images in one process.
_MODEL_OPTIONS = ("model", "model_size", "num_classes", "dataset", "image_size", "group_norm", "groups", "group_dim",
                  "expand_ratio", "convolution_groups", "normalise_input", "precision", "half_dtype",
                  "half_dtype_given", "micro_batch_size")


def inference_run_options(values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """inference_embedded.py: (the command line's values over the model options of the run --restore-path
    names, those of the run's options it kept), so that a run's checkpoint is loaded into the run's model."""
    run = {key: value for key, value in _options_of_the_run(values).items() if key in _MODEL_OPTIONS}
    given = _given(values)
    merged = {**values, **run, **given}
    if "half_dtype" in given and run:  # the command line's half type, not the device's default
        merged["half_dtype_given"] = True
    return merged, run


def _options_of_the_run(values: dict[str, Any]) -> dict[str, Any]:
    """The arguments.json of the run --restore-path names ({} without one; one line for a path that is not a run).
    --print-config with a path that names nothing shows the command line's own options: Graphcore's documented
    command lines name placeholder folders (`--restore-path generated_checkpoints_dir_path`)."""
    if not values.get("restore_path"):
        return {}
    if values.get("print_config") and not Path(values["restore_path"]).exists():
        return {}
    options = dict(open_restore_path(values["restore_path"]).run.options)
    options.pop("name", None)
    return options


def _given(values: dict[str, Any]) -> dict[str, Any]:
    """The values a command line gave (argparse's None is "not given", and so is a flag's default False)."""
    return {k: v for k, v in values.items() if v is not None and not (v is False and k in _FALSE_BY_DEFAULT)}


def restore_options(run: RunFolder, values: dict[str, Any]) -> dict[str, Any]:
    """restore.py: the run's options with the stage layout its command line gives (`values`):
    checkpoints hold the whole model, and pipelines compute the same updates whatever the stage
    count, so a run continues on more or fewer devices."""
    options = dict(run.options)
    if values.get("shards") is None and values.get("pipeline_splits") is None and not values.get("pipeline_schedule"):
        return options
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
    if options["shards"] > 1 and not options.get("pipeline_splits"):
        raise ConfigError(f"--shards {options['shards']} needs --pipeline-splits")
    if not stages_compile(options["shards"]):
        options["compile"] = False
    return options  # the splits are checked against the model by the restore command


# ----------------------------------------------------------------------------------------------
# A new run's folder and its writers


def agree_on_run_folder(cfg: RunConfig, world) -> Path | None:
    """The run folder, made and named by rank 0 and agreed by all (restarted workers get the first
    attempt's); None for --compile-only, which writes nothing."""
    if cfg.train.compile_only:
        return None

    def make() -> str:
        option, target = ("--logs-path", cfg.log.logs_path) if cfg.log.logs_path else ("--log-dir", cfg.log.log_dir)
        try:
            if cfg.log.logs_path:
                Path(cfg.log.logs_path).mkdir(parents=True, exist_ok=True)
                return cfg.log.logs_path
            return str(new_run_folder(cfg.log.log_dir, cfg.log.name))
        except OSError as error:  # what only trying shows (a folder in /proc, say): one line, nothing written
            made = f" {error.filename}" if error.filename else ""
            raise ConfigError(f"{option} {target}: cannot create{made}: {error.strerror or error}") from None

    return Path(world.agree_on("run_folder", make))


@contextmanager
def open_new_run(cfg: RunConfig, world) -> Iterator[tuple[Path | None, RestorePoint | None, RunLog, Path | None]]:
    """train.py's run folder for this process, locked by the writer for as long as the body runs
    (`cnns.runlock`: an existing --logs-path folder may be another command's): (the folder every process agreed
    on, None for --compile-only; after the launcher restarted the workers, the first attempt's newest checkpoint
    to continue from; this process's log; the folder another rank writes its own files to, if any)."""
    folder = agree_on_run_folder(cfg, world)
    with run_folder_lock(folder if world.is_writer else None):
        restore = newest_restore_point(folder, world) if world.restart > 0 and folder is not None else None
        log, instance_folder = run_log_for(cfg, world, folder)
        yield folder, restore, log, instance_folder


def run_log_for(cfg: RunConfig, world, folder: Path | None) -> tuple[RunLog, Path | None]:
    """Rank 0 writes the run folder; another rank writes <run folder>/instance_<rank> when asked to
    (--log-all-instances / --ckpt-all-instances) and is otherwise silent."""
    if world.is_writer or folder is None:
        return RunLog(folder, tensorboard=cfg.log.tensorboard), None
    if not (cfg.log.log_all_instances or cfg.log.ckpt_all_instances):
        return RunLog(None, quiet=True), None
    instance = folder / f"instance_{world.rank}"
    own_run_folder(folder)  # rank 0 holds the lock for this rank too
    may_write(instance)  # not a link planted in the run folder
    instance.mkdir(exist_ok=True)
    if cfg.log.log_all_instances:
        return RunLog(instance, tensorboard=cfg.log.tensorboard), instance
    write_arguments(instance, cfg.arguments)
    return RunLog(None, quiet=True), instance


# ----------------------------------------------------------------------------------------------
# Class names


def data_folder(cfg: RunConfig, run_folder: Path | None = None) -> Path | None:
    """The run's data folder, if it is still there. arguments.json keeps --data-dir as it was given:
    a relative one is tried from here, then from where training ran (the run folder is
    <training directory>/<--log-dir>/<run name> unless --logs-path placed it elsewhere)."""
    if cfg.data.source != "files" or not cfg.data.data_dir:
        return None
    folder = Path(cfg.data.data_dir)
    candidates = [folder]
    log_dir = Path(cfg.log.log_dir) if cfg.log.log_dir else None
    if (not folder.is_absolute() and run_folder is not None and log_dir is not None and not log_dir.is_absolute()
            and not cfg.log.logs_path):
        up = len(log_dir.parts) + 1
        parents = run_folder.resolve().parents
        if up <= len(parents) - 1:
            candidates.append(parents[up - 1] / folder)
    return next((candidate for candidate in candidates if candidate.is_dir()), None)


def class_names(cfg: RunConfig, run_folder: Path | None = None) -> tuple[list[str] | None, str]:
    """(names in class-index order or None, where they come from).

    CIFAR-10's ``batches.meta.txt`` and CIFAR-100's ``fine_label_names.txt`` (as the official binary
    archives ship them) from the run's data folder or its archive subfolder; the built-in dataset's
    shape names; an ImageNet JPEG tree's class folder names (sorted: the dataset's class index).
    TFRecords carry no class list that the reader exposes, and a list with the wrong number of names
    is not trusted: then, and when the run's data folder is not there, None."""
    from cnns.data.builtin import BUILTIN_CLASSES

    count = int(cfg.model.num_classes)
    dataset = cfg.data.dataset
    if dataset == "builtin":
        return list(BUILTIN_CLASSES), "the built-in dataset"
    folder = data_folder(cfg, run_folder)
    if folder is None:
        return None, "none (class indices)"
    found: tuple[list[str], str] | None = None
    if dataset in ("cifar-10", "cifar-100"):
        found = _cifar_names(folder, dataset)
    elif dataset == "imagenet":
        found = _jpeg_tree_names(folder)
    if found is None:
        return None, "none (class indices)"
    names, source = found
    if len(names) != count:
        print(f"notice: {source} lists {len(names)} class names for a {count}-class model: "
              "printing class indices instead", file=sys.stderr)
        return None, "none (class indices)"
    return names, source


def _cifar_names(folder: Path, dataset: str) -> tuple[list[str], str] | None:
    filename, subfolder = (("batches.meta.txt", "cifar-10-batches-bin") if dataset == "cifar-10"
                           else ("fine_label_names.txt", "cifar-100-binary"))
    for place in (folder, folder / subfolder):
        path = place / filename
        if path.is_file():
            try:
                text = path.read_text(encoding="utf-8", errors="replace")
            except OSError:
                return None
            # The archives end the list with blank lines (and some copies with trailing spaces).
            return [line.strip() for line in text.splitlines() if line.strip()], str(path)
    return None


def _jpeg_tree_names(folder: Path) -> tuple[list[str], str] | None:
    from cnns.data.imagefolder import find_split_folder, list_classes

    # The dataset numbers classes by the training folder's sub-folders when there is one.
    for split in ("train", "validation"):
        split_folder = find_split_folder(folder, split)
        if split_folder is not None:
            names = list_classes(split_folder)
            if names:
                return names, f"the class folders of {split_folder}"
    return None
