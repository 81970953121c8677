"""The commands the seed did not have: `cnns predict`, `cnns export`, `cnns benchmark`, `cnns bench-data`.

Each declares its options, parses argv into plain values and calls its file of `cnns.commands`
(predict, export, benchmark).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from cnns.cli.parsing import device_defaults, parse_options
from cnns.config.table import SeedArgumentParser

RESTORE_PATH_HELP = "A run folder (its newest ckpt-N.pt) or one checkpoint file in it (ckpt-N.pt, weight_avg_*.pt)."
WEIGHTS_HELP = "raw: the checkpoint's weights; ema: its moving average (--ema-decay runs)."


# ----------------------------------------------------------------------------------------------
# cnns predict


def predict_parser() -> argparse.ArgumentParser:
    from cnns.engine.restored import WEIGHT_CHOICES

    parser = argparse.ArgumentParser(
        prog="cnns predict",
        description="Classify image files with a trained run's model: top-k labels and probabilities per image.")
    parser.add_argument("images", nargs="+", metavar="IMAGE_OR_FOLDER",
                        help="Image files (JPEG, PNG, ...) or folders of them (searched recursively).")
    parser.add_argument("--restore-path", required=True, help=RESTORE_PATH_HELP)
    parser.add_argument("--top-k", type=int, default=5, help="Classes printed per image (default 5).")
    parser.add_argument("--json", action="store_true", help="One JSON object per image and line.")
    parser.add_argument("--weights", choices=WEIGHT_CHOICES, default="raw", help=WEIGHTS_HELP)
    parser.add_argument("--batch-size", type=int, default=64, help="Images per forward pass (default 64).")
    parser.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when available).")
    return parser


def predict_main(argv: list[str]) -> int:
    from cnns.commands.predict import predict

    args = predict_parser().parse_args(argv)
    return predict(args.restore_path, args.images, top_k=args.top_k, as_json=args.json, weights=args.weights,
                   batch_size=args.batch_size, device=args.device)


# ----------------------------------------------------------------------------------------------
# cnns export


def export_parser() -> argparse.ArgumentParser:
    from cnns.commands.export import FORMATS
    from cnns.engine.restored import WEIGHT_CHOICES

    parser = argparse.ArgumentParser(
        prog="cnns export",
        description="Write a trained run's model as an ONNX graph or an AOTInductor .pt2 package (float32), or its "
                    "weights as safetensors with the config.json timm reads.")
    parser.add_argument("--restore-path", required=True, help=RESTORE_PATH_HELP)
    parser.add_argument("--format", required=True, choices=FORMATS,
                        help="onnx: torch's dynamo ONNX exporter (opset 18); pt2: torch.export + AOTInductor package; "
                             "safetensors: weights and config.json for timm.")
    parser.add_argument("--out", required=True,
                        help="The file to write (replaced if it exists); with safetensors, the folder.")
    parser.add_argument("--keep-dtype", action="store_true",
                        help="safetensors: the weights in the training half type (default: float32).")
    parser.add_argument("--batch-size", default="dynamic",
                        help="A fixed batch size N, or dynamic (the default): any batch size.")
    parser.add_argument("--eight-bit-io", action="store_true",
                        help="Take uint8 NHWC images 0..255 and normalise inside the graph (default: float32 NCHW, "
                             "already normalised).")
    parser.add_argument("--weights", choices=WEIGHT_CHOICES, default="raw", help=WEIGHTS_HELP)
    parser.add_argument("--device", default="cpu",
                        help="pt2 only: the device the package is compiled for (cpu, cuda, cuda:N; default cpu). "
                             "An ONNX graph is device-independent and is exported on the CPU.")
    return parser


def export_main(argv: list[str]) -> int:
    from cnns.commands.export import export

    args = export_parser().parse_args(argv)
    return export(args.restore_path, args.format, args.out, batch_size=args.batch_size,
                  eight_bit_io=args.eight_bit_io, weights=args.weights, device=args.device, keep_dtype=args.keep_dtype)


# ----------------------------------------------------------------------------------------------
# cnns benchmark


def benchmark_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cnns benchmark",
        description="Run each benchmarks.yml entry as the seed's command line, beside the plain PyTorch loop.")
    parser.add_argument("--spec", default="benchmarks.yml", help="The benchmark list (YAML).")
    parser.add_argument("--benchmark", nargs="+", action="extend", metavar="NAME",
                        help="Run only these entries (default: all).")
    parser.add_argument("--repeats", type=int, default=None,
                        help="Runs of each side, alternated: the best of each, and the median ratio of "
                             "adjacent pairs (spec default, else 1).")
    parser.add_argument("--no-baseline", action="store_true", help="Skip the plain PyTorch loop.")
    parser.add_argument("--output-dir", default="benchmark-results", help="Where the CSV/JSON results go.")
    parser.add_argument("--data-dir", default=None,
                        help="Where the generated CIFAR-10 folder is kept (default: <output-dir>/data/cifar10).")
    parser.add_argument("--keep-runs", action="store_true",
                        help="Keep the training runs' folders (checkpoints included); by default only logs stay.")
    parser.add_argument("--list", action="store_true", help="List the benchmarks and exit.")
    return parser


def seed_script_options(script: str, args: list[str]) -> dict[str, Any]:
    """The options a seed command line (train.py or validation.py and its arguments) resolves to."""
    from cnns.bench.runner import SCRIPTS
    from cnns.config import resolve

    values, _ = parse_options(SCRIPTS[script], args)
    device_defaults(values)
    return resolve(values)


def benchmark_main(argv: list[str]) -> int:
    from cnns.commands.benchmark import benchmark

    args = benchmark_parser().parse_args(argv)
    return benchmark(args.spec, args.benchmark, args.output_dir, args.data_dir, args.list, args.repeats,
                     baseline=not args.no_baseline, keep_runs=args.keep_runs, seed_options=seed_script_options)


# ----------------------------------------------------------------------------------------------
# cnns profile


def profile_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cnns profile",
        description="Where a training update's time goes (convolutions, normalisation, activations, additions, "
                    "optimiser, data), for cnns and the plain PyTorch loop side by side.")
    parser.add_argument("--spec", default="benchmarks.yml", help="The benchmark list (YAML).")
    parser.add_argument("--benchmark", nargs="+", action="extend", metavar="NAME", required=True,
                        help="Training entries to profile.")
    parser.add_argument("--updates", type=int, default=3, help="Updates profiled after one warm-up update.")
    parser.add_argument("--eager-too", action="store_true",
                        help="On a CUDA entry that compiles, profile cnns once more without compilation (--no-compile).")
    parser.add_argument("--output-dir", default="benchmark-results", help="Where the traces and logs go.")
    parser.add_argument("--data-dir", default=None,
                        help="Where the generated CIFAR-10 folder is kept (default: <output-dir>/data/cifar10).")
    return parser


def profile_main(argv: list[str]) -> int:
    from cnns.commands.benchmark import profile

    args = profile_parser().parse_args(argv)
    return profile(args.spec, args.benchmark, args.updates, args.output_dir, args.data_dir,
                   seed_options=seed_script_options, eager_too=args.eager_too)


# ----------------------------------------------------------------------------------------------
# cnns bench-data


def bench_data_parser() -> argparse.ArgumentParser:
    parser = SeedArgumentParser(prog="cnns bench-data", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                description="Run the input pipeline alone and report images/s.")
    parser.add_argument("--data-dir", default=os.environ.get("DATA_DIR"),
                        help="CIFAR binaries, ImageNet TFRecords or a JPEG tree; $DATA_DIR when omitted.")
    parser.add_argument("--dataset", choices=("imagenet", "cifar-10", "cifar-100", "builtin"),
                        help="Inferred from the folder when omitted.")
    parser.add_argument("--make-jpeg-tree", metavar="DIR",
                        help="First write synthetic ImageNet-like JPEGs to DIR (a folder tree, or TFRecords with "
                             "--layout tfrecord; files already there are kept): the data measured.")
    parser.add_argument("--images", type=int, default=2000, help="Training images of --make-jpeg-tree.")
    parser.add_argument("--classes", type=int, default=10, help="Classes of --make-jpeg-tree.")
    parser.add_argument("--layout", choices=("folder", "tfrecord"), default="folder",
                        help="--make-jpeg-tree writes a folder tree or TFRecord shards.")
    parser.add_argument("--workers", "--pipeline-num-parallel", dest="workers", type=int, nargs="+", default=[2],
                        help="Data-loading worker processes; several values are measured one after the other.")
    parser.add_argument("--image-size", type=int, default=224, help="Output image size (ImageNet).")
    parser.add_argument("--batch-size", "--micro-batch-size", dest="batch_size", type=int, default=32,
                        help="Images per batch.")
    parser.add_argument("--batches", type=int, default=60, help="Timed batches per measurement.")
    parser.add_argument("--warmup-batches", type=int, default=8, help="Batches drawn before timing starts.")
    parser.add_argument("--transforms", choices=("train", "eval"), default="train",
                        help="Training (random resized crop, flip) or evaluation (resize, centre crop) transforms.")
    parser.add_argument("--eval", dest="transforms", action="store_const", const="eval",
                        help="Same as --transforms eval.")
    parser.add_argument("--compare-baseline", action="store_true",
                        help="Also time torchvision ImageFolder + PIL transforms at the same worker counts.")
    parser.add_argument("--rounds", type=int, default=1,
                        help="Measure each pipeline this many times; report the medians, and the median of the "
                             "ratios taken within each round.")
    parser.add_argument("--dataset-cache", dest="cache", action=argparse.BooleanOptionalAction, default=False,
                        help="Keep evaluation batches in memory after the first pass, as training runs do; off "
                             "here so that every pass measures decoding, not the cache.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="FILE", help="Also write the measurements to FILE as JSON.")
    return parser


def bench_data_main(argv: list[str]) -> int:
    from cnns.bench.data import BenchDataRequest
    from cnns.commands.benchmark import bench_data

    return bench_data(BenchDataRequest(**vars(bench_data_parser().parse_args(argv))))
