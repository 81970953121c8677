"""inference_embedded.py: inference from an ahead-of-time compiled model.

The seed's embedded application runtime saved a precompiled Poplar graph and reloaded it to skip
compilation. Here the first run exports the model with torch.export, compiles it with AOTInductor
and saves the package (`.pt2`); later runs load the package and start at once (`--force-recompile`
rebuilds it). The exported graph takes uint8 NHWC images and normalises them itself, so the
compiled artefact is the whole device side of 8-bit I/O.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cnns.config import RunConfig, resolve
from cnns.data.augment import IMAGENET_MEAN, normalise
from cnns.engine.build import resolve_device, unwrap
from cnns.engine.validation import latency_line
from cnns.errors import CnnsError
from cnns.precision import PrecisionPolicy


class NormalisedClassifier(nn.Module):
    """uint8 NHWC images -> logits: the device-side normalisation folded into the exported graph."""

    def __init__(self, model: nn.Module, std: tuple[float, ...], dtype: torch.dtype):
        super().__init__()
        self.model = model
        self.std = std
        self.dtype = dtype

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(normalise(images, IMAGENET_MEAN, self.std, self.dtype)).float()


def artefact_name(cfg: RunConfig, checkpoint: Path | None) -> str:
    """The seed's naming: one artefact per model, batch size, iterations per call and weights."""
    weights = checkpoint.stem if checkpoint else "random"
    return (f"model_{cfg.model.arch}{cfg.model.size}_bs_{cfg.train.micro_batch_size}_"
            f"{cfg.precision.precision}_{weights}.pt2")


def build_inference_model(cfg: RunConfig, checkpoint: Path | None, device: torch.device) -> nn.Module:
    from cnns.checkpoint import load_checkpoint
    from cnns.models import build_model

    model = build_model(cfg.model)
    if checkpoint is not None:
        unwrap(model).load_state_dict(load_checkpoint(checkpoint)["model"])
    dtype, std = input_dtype_and_std(cfg, device)
    model = model.to(device=device, dtype=dtype, memory_format=torch.channels_last).eval()
    return NormalisedClassifier(model, std, dtype).eval()


def input_dtype_and_std(cfg: RunConfig, device: torch.device) -> tuple[torch.dtype, tuple[float, ...]]:
    """The compiled model's dtype and the standard deviations its normalisation divides by."""
    # Inference has no master weights to keep: half precision means half weights (float32 where the
    # CPU would only emulate the half type and none was asked for explicitly).
    policy = PrecisionPolicy.resolve(cfg.precision.precision, cfg.precision.half_dtype, device,
                                     avoid_emulated_half=not cfg.precision.half_dtype_given)
    std = (0.229, 0.224, 0.225) if cfg.data.normalise_imagenet else (1.0, 1.0, 1.0)
    return policy.compute_dtype, std


def compile_artefact(model: nn.Module, example: torch.Tensor, path: Path) -> None:
    with torch.no_grad():
        exported = torch.export.export(model, (example,))
        torch._inductor.aoti_compile_and_package(exported, package_path=str(path))


def artefact_description(cfg: RunConfig, checkpoint: Path | None, device: torch.device) -> dict[str, Any]:
    """Everything the compiled graph depends on. The file name holds only the seed's part of it, so a run
    whose options differ in the rest (another device, class count, input size or normalisation, a retrained
    checkpoint) must not load the package another run compiled: it is described beside the package."""
    weights = None
    if checkpoint is not None:
        try:
            stat = checkpoint.stat()
            weights = [str(checkpoint.resolve()), stat.st_size, stat.st_mtime_ns]
        except OSError:  # loading it says what is wrong with it
            weights = [str(checkpoint)]
    gpu = list(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None
    dtype, std = input_dtype_and_std(cfg, device)
    return {"model": dataclasses.asdict(cfg.model), "batch": cfg.train.micro_batch_size,
            "image_size": cfg.data.image_size, "dtype": str(dtype), "std": list(std), "weights": weights,
            "device": device.type, "gpu_capability": gpu}


# The description's fields as the notice names them.
_DESCRIBED = {"model": "model", "batch": "batch size", "image_size": "image size", "dtype": "precision",
              "std": "normalisation", "weights": "checkpoint", "device": "device", "gpu_capability": "GPU"}


def _description_path(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def compiled_for_other_options(path: Path, description: dict[str, Any]) -> list[str]:
    """The described fields in which the package at `path` differs from `description` (none when the package
    has no description: one copied here by hand is trusted as before)."""
    try:
        saved = json.loads(_description_path(path).read_text())
    except (OSError, ValueError):
        return []
    return [_DESCRIBED[key] for key in description if saved.get(key) != description[key]]


def inference_options(values: dict[str, Any]) -> dict[str, Any]:
    """inference_embedded.py's options from its command line's values: one process, no pipeline, no
    validation, and generated data unless synthetic data was asked for."""
    values = dict(values, replicas=1, shards=1, pipeline=False, pipeline_splits=None, validation=False)
    values["generated_data"] = values.get("generated_data") or not values.get("synthetic_data")
    return resolve(values)


def infer(options: dict[str, Any], notices: list[str]) -> int:
    """inference_embedded.py: compile the model once (or load the compiled artefact) and time it."""
    cfg = RunConfig.from_options(options)
    for notice in notices:
        print(f"notice: {notice}")
    device = resolve_device(cfg.device, options.get("select_ipus"))
    checkpoint = Path(options["restore_path"]) if options.get("restore_path") else None
    path = Path(options.get("artefact_path") or artefact_name(cfg, checkpoint))
    batch, size = cfg.train.micro_batch_size, cfg.data.image_size or 224
    images = torch.randint(0, 256, (batch, size, size, 3), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(options["seed"] or 0))
    description = artefact_description(cfg, checkpoint, device)
    stale = compiled_for_other_options(path, description) if path.exists() else []
    if stale:
        print(f"The compiled model at {path} was built for another {', '.join(stale)}: compiling it again")
    if path.exists() and not stale and not options.get("force_recompile"):
        print(f"Loading the compiled model from {path}")
    else:
        model = build_inference_model(cfg, checkpoint, device)
        print(f"Total Parameters:{sum(p.numel() for p in model.parameters())}")
        start = time.perf_counter()
        _description_path(path).unlink(missing_ok=True)  # never beside a package it does not describe
        compile_artefact(model, images.to(device), path)
        _description_path(path).write_text(json.dumps(description, indent=1) + "\n")
        print(f"Compilation time: {time.perf_counter() - start:.3f}s. Saved the compiled model to {path}")
    try:
        runner = torch._inductor.aoti_load_package(str(path))
    except Exception as exc:  # a foreign or truncated file: one clear line
        raise CnnsError(f"cannot load the compiled model {path}: {str(exc).splitlines()[0][:200]}"
                        " (use --force-recompile)") from None
    return _measure(runner, images.to(device), iterations=cfg.train.iterations or 100, device=device)


def _measure(runner, images: torch.Tensor, iterations: int, device: torch.device) -> int:
    runner(images)  # warm-up: the first call allocates
    latencies = []
    start = time.perf_counter()
    for _ in range(iterations):
        t0 = time.perf_counter()
        runner(images)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        latencies.append(1000.0 * (time.perf_counter() - t0))
    seconds = time.perf_counter() - start
    print(f"Inference: {iterations} batches of {images.shape[0]}, "
          f"throughput: {iterations * images.shape[0] / seconds:.2f} samples/sec, time: {seconds:.6f}")
    print(latency_line(latencies))
    return 0
