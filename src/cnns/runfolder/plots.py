"""Training curves as PNG: one run's `training.png`, and `cnns plot` overlaying several runs.

Reads a run folder's training.csv and validation.csv (the columns of `cnns.runfolder.log`) and draws four
panels against iteration: loss, top-1 accuracy (training average as a line, validated checkpoints as
markers), learning rate and throughput. Uses matplotlib's object API with the Agg canvas, so it needs
no display and never touches the global pyplot backend of the process.
"""

from __future__ import annotations

import csv
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from cnns.errors import CnnsError, WriteError, first_line
from cnns.safe_writes import utf8, write_atomically

if TYPE_CHECKING:
    from matplotlib.figure import Figure

TRAINING_FILE = "training.csv"
VALIDATION_FILE = "validation.csv"
PLOT_FILE = "training.png"

# Only the plain checkpoints are markers: not their moving averages (`ckpt-N_ema`), not weight_avg*.
_CHECKPOINT_NAME = re.compile(r"^ckpt-(\d+)$")
_TRAINING_FIELDS = ("iteration", "loss_avg", "train_acc_avg", "lr", "img_per_sec")

# (panel title, y-label, RunCurves attribute) in reading order, 2x2.
PANELS = (
    ("loss", "loss", "loss_avg"),
    ("top-1 accuracy (%)", "top-1 accuracy (%)", "train_acc_avg"),
    ("learning rate", "learning rate", "lr"),
    ("throughput (images/s)", "images/s", "img_per_sec"),
)


@dataclass
class RunCurves:
    """One run's curves: training rows per column, and the validated plain checkpoints."""

    name: str
    iteration: list[float] = field(default_factory=list)
    loss_avg: list[float] = field(default_factory=list)
    train_acc_avg: list[float] = field(default_factory=list)
    lr: list[float] = field(default_factory=list)
    img_per_sec: list[float] = field(default_factory=list)
    val_iteration: list[float] = field(default_factory=list)
    val_acc: list[float] = field(default_factory=list)
    val_name: list[str] = field(default_factory=list)


def _float(value: str | None) -> float:
    if value is None:
        raise ValueError("missing value")
    return float(value)


def _rows(path: Path) -> list[dict[str, str | None]]:
    """The rows of a CSV file, stopping quietly at a damaged tail (a crash mid-line, NUL bytes)."""
    rows: list[dict[str, str | None]] = []
    with open(path, newline="", encoding="utf-8", errors="replace") as f:
        reader = csv.DictReader(f)
        try:
            for row in reader:
                rows.append(row)
        except csv.Error:
            pass
    return rows


def read_run(folder: Path) -> RunCurves:
    """Read a run folder's training.csv (required, with at least one row) and validation.csv (optional).

    Unparsable rows are skipped. Raises CnnsError naming the file when training.csv is missing or holds no
    rows.
    """
    folder = Path(folder)
    path = folder / TRAINING_FILE
    if not folder.is_dir():
        raise CnnsError(f"{folder}: not a run folder (no such directory)")
    if not path.is_file():
        raise CnnsError(f"{folder}: not a run folder (no {TRAINING_FILE})")
    try:
        rows = _rows(path)
    except OSError as exc:
        raise CnnsError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    name = folder.resolve().name or str(folder)
    # A folder named in bytes that are not UTF-8 holds lone surrogates, which no font draws: shown as escapes.
    run = RunCurves(name=utf8(name).decode("utf-8"))
    for row in rows:
        try:
            values = [_float(row.get(key)) for key in _TRAINING_FIELDS]
        except (TypeError, ValueError):
            continue
        for key, value in zip(_TRAINING_FIELDS, values):
            getattr(run, key).append(value)
    if not run.iteration:
        raise CnnsError(f"{path}: no training rows yet (empty or unreadable)")

    val_path = folder / VALIDATION_FILE
    if val_path.is_file():
        try:
            val_rows = _rows(val_path)
        except OSError:
            val_rows = []
        for row in val_rows:
            name = (row.get("name") or "").strip()
            if not _CHECKPOINT_NAME.match(name):
                continue
            try:
                iteration = _float(row.get("iteration"))
                accuracy = _float(row.get("val_acc"))
            except (TypeError, ValueError):
                continue
            if iteration < 0 or not math.isfinite(iteration):
                continue
            run.val_iteration.append(iteration)
            run.val_acc.append(accuracy)
            run.val_name.append(name)
    return run


def build_figure(runs: list[RunCurves], title: str | None = None) -> Figure:
    """The 2x2 figure (not yet written): one colour per run, validation points as markers."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not runs:
        raise CnnsError("no runs to plot")
    fig = Figure(figsize=(10, 7), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 2).flatten()
    several = len(runs) > 1
    for ax, (panel_title, ylabel, key) in zip(axes, PANELS):
        ax.set_title(panel_title)
        ax.set_xlabel("iteration")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        for index, run in enumerate(runs):
            colour = f"C{index % 10}"
            if key == "train_acc_avg":
                label = run.name if several else "training"
            else:
                label = run.name
            # A run with a single step line still shows its point.
            ax.plot(run.iteration, getattr(run, key), color=colour, linewidth=1.2, label=label,
                    marker="." if len(run.iteration) == 1 else None)
            if key == "train_acc_avg" and run.val_iteration:
                ax.plot(run.val_iteration, run.val_acc, linestyle="none", marker="o", markersize=5,
                        markeredgecolor="black", markeredgewidth=0.6, color=colour,
                        label=f"{run.name} validation" if several else "validation")
        if key == "lr":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 4))
    accuracy_axes = axes[1]
    if several:
        axes[0].legend(loc="best", fontsize="small")
    if several or any(run.val_iteration for run in runs):
        accuracy_axes.legend(loc="best", fontsize="small")
    if title is None and not several:
        title = runs[0].name
    if title:
        fig.suptitle(title)
    # Fixed margins, wide enough for the panels' tick labels (up to six digits, or a power-of-ten offset):
    # tight_layout would draw every label once more to measure it, half of a plot's time.
    fig.subplots_adjust(left=0.08, right=0.98, bottom=0.08, top=0.91 if title else 0.95, wspace=0.25, hspace=0.38)
    return fig


def plot_runs(runs: list[RunCurves], out: Path, title: str | None = None) -> Path:
    """Draw `runs` into one PNG at `out` (written atomically: a reader never sees half a PNG) and return its
    path; a failed write is a WriteError naming `out`."""
    out = Path(out)
    fig = build_figure(runs, title)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise WriteError(out, exc) from None
    write_atomically(out, fig.canvas.print_png)
    return out


def plot_training(folder: Path) -> Path | None:
    """Write `folder/training.png` for one run; None when there is nothing to plot or plotting failed.

    Called at the end of a training run, which must not fail because of a plot: it never raises.
    """
    try:
        folder = Path(folder)
        path = folder / TRAINING_FILE
        if not path.is_file() or path.stat().st_size == 0:
            return None
        try:
            run = read_run(folder)
        except CnnsError:
            return None  # only a header so far: a run stopped before its first step line
        return plot_runs([run], folder / PLOT_FILE)
    except Exception as exc:  # noqa: BLE001 - a plot must never end a training run
        print(f"notice: {PLOT_FILE} not written: {first_line(exc)}", file=sys.stderr, flush=True)
        return None
