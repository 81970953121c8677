"""The run folder and everything written to it, in Graphcore's application's wording.

``logs/<name>_<3 random chars>/`` holds arguments.json, log.txt (everything printed), training.csv,
validation.csv and the checkpoints. The printed lines keep Graphcore's application's format so existing
log parsers read them; `cnns benchmark` reads the img_per_sec column of the CSV files.

training.csv and validation.csv hold each iteration once, in order. A run that stopped without a checkpoint at
its last logged iteration (killed, or its newest checkpoint unreadable) and is continued from an earlier
checkpoint logs those iterations again; the rows it had logged past that checkpoint are then moved, before
the first new one, to ``training.abandoned.csv`` (``validation.abandoned.csv``) beside the file, with a notice
(`RunLog.continue_after`). They stay readable there; the plots read only the ordered files.

TensorBoard (``tensorboard/``) and W&B (``wandb/``) chart the same rows, each at its iteration (`training_scalars`,
`validation_scalars`): a continued run's TensorBoard events replace the killed run's past its checkpoint, as its
CSV rows do, and W&B's charts are drawn against the iteration, never W&B's own step.
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import random
import re
import string
import sys
from contextlib import contextmanager
from fnmatch import fnmatch
from pathlib import Path
from typing import Any, Mapping

from cnns.bounded_reads import UnreadableFile, read_bounded
from cnns.errors import CheckpointError, ConfigError, WriteError
from cnns.safe_writes import append, declare_run_files, restore_size, size_before, write_atomically

TRAINING_FILE, VALIDATION_FILE, LOG_FILE = "training.csv", "validation.csv", "log.txt"
TRAINING_COLUMNS = ("step", "iteration", "epoch", "lr", "loss_batch", "loss_avg", "train_acc_batch",
                    "train_acc_avg", "it_time", "img_per_sec", "total_time")
# Graphcore's application's columns, then top-5 accuracy (an addition at the end, so positional parsers still work).
VALIDATION_COLUMNS = ("name", "iteration", "epoch", "val_acc", "raw_acc", "val_time", "val_size",
                      "img_per_sec", "latency", "val_top5")
TRAINED_SCALARS = ("lr", "loss_avg", "train_acc_avg", "img_per_sec")  # charted by TensorBoard and W&B
WANDB_STEP = "iteration"  # the x axis of every W&B chart: the rows' iteration

STEP_LINE = ("step: {step:6d}, iteration: {iteration:6d}, epoch: {epoch:6.2f}, lr: {lr:6.4g}, "
             "loss: {loss_avg:6.3f}, top-1 accuracy: {train_acc_avg:6.3f}%, "
             "throughput: {img_per_sec:6.2f} samples/sec, time: {it_time:8.6f}, total_time: {total_time:8.1f}")
VALIDATION_LINE = ("Validation top-1 accuracy: {val_acc:6.3f}% [{name}] (iteration: {iteration:6d}, "
                   "epoch: {epoch:6.2f}, throughput: {img_per_sec:6.2f} samples/sec, time: {val_time:8.6f}, "
                   "latency avg: {latency:8.4f} ms)")


# What a run writes in its folder: its log, CSVs, options, checkpoints and averages, plot, TensorBoard and instance
# folders (the lock aside), as fnmatch patterns. Declared to cnns.safe_writes, which refuses a link planted under any.
TENSORBOARD_FOLDER, PROFILE_FOLDER, WANDB_FOLDER = "tensorboard", "profile", "wandb"
RUN_FILES = (TRAINING_FILE, VALIDATION_FILE, LOG_FILE, "arguments.json", "training.png", TENSORBOARD_FOLDER,
             PROFILE_FOLDER, WANDB_FOLDER, "ckpt-*.pt", "weight_avg*.pt", "*.abandoned.csv", "instance_*")
declare_run_files(RUN_FILES)


def files_of_a_run(folder: str | Path) -> list[str]:
    """The names in `folder` that a run writes (RUN_FILES), sorted: a folder that holds any of them holds a run,
    which a new run must not write into. (A .lock alone is not a run: a launcher takes it before its workers check
    the folder.)"""
    try:
        entries = [entry.name for entry in Path(folder).iterdir()]
    except OSError:  # missing, not a folder, or unreadable (whether it may be written is checked on its own)
        return []
    return sorted(name for name in entries if any(fnmatch(name, pattern) for pattern in RUN_FILES))


RUN_SUFFIX_ALPHABET = string.ascii_uppercase + string.digits
RUN_SUFFIX_LENGTH = 3
RANDOM_SUFFIX_TRIES = 64  # then the names left are looked for in order: a full --log-dir ends, never spins


def new_run_folder(log_dir: str | Path, name: str) -> Path:
    """Create ``<log_dir>/<name>_<3 random chars>``; never reuses an existing folder.

    The suffix comes from a private Random so that a seeded run's random streams are untouched. A few random
    draws, then every suffix in turn: once all 36^3 = 46,656 names exist the command ends in one line (ConfigError)
    instead of drawing for ever.
    """
    chooser = random.Random()
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    drawn = ("".join(chooser.choice(RUN_SUFFIX_ALPHABET) for _ in range(RUN_SUFFIX_LENGTH))
             for _ in range(RANDOM_SUFFIX_TRIES))
    every = ("".join(letters) for letters in itertools.product(RUN_SUFFIX_ALPHABET, repeat=RUN_SUFFIX_LENGTH))
    for suffix in itertools.chain(drawn, every):
        folder = Path(log_dir) / f"{name}_{suffix}"
        try:
            folder.mkdir()
            return folder
        except FileExistsError:
            continue
    raise ConfigError(f"all {len(RUN_SUFFIX_ALPHABET) ** RUN_SUFFIX_LENGTH:,} run folders {name}_XXX exist in "
                      f"{log_dir}: give another --log-dir or a --name-suffix")


def interactive() -> bool:
    """Whether a person watches: progress bars only on a terminal, never in pipes, files or CI logs."""
    return sys.stderr.isatty() and sys.stdout.isatty()


class RunLog:
    """Prints lines to the screen and log.txt, and appends rows to the run's CSV files.

    With `folder=None` (non-zero ranks, inference benchmarks) it only prints, or stays silent when
    `quiet`. On a terminal, `progress` shows a bar (tqdm) under the printed lines; elsewhere only the
    lines are printed, each flushed as it is written so a pipe shows it at once.
    """

    def __init__(self, folder: Path | None, quiet: bool = False, tensorboard: bool = False):
        self.folder = folder
        self.quiet = quiet
        self._tensorboard = folder is not None and tensorboard  # the writer is made at the first scalar
        self._tb = None
        self._purge_step: int | None = None  # a continued run's first iteration: TensorBoard drops what lies past
        self._wandb = None
        self._bar = None

    def start_wandb(self, name: str, job: str, options: Mapping[str, Any], project: str) -> None:
        """Weights & Biases, offline unless WANDB_MODE says otherwise (no network is assumed), with everything it
        writes (its offline run, settings and caches) in ``<run folder>/wandb`` unless its variables say otherwise.
        Its charts' x axis is the iteration (`WANDB_STEP`), as the CSV files', not W&B's own count of calls: a
        validation row comes after training rows of later iterations, which W&B's step would refuse (it only grows).
        `cnns.commands.checks.check_optional_parts` found the package before the run folder was made."""
        import os

        import wandb

        if self.folder is None:
            return
        own = self.folder / WANDB_FOLDER
        os.environ.setdefault("WANDB_MODE", "offline")
        for variable in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
            os.environ.setdefault(variable, str(own))
        own.mkdir(exist_ok=True)
        self._wandb = wandb.init(project=project, name=name, group=name, job_type=job, config=dict(options),
                                 dir=str(self.folder))
        self._wandb.define_metric(WANDB_STEP)
        for family in ("train/*", "validation*"):
            self._wandb.define_metric(family, step_metric=WANDB_STEP)

    def print(self, line: str = "") -> None:
        if self.quiet:
            return
        if self._bar is not None:
            self._bar.write(line)  # above the bar, which is redrawn below it
            sys.stdout.flush()
        else:
            print(line, flush=True)
        if self.folder is not None:
            append(self.folder / LOG_FILE, line + "\n")

    @contextmanager
    def progress(self, total: int, initial: int = 0, description: str = "", unit: str = "it"):
        """A progress bar on a terminal (None elsewhere): `bar.update(n)`, `bar.set_postfix_str(...)`."""
        if self.quiet or not interactive() or self._bar is not None:
            yield None
            return
        from tqdm import tqdm

        self._bar = tqdm(total=total, initial=initial, desc=description, unit=unit, dynamic_ncols=True, leave=False)
        try:
            yield self._bar
        finally:
            self._bar.close()
            self._bar = None

    def notice(self, line: str) -> None:
        self.print(f"notice: {line}")

    def write_arguments(self, options: Mapping[str, Any], filename: str = "arguments.json") -> None:
        if self.folder is not None:
            write_arguments(self.folder, options, filename)

    def _append_csv(self, filename: str, columns: tuple[str, ...], row: dict[str, Any]) -> None:
        if self.folder is None:
            return
        path = self.folder / filename
        text = io.StringIO()  # the header (for a new file) and the row, appended whole or not at all
        writer = csv.DictWriter(text, fieldnames=columns, extrasaction="ignore")
        if not path.exists() or path.stat().st_size == 0:
            writer.writeheader()
        writer.writerow(row)
        append(path, text.getvalue())

    def continue_after(self, iteration: int) -> list[str]:
        """A run continued from its checkpoint at `iteration`: the rows its CSV files hold past it are set apart
        (`set_apart_rows_after`) so the continued run's rows follow in order. Returns a notice for each file."""
        if self.folder is None:
            return []
        if self._tb is not None:  # not made yet in a continued run; made again past `iteration` if it was
            self._tb.close()
            self._tb = None
        self._purge_step = iteration + 1
        notices = (set_apart_rows_after(self.folder / name, iteration) for name in (TRAINING_FILE, VALIDATION_FILE))
        return [notice for notice in notices if notice is not None]

    def training_step(self, row: dict[str, Any]) -> None:
        self.print(STEP_LINE.format(**row))
        self._append_csv(TRAINING_FILE, TRAINING_COLUMNS, row)
        self._to_sinks(training_scalars(row), row["iteration"])

    def validation_result(self, row: dict[str, Any]) -> None:
        self.print(VALIDATION_LINE.format(**row))
        self._append_csv(VALIDATION_FILE, VALIDATION_COLUMNS, row)
        self._to_sinks(validation_scalars(row), row["iteration"])

    def _to_sinks(self, scalars: dict[str, float], iteration: int) -> None:
        """A CSV row's scalars to TensorBoard and W&B, each at the row's iteration (and only where it is written)."""
        if self._tensorboard:
            writer = self._tensorboard_writer()
            for tag, value in scalars.items():
                writer.add_scalar(tag, value, iteration)
            writer.flush()  # on disk with the row (SummaryWriter keeps 2 minutes of events): a killed run's are there
        if self._wandb is not None:
            self._wandb.log({**scalars, WANDB_STEP: iteration})

    def _tensorboard_writer(self):
        """The run's TensorBoard writer, made at the first scalar so that a continued run's is made knowing where it
        continues from (`continue_after`): its events then replace those its killed predecessor logged past that
        point (SummaryWriter's purge_step), as the CSV files' rows do."""
        if self._tb is None:
            from torch.utils.tensorboard import SummaryWriter

            wait_past_event_files(self.folder / TENSORBOARD_FOLDER)

            self._tb = SummaryWriter(log_dir=str(self.folder / TENSORBOARD_FOLDER), purge_step=self._purge_step)
        return self._tb

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        sys.stdout.flush()


