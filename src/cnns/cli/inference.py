"""Commands that put a trained model to use: `cnns infer` (inference_embedded.py), `cnns predict`, `cnns export`.

Each parses its command line into plain values and calls its file of `cnns.commands` (infer, predict, export).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from cnns.config.strict_parser import StrictParser
from cnns.cli.parsing import print_config, resolve_command_line
from cnns.config import RunConfig
from cnns.config.config_files import check_parsed

RESTORE_PATH_HELP = "A run folder (its newest ckpt-N.pt) or one checkpoint file in it (ckpt-N.pt, weight_avg_*.pt)."
WEIGHTS_HELP = "raw: the checkpoint's weights; ema: its moving average (--ema-decay runs)."


# ----------------------------------------------------------------------------------------------
# cnns infer


def infer_main(argv: list[str]) -> int:
    from cnns.commands.infer import infer

    resolved = resolve_command_line("infer", argv)
    values = resolved.values
    if values.get("print_config"):
        return print_config(resolved.options)
    checkpoint = _checkpoint_named(values.get("restore_path"))
    return infer(resolved.config, resolved.notices, checkpoint=checkpoint, artefact_path=values.get("artefact_path"),
                 force_recompile=bool(values.get("force_recompile")))


def _checkpoint_named(restore_path: str | None) -> Path | None:
    """The checkpoint --restore-path names (a run folder's newest), as every command reads it; None without."""
    from cnns.runfolder.run_folder import open_restore_path

    return open_restore_path(restore_path).checkpoint() if restore_path else None


def restored_run(restore_path: str) -> tuple[Path, RunConfig]:
    """predict / export: (the checkpoint --restore-path names, its run's configuration resolved as validation.py
    resolves it for that checkpoint)."""
    checkpoint = _checkpoint_named(restore_path)
    return checkpoint, resolve_command_line("validate", ["--restore-path", str(checkpoint)]).config


# ----------------------------------------------------------------------------------------------
# cnns predict


def predict_parser() -> argparse.ArgumentParser:
    from cnns.config.table import COUNT, byte_size
    from cnns.deploy.restored_model import WEIGHT_CHOICES

    parser = StrictParser(
        prog="cnns predict",
        description="Classify image files with a trained run's model: top-k labels and probabilities per image.")
    parser.add_argument("images", nargs="+", metavar="IMAGE_OR_FOLDER",
                        help="Image files (JPEG, PNG, ...) or folders of them (searched recursively).")
    parser.add_argument("--restore-path", required=True, help=RESTORE_PATH_HELP)
    parser.add_argument("--top-k", type=COUNT, default=5, help="Classes printed per image; at least 1 (default 5).")
    parser.add_argument("--json", action="store_true", help="One JSON object per image and line.")
    parser.add_argument("--weights", choices=WEIGHT_CHOICES, default="raw", help=WEIGHTS_HELP)
    parser.add_argument("--batch-size", type=COUNT, default=64,
                        help="Images per forward pass; at least 1 (default 64).")
    parser.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when available).")
    parser.add_argument("--max-file-size", type=byte_size, metavar="SIZE",
                        help="The largest image file read, e.g. 512M or 2G (default 1G); a larger one, or anything "
                             "but a regular file (a FIFO, a device), is named in one line and not read.")
    return parser


def predict_main(argv: list[str]) -> int:
    from cnns.commands.predict import predict

    parser = predict_parser()
    args = parser.parse_args(argv)
    check_parsed(parser, args)  # before the run is read
    return predict(*restored_run(args.restore_path), args.images, top_k=args.top_k, as_json=args.json,
                   weights=args.weights, batch_size=args.batch_size, device=args.device,
                   max_file_size=args.max_file_size)


# ----------------------------------------------------------------------------------------------
# cnns export


def export_parser() -> argparse.ArgumentParser:
    from cnns.commands.export import FORMATS
    from cnns.deploy.restored_model import WEIGHT_CHOICES

    parser = StrictParser(
        prog="cnns export",
        description="Write a trained run's model as an ONNX graph or an AOTInductor .pt2 package (float32), or its "
                    "weights as safetensors with the config.json timm reads.")
    parser.add_argument("--restore-path", required=True, help=RESTORE_PATH_HELP)
    parser.add_argument("--format", required=True, choices=FORMATS,
                        help="onnx: torch's dynamo ONNX exporter (opset 18); pt2: torch.export + AOTInductor package; "
                             "safetensors: weights and config.json for timm.")
    parser.add_argument("--out", required=True,
                        help="The file to write; with safetensors, the folder (its model.safetensors and config.json). "
                             "An existing file is replaced only with --overwrite, and never the checkpoint read.")
    parser.add_argument("--overwrite", action="store_true",
                        help="Replace an existing --out file (never the checkpoint or arguments.json exported).")
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
    return export(*restored_run(args.restore_path), args.format, args.out, batch_size=args.batch_size,
                  eight_bit_io=args.eight_bit_io, weights=args.weights, device=args.device, keep_dtype=args.keep_dtype,
                  overwrite=args.overwrite)
