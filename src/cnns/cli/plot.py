"""`cnns plot RUN [RUN ...] [--out FILE] [--title TEXT]`: training curves of one run, or several overlaid."""

from __future__ import annotations

import argparse
from pathlib import Path

from cnns.config.strict_parser import StrictParser
from cnns.safe_writes import check_output, refreshes
from cnns.runfolder.plots import PLOT_FILE, TRAINING_FILE, VALIDATION_FILE, plot_runs, read_run

COMPARISON_FILE = "comparison.png"


def _parser() -> argparse.ArgumentParser:
    parser = StrictParser(
        prog="cnns plot",
        description="Plot loss, top-1 accuracy, learning rate and throughput against iteration from run folders' "
                    "training.csv and validation.csv; several runs are overlaid to compare them.")
    parser.add_argument("runs", nargs="+", type=Path, metavar="RUN", help="run folder(s) (logs/<name>_<xyz>)")
    parser.add_argument("--out", type=Path, default=None, metavar="FILE",
                        help=f"PNG to write (default: {PLOT_FILE} inside a single run, "
                             f"{COMPARISON_FILE} in the current folder for several runs, replaced if there); "
                             "an existing FILE is replaced only with --overwrite, never a run's CSV file")
    parser.add_argument("--overwrite", action="store_true", help="Replace an existing --out FILE.")
    parser.add_argument("--title", default=None, help="figure title (default: the run's name for a single run)")
    return parser


def plot_main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    runs = [read_run(folder) for folder in args.runs]  # CnnsError naming a folder that is not a run
    reads = [folder / name for folder in args.runs for name in (TRAINING_FILE, VALIDATION_FILE)]
    if args.out is None:  # the plot's own file, which each plot (and training) draws again: this command's to refresh
        out = args.runs[0] / PLOT_FILE if len(args.runs) == 1 else Path(COMPARISON_FILE)
        refreshes(out, reads)
    else:
        out = args.out
        check_output(out, reads, args.overwrite)
    written = plot_runs(runs, out, title=args.title)
    print(f"Wrote {written}")
    return 0