def wait_past_event_files(folder: Path) -> None:
    """TensorBoard reads a folder's event files in name order, and a name starts with its writer's start in whole
    seconds (then the pid): wait (at most a second) until this second is past every existing file's, so that a
    continued run's file is read after the killed run's, whose later steps it purges, even when both started
    within one second."""
    import time

    stamps = [int(part) for path in folder.glob("events.out.tfevents.*")
              if (part := path.name.split(".")[3]).isdigit()]
    while stamps and time.time() < max(stamps) + 1:
        time.sleep(0.02)


def training_scalars(row: Mapping[str, Any]) -> dict[str, float]:
    """What TensorBoard and W&B chart of a training.csv row, by tag."""
    return {f"train/{key}": row[key] for key in TRAINED_SCALARS}


def validation_scalars(row: Mapping[str, Any]) -> dict[str, float]:
    """What TensorBoard and W&B chart of a validation.csv row, by tag: a series per kind of row (the checkpoints'
    is ``validation/``; their moving averages', a weight average's, a random model's are named after the row), so
    that each series holds an iteration once, as its rows do."""
    series = validation_series(row["name"])
    scalars = {f"{series}/top1": row["val_acc"]}
    if row.get("val_top5") is not None:
        scalars[f"{series}/top5"] = row["val_top5"]
    return scalars


