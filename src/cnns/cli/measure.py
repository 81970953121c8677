"""Commands that measure: `cnns benchmark` (benchmarks.yml against the plain PyTorch loop), `cnns profile`
(an update's time by operator family), `cnns bench-data` (the input pipeline alone) and `cnns splits` (what
each pipeline cut costs, and the cuts that balance the stages).

Each declares or resolves its options and calls its file of `cnns.commands` (benchmark, splits).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from cnns.cli.parsing import device_defaults, inference_options, parse_options, resolve_command_line
from cnns.config.config_files import check_parsed
from cnns.config.strict_parser import StrictParser
from cnns.config.table import COUNT, SEED_MAX, Domain
from cnns.data.formats import DATASETS, IMAGENET
from cnns.data.jpegtree import LAYOUTS


# ----------------------------------------------------------------------------------------------
# cnns benchmark


def benchmark_parser() -> argparse.ArgumentParser:
    parser = StrictParser(
        prog="cnns benchmark",
        description="Run each benchmarks.yml entry as Graphcore's command line, beside the plain PyTorch loop.")
    parser.add_argument("--spec", default="benchmarks.yml", help="The benchmark list (YAML).")
    parser.add_argument("--benchmark", nargs="+", action="extend", metavar="NAME",
                        help="Run only these entries (default: all).")
    parser.add_argument("--repeats", type=COUNT, default=None,
                        help="Runs of each side, alternated: the best of each, and the median ratio of "
                             "adjacent pairs (spec default, else 1).")
    parser.add_argument("--no-baseline", action="store_true", help="Skip the plain PyTorch loop.")
    parser.add_argument("--output-dir", default="benchmark-results", help="Where the CSV/JSON results go.")
    parser.add_argument("--data-dir", default=None,
                        help="Where the generated CIFAR-10 folder is kept (default: <output-dir>/data/cifar10).")
    parser.add_argument("--keep-runs", action="store_true",
                        help="Keep the runs' checkpoints; by default each run's folder keeps only its CSV files and logs.")
    parser.add_argument("--list", action="store_true", help="List the benchmarks and exit.")
    return parser


def script_options(script: str, args: list[str]) -> dict[str, Any]:
    """The options one of Graphcore's command lines (train.py, validation.py or inference_embedded.py and its
    arguments) resolves to."""
    from cnns.bench.runner import SCRIPTS
    from cnns.config import resolve

    values, _ = parse_options(SCRIPTS[script], args)
    if SCRIPTS[script] == "infer":
        return inference_options(values)
    device_defaults(values)
    return resolve(values)


def benchmark_main(argv: list[str]) -> int:
    from cnns.commands.benchmark import benchmark

    parser = benchmark_parser()
    args = parser.parse_args(argv)
    check_parsed(parser, args)
    return benchmark(args.spec, args.benchmark, args.output_dir, args.data_dir, args.list, args.repeats,
                     baseline=not args.no_baseline, keep_runs=args.keep_runs, script_options=script_options)


# ----------------------------------------------------------------------------------------------
# cnns profile


def profile_parser() -> argparse.ArgumentParser:
    parser = StrictParser(
        prog="cnns profile",
        description="Where a training update's time goes (convolutions, normalisation, activations, additions, "
                    "optimiser, data), for cnns and the plain PyTorch loop side by side.")
    parser.add_argument("--spec", default="benchmarks.yml", help="The benchmark list (YAML).")
    parser.add_argument("--benchmark", nargs="+", action="extend", metavar="NAME", required=True,
                        help="Training entries to profile.")
    parser.add_argument("--updates", type=COUNT, default=3, help="Updates profiled after one warm-up update.")
    parser.add_argument("--eager-too", action="store_true",
                        help="On a CUDA entry that compiles, profile cnns once more without compilation (--no-compile).")
    parser.add_argument("--output-dir", default="benchmark-results", help="Where the traces and logs go.")
    parser.add_argument("--data-dir", default=None,
                        help="Where the generated CIFAR-10 folder is kept (default: <output-dir>/data/cifar10).")
    return parser


def profile_main(argv: list[str]) -> int:
    from cnns.commands.benchmark import profile

    parser = profile_parser()
    args = parser.parse_args(argv)
    check_parsed(parser, args)
    return profile(args.spec, args.benchmark, args.updates, args.output_dir, args.data_dir,
                   script_options=script_options, eager_too=args.eager_too)


# ----------------------------------------------------------------------------------------------
# cnns bench-data


class StatedDefaults(argparse.HelpFormatter):
    """argparse's defaults in --help where there is one to state: not argparse's "(default: None)" for an option
    that has none, nor "(default: False)" for a flag."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "%(default)" in text or not action.option_strings or action.default in (None, False, argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)"


