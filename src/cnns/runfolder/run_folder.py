"""A run folder, made and read back: the one place that knows what a run folder holds.

Training writes ``<log-dir>/<run name>/`` (or ``--logs-path``): ``arguments.json`` (the resolved
options), ``ckpt-<iteration>.pt`` checkpoints (each may hold an ``"ema"`` moving average),
``weight_avg_*.pt`` averages, and the logs. Every later command starts from it: `restore.py`
continues the run, `validation.py` and `weight_avg.py` evaluate it, `cnns predict` and `cnns export`
rebuild its model, `inference_embedded.py` loads a checkpoint. `RunFolder` is that folder read back; which of
its options each command keeps is `cnns.runfolder.options`'s, and **train.py** makes a new folder here
(`open_new_run`).

Every one of them reads --restore-path one way, `open_restore_path` (a run folder or a checkpoint in one, with
the same one line for nothing there, a folder that is not a run and a run without checkpoints), and the commands
that write a run folder hold its lock while they do (`cnns.runfolder.lock`).
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from cnns.config import RunConfig, check_option_types
from cnns.errors import CheckpointError, ConfigError, first_line
from cnns.runfolder.checkpoint import list_checkpoints, list_weight_averages, load_checkpoint
from cnns.runfolder.classes import class_names
from cnns.safe_writes import may_write, own_run_folder
from cnns.runfolder.lock import run_folder_lock
from cnns.runfolder.log import PROFILE_FOLDER, RunLog, new_run_folder, read_run_text, write_arguments

@dataclass
class RestorePoint:
    """The checkpoint a run continues from, read (and so checked) before anything is written, and the newer
    ones that could not be read (path, reason)."""

    path: Path
    state: dict[str, Any]
    skipped: tuple[tuple[Path, str], ...] = ()

    def release(self) -> None:
        """Let the checkpoint's tensors go once the model and optimiser hold them: a run keeps no second copy."""
        self.state = {}


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
        return open_restore_path(path).whole_run(path)

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
        """(class names in class-index order or None, where they come from): `cnns.runfolder.classes`."""
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

    def whole_run(self, given: str | Path) -> RunFolder:
        """The run, for a command that takes a whole run (restore.py, weight_avg.py); a CheckpointError (one line)
        where --restore-path (`given`) named a checkpoint file."""
        if self.file is not None:
            raise CheckpointError(f"--restore-path {given} is a checkpoint file: give its run folder {self.run.path}")
        return self.run


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
    (`cnns.runfolder.lock`: an existing --logs-path folder may be another command's): (the folder every process agreed
    on, None for --compile-only; after the launcher restarted the workers, the first attempt's newest checkpoint
    to continue from; this process's log; the folder another rank writes its own files to, if any)."""
    folder = agree_on_run_folder(cfg, world)
    with run_folder_lock(folder if world.is_writer else None):
        restore = newest_restore_point(folder, world) if world.restart > 0 and folder is not None else None
        log, instance_folder = run_log_for(cfg, world, folder, "train")
        yield folder, restore, log, instance_folder


def writer_log(cfg: RunConfig, folder: Path | None, command: str) -> RunLog:
    """The log of the process that writes `folder` for `command` (train, restore, validate, weight-avg): its lines
    and CSV files, and each row to TensorBoard (--tensorboard) and W&B (--wandb) at its iteration, everything in
    the run folder. None (--compile-only, a random model without --logs-path): the lines only."""
    log = RunLog(folder, tensorboard=cfg.log.tensorboard)
    if cfg.log.wandb and folder is not None:
        log.start_wandb(folder.name, command, cfg.arguments, cfg.log.wandb_project)
    return log


def run_log_for(cfg: RunConfig, world, folder: Path | None, command: str) -> tuple[RunLog, Path | None]:
    """Rank 0 writes the run folder (`writer_log`); another rank writes <run folder>/instance_<rank> when asked to
    (--log-all-instances / --ckpt-all-instances; its own TensorBoard events there, W&B being the run's) and is
    otherwise silent."""
    if world.is_writer or folder is None:
        return writer_log(cfg, folder, command), None
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


def trace_folder(cfg: RunConfig, folder: Path | None) -> Path:
    """Where --profile writes a command's trace: the --profile-dir this command's line gave, else <run folder>/profile
    (a restored or validated run never takes its arguments.json's --profile-dir: `cnns.runfolder.options`)."""
    return Path(cfg.train.profile_dir) if cfg.train.profile_dir else Path(folder) / PROFILE_FOLDER