def validation_series(name: str) -> str:
    """"ckpt-20" -> "validation", "ckpt-20_ema" -> "validation_ema", "weight_avg_mean_last3" ->
    "validation_weight_avg_mean_last3": the row's name without its checkpoint's iteration."""
    kind = re.sub(r"^ckpt-\d+", "", name)
    return f"validation{'_' if kind and not kind.startswith('_') else ''}{kind}"


def write_arguments(folder: Path, options: Mapping[str, Any], filename: str = "arguments.json") -> None:
    """Every resolved option, as JSON: what restore.py and validation.py read back."""
    text = json.dumps(dict(options), sort_keys=True, indent=4, separators=(",", ": "), default=str)
    write_atomically(Path(folder) / filename, text + "\n")


def read_run_text(path: Path) -> str:
    """A text file of a run folder (a CSV, arguments.json), read as every command reads one back: bounded (a regular
    file, `cnns.bounded_reads`) and UTF-8, or one line (CheckpointError) naming the file and what is wrong with it."""
    try:
        data = read_bounded(path)
    except UnreadableFile as exc:
        raise CheckpointError(str(exc)) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start}): damaged, or not written "
                              "by cnns; move it aside to go on") from None


def check_logs_readable(folder: Path) -> None:
    """The run's CSV files, which a continued run reads back (to set apart rows past its checkpoint, to skip what is
    validated), read once before anything is written: a damaged one is one line with the folder as it was."""
    for name in (TRAINING_FILE, VALIDATION_FILE):
        if (folder / name).exists():
            read_run_text(folder / name)