def bench_data_parser() -> argparse.ArgumentParser:
    parser = StrictParser(prog="cnns bench-data", formatter_class=StatedDefaults,
                                description="Run the input pipeline alone and report images/s (per worker core), "
                                            "and on ImageNet files the account of one image's time.")
    parser.add_argument("--data-dir", default=os.environ.get("DATA_DIR"),
                        help="CIFAR binaries, ImageNet TFRecords or a JPEG tree; $DATA_DIR when omitted.")
    parser.add_argument("--dataset", choices=tuple(DATASETS),
                        help="Inferred from the folder when omitted.")
    parser.add_argument("--make-jpeg-tree", metavar="DIR",
                        help="First write synthetic ImageNet-like JPEGs to DIR (a folder tree, or shards with "
                             "--layout; files already there are kept): the data measured.")
    parser.add_argument("--images", type=COUNT, default=2000, help="Training images of --make-jpeg-tree.")
    parser.add_argument("--classes", type=COUNT, default=10, help="Classes of --make-jpeg-tree.")
    parser.add_argument("--layout", choices=tuple(LAYOUTS), default="folder",
                        help="--make-jpeg-tree writes a folder tree, TFRecord shards, WebDataset tar shards, the "
                             "Hub's Parquet shards or a save_to_disk folder.")
    parser.add_argument("--workers", "--pipeline-num-parallel", dest="workers", nargs="+", default=[1],
                        type=Domain(int, "[0, 1024]", zero="load in the main process"),
                        help="Data-loading worker processes; several values are measured one after the other.")
    parser.add_argument("--image-size", type=COUNT, default=224, help="Output image size (ImageNet).")
    parser.add_argument("--batch-size", "--micro-batch-size", dest="batch_size", type=COUNT, default=32,
                        help="Images per batch.")
    parser.add_argument("--batches", type=COUNT, default=60, help="Timed batches per measurement.")
    parser.add_argument("--warmup-batches", type=Domain(int, "[0, inf)"), default=8, help="Batches drawn before timing starts.")
    parser.add_argument("--transforms", choices=("train", "eval"), default="train",
                        help="Training (random resized crop, flip) or evaluation (resize, centre crop) transforms.")
    parser.add_argument("--eval", dest="transforms", action="store_const", const="eval",
                        help="Same as --transforms eval.")
    parser.add_argument("--compare-baseline", action="store_true",
                        help="Also time torchvision ImageFolder + PIL transforms (uint8 out) at the same worker "
                             "counts, alternating with cnns round by round.")
    parser.add_argument("--rounds", type=COUNT, default=1,
                        help="Measure each pipeline this many times; report the medians, and the median of the "
                             "ratios taken within each round.")
    parser.add_argument("--dataset-cache", dest="cache", action=argparse.BooleanOptionalAction, default=False,
                        help="Keep evaluation batches in memory after the first pass, as training runs do; off "
                             "here so that every pass measures decoding, not the cache.")
    parser.add_argument("--seed", type=Domain(int, f"[0, {SEED_MAX}]"), default=0)
    parser.add_argument("--json", metavar="FILE", help="Also write the measurements to FILE as JSON (an existing FILE "
                                                         "only with --overwrite).")
    parser.add_argument("--overwrite", action="store_true", help="Replace an existing --json FILE.")
    parser.add_argument("--device", default="cpu",
                        help="The device the batches are made for: cpu, cuda or cuda:N (on a GPU they are pinned, "
                             "or decoded there as --decode-device chooses).")
    parser.add_argument("--decode-device", choices=("auto", "cpu", "cuda", "dali"), default="auto",
                        help="Where the images are decoded, as for train.py (auto: DALI on a GPU with a hardware "
                             "JPEG decoder where DALI is installed, else the CPU decoder: no step runs here to "
                             "weigh its rate against).")
    parser.add_argument("--account", action=argparse.BooleanOptionalAction, default=True,
                        help="On ImageNet files, also split one image's time by stage (read, header + crop draw, "
                             "decode, crop + resize, flip, into the batch, across to the main process) beside the "
                             "decode-only cap; run under taskset -c N for one core's account.")
    parser.add_argument("--account-images", type=COUNT, default=400,
                        help="Images timed stage by stage in this process for the account.")
    return parser


def bench_data_main(argv: list[str]) -> int:
    parser = bench_data_parser()
    args = parser.parse_args(argv)
    check_parsed(parser, args)
    options = vars(args)
    overwrite = options.pop("overwrite")
    if options["json"]:  # checked before anything is measured or written (the tree --make-jpeg-tree writes too)
        from cnns.safe_writes import check_output

        check_output(options["json"], [options["data_dir"] or options["make_jpeg_tree"] or ""], overwrite, "--json")
    from cnns.bench.data import BenchDataRequest
    from cnns.commands.benchmark import bench_data

    return bench_data(BenchDataRequest(**options))


# ----------------------------------------------------------------------------------------------
# cnns splits


def splits_main(argv: list[str]) -> int:
    """`cnns splits`: every cut of the model with what lies before it (parameters, activations, time
    of one micro-batch forward and backward) and the cuts that balance --shards stages (default 2)."""
    from cnns.commands.splits import propose_splits

    # The model's shape is all it needs: no data folder (ImageNet-sized unless --dataset says otherwise).
    if not any(_names(a, ("--data-dir", "--synthetic-data", "--generated-data")) for a in argv):
        argv = [*argv, "--synthetic-data"] + ([] if any(_names(a, ("--dataset",)) for a in argv) else
                                              ["--dataset", IMAGENET.name])
    argv = argv if "--pipeline" in argv else [*argv, "--pipeline"]
    return propose_splits(resolve_command_line("train", argv).config)


def _names(token: str, options: tuple[str, ...]) -> bool:
    """Whether a command-line token is one of `options`, as `--x` or `--x=value`: exactly, as the parser reads
    it (`--dataset-percentage-to-use` is not `--dataset`)."""
    return token.split("=", 1)[0] in options