def validated_names(folder: Path) -> set[str]:
    """Checkpoint names already in validation.csv (validation.py skips them)."""
    path = folder / VALIDATION_FILE
    if not path.exists():
        return set()
    return {row["name"] for row in csv.DictReader(io.StringIO(read_run_text(path), newline=""))
            if row.get("name")}


def abandoned_file(path: Path) -> Path:
    """Where the rows a continued run logs again are set apart: training.csv -> training.abandoned.csv."""
    return path.with_name(f"{path.stem}.abandoned{path.suffix}")


def set_apart_rows_after(path: Path, iteration: int) -> str | None:
    """Move the rows of a run's CSV file whose iteration lies past `iteration` (and a last row cut short by a
    crash while it was written) to `abandoned_file(path)`, appended after any set apart before. Returns a one-line
    notice, or None when there is nothing to move (the file is then left as it is).

    The set-apart rows are written first and the file is then replaced whole, so a crash in between can
    leave a row in both files, never in neither; a failed write leaves both files as they were."""
    if not path.is_file():
        return None
    lines = io.StringIO(read_run_text(path), newline="").readlines()  # with their own endings (rows end with \r\n)
    if not lines or "iteration" not in next(csv.reader([lines[0]])):
        return None
    column = next(csv.reader([lines[0]])).index("iteration")
    kept, moved = [lines[0]], []
    for line in lines[1:]:
        whole = line.endswith(("\n", "\r"))
        (kept if whole and not _past(line, column, iteration) else moved).append(line if whole else line + "\n")
    if not moved:
        return None
    aside = abandoned_file(path)
    aside_size = size_before(aside)
    header = [] if aside_size else [lines[0]]
    append(aside, "".join(header + moved))
    try:
        write_atomically(path, "".join(kept))
    except WriteError:
        restore_size(aside, aside_size)  # the rows stay where they were, not in both files
        raise
    rows = f"{len(moved)} row{'' if len(moved) == 1 else 's'}"
    return (f"{path.name} held {rows} past iteration {iteration}, the checkpoint this run continues from: "
            f"moved to {aside.name}, so that {path.name} logs each iteration once")


def _past(line: str, column: int, iteration: int) -> bool:
    """Whether a CSV row's iteration lies past `iteration` (a row without a readable one stays where it is)."""
    fields = next(csv.reader(io.StringIO(line)), [])
    try:
        return int(fields[column]) > iteration
    except (IndexError, ValueError):
        return False
