"""inference_embedded.py: inference from an ahead-of-time compiled model.

The embedded runtime of Graphcore's application saved a precompiled Poplar graph and reloaded it to skip
compilation. Here the first run exports the model with torch.export, compiles it with AOTInductor
and saves the package (`.pt2`); later runs load the package and start at once (`--force-recompile`
rebuilds it). The exported graph takes uint8 NHWC images and normalises them itself, so the
compiled artefact is the whole device side of 8-bit I/O.

On CUDA the package is first loaded and run on one batch in a short-lived child process
(`probe_package`): a torch whose AOTInductor crashes loading CUDA packages then stops the command with
one line instead of killing it with a segmentation fault. The probe is not timed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from cnns.config import RunConfig
from cnns.deploy.graphs import export_pt2, load_compiled
from cnns.deploy.restored_model import build_inference_model, inference_batch, inference_dtype_and_std
from cnns.devices import resolve_device
from cnns.engine.checkpoint_validation import latency_line
from cnns.errors import CnnsError, ConfigError
from cnns.safe_writes import check_output, write_atomically


def artefact_name(cfg: RunConfig, checkpoint: Path | None) -> str:
    """The naming of Graphcore's application: one artefact per model, batch size, iterations per call and weights."""
    weights = checkpoint.stem if checkpoint else "random"
    return (f"model_{cfg.model.arch}{cfg.model.size}_bs_{cfg.train.micro_batch_size}_"
            f"{cfg.precision.precision}_{weights}.pt2")


def artefact_description(cfg: RunConfig, checkpoint: Path | None, device: torch.device) -> dict[str, Any]:
    """Everything the compiled graph depends on. The file name holds only the part Graphcore's naming has, so a run
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
    dtype, std = inference_dtype_and_std(cfg, device)
    return {"model": dataclasses.asdict(cfg.model), "batch": cfg.train.micro_batch_size,
            "image_size": cfg.data.image_size, "dtype": str(dtype), "std": list(std), "weights": weights,
            "device": device.type, "gpu_capability": gpu}


# The description's fields as the notice names them.
_DESCRIBED = {"model": "model", "batch": "batch size", "image_size": "image size", "dtype": "precision",
              "std": "normalisation", "weights": "checkpoint", "device": "device", "gpu_capability": "GPU"}


def _description_path(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def compiled_here(path: Path) -> bool:
    """Whether cnns compiled the package at `path`: it writes the package's description beside every one."""
    return _description_path(path).is_file() and not _description_path(path).is_symlink()


def claim_artefact(path: Path, checkpoint: Path | None) -> None:
    """--artefact-path is a cache this command may replace only where it compiled what is there: any other file
    (a run's checkpoint, say) is refused in one line before anything is compiled or written, as is the checkpoint
    the weights come from."""
    if (path.exists() or path.is_symlink()) and not compiled_here(path):
        raise ConfigError(f"--artefact-path {path} exists and is not a package cnns compiled (no "
                          f"{_description_path(path).name} beside it): it is left as it is; give another path")
    reads = [checkpoint] if checkpoint is not None else []
    check_output(path, reads, overwrite=True, option="--artefact-path")
    check_output(_description_path(path), reads, overwrite=True, option="--artefact-path")


def compiled_for_other_options(path: Path, description: dict[str, Any]) -> list[str]:
    """The described fields in which the package at `path` differs from `description` (none when the package
    has no description: one copied here by hand is trusted as before)."""
    try:
        saved = json.loads(_description_path(path).read_text())
    except (OSError, ValueError):
        return []
    return [_DESCRIBED[key] for key in description if saved.get(key) != description[key]]


# Loading a CUDA AOTInductor package can kill the process: with torch 2.11.0+cu130 on an H100,
# aoti_load_package dies with SIGSEGV in torch.export.pt2_archive._package._load_aoti, for cnns' packages and a
# tiny plain-torch one alike (this project's GPU run). No public report of that crash was found, and no torch
# release is documented to load CUDA packages where 2.11.0+cu130 crashes; the nearest records (GitHub,
# pytorch/pytorch) are fixes to AOTInductor's CUDA packages made after 2.11: #173800 (a CUDA package test
# failing on the 2.11 release branch; fixed on main by #183981/#184456, May 2026), #185931/#186943 (June 2026:
# a CUDA package loaded without usable CUDA fell back to the legacy loader and failed obscurely), and crashes
# in older or other paths: #172739 (open: torch._export.aot_load segfaults), #145441 (2.6.0 RC segfault).
# So no version list here: on CUDA each package is first loaded in a child process. On the CPU, packages load
# in-process as before: no CPU load has crashed in this project (the CPU suite loads packages with torch
# 2.14.1, and the GPU run's crash was CUDA's), so the probe's cost (a second torch import) buys nothing there.
PROBED_DEVICE_TYPES = ("cuda",)
# The probe child's time limit: importing torch, loading the package (unzip, dlopen, CUDA context, kernel
# modules) and one batch take seconds to tens of seconds; a child past this is taken as hung.
PROBE_TIMEOUT_S = 300
# The probe child: torch only (no cnns, so no import path to pass on), loading the package exactly as
# `infer` does and running one batch of zeros of the given shape. Arguments: package, shape, device.
PROBE_CODE = """\
import sys
import torch
path, shape, device = sys.argv[1], tuple(int(n) for n in sys.argv[2].split(",")), torch.device(sys.argv[3])
runner = torch._inductor.aoti_load_package(path, device_index=-1 if device.index is None else device.index)
logits = runner(torch.zeros(shape, dtype=torch.uint8, device=device))
if device.type == "cuda":
    torch.cuda.synchronize(device)
print("probe: logits", tuple(logits.shape))
"""


def _instead() -> str:
    return ("validation.py --generated-data measures throughput without AOTInductor on this torch; or use a torch "
            "whose AOTInductor loads CUDA packages")


def probe_package(path: Path, shape: tuple[int, ...], device: torch.device) -> float:
    """Load the package at `path` and run one batch of `shape` on `device` in a child process; returns the
    seconds it took. A child that dies by a signal, fails or hangs is a CnnsError of one line."""
    command = [sys.executable, "-c", PROBE_CODE, str(path), ",".join(str(n) for n in shape), str(device)]
    start = time.perf_counter()
    child = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, start_new_session=True)  # its own process group, killed whole below
    try:
        _, err = child.communicate(timeout=PROBE_TIMEOUT_S)
    except BaseException as exc:  # hung, or this process interrupted: the child must not outlive the probe
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        child.communicate()
        if not isinstance(exc, subprocess.TimeoutExpired):
            raise
        raise CnnsError(f"torch {torch.__version__} did not load and run the AOTInductor package {path} on {device} "
                        f"within {PROBE_TIMEOUT_S} s (tried in a child process; nothing was timed): "
                        f"{_instead()}") from None
    if child.returncode < 0:
        try:
            name = signal.Signals(-child.returncode).name
        except ValueError:
            name = f"signal {-child.returncode}"
        raise CnnsError(f"torch {torch.__version__} crashed ({name}) loading the AOTInductor package {path} on "
                        f"{device} (tried in a child process; nothing was timed): {_instead()}")
    if child.returncode != 0:
        lines = [line for line in err.splitlines() if line.strip()]
        reason = lines[-1].strip()[:200] if lines else f"exit code {child.returncode}"
        raise CnnsError(f"cannot load the compiled model {path} with torch {torch.__version__} on {device}: {reason} "
                        f"(use --force-recompile; if it fails again, {_instead()})")
    return time.perf_counter() - start


def infer(cfg: RunConfig, notices: list[str], checkpoint: Path | None = None, artefact_path: str | None = None,
          force_recompile: bool = False) -> int:
    """inference_embedded.py: compile the model once (or load the compiled artefact) and time it; `checkpoint`:
    the weights (`cnns.runfolder.run_folder.open_restore_path` found them, and `cfg` holds their run's model), None for random."""
    from cnns.commands.checks import check_no_sinks_without_a_folder

    check_no_sinks_without_a_folder(cfg, "inference_embedded.py writes no run folder")
    for notice in notices:
        print(f"notice: {notice}")
    device = resolve_device(cfg.device)
    path = Path(artefact_path or artefact_name(cfg, checkpoint))
    images = inference_batch(cfg)
    description = artefact_description(cfg, checkpoint, device)
    stale = compiled_for_other_options(path, description) if path.exists() else []
    if stale:
        print(f"The compiled model at {path} was built for another {', '.join(stale)}: compiling it again")
    if path.exists() and not stale and not force_recompile:
        print(f"Loading the compiled model from {path}")
    else:
        claim_artefact(path, checkpoint)
        model = build_inference_model(cfg, checkpoint, device)
        print(f"Total Parameters:{sum(p.numel() for p in model.parameters())}")
        start = time.perf_counter()
        _description_path(path).unlink(missing_ok=True)  # never beside a package it does not describe
        export_pt2(model, images.to(device), dynamic=False, out=path)
        write_atomically(_description_path(path), json.dumps(description, indent=1) + "\n")
        print(f"Compilation time: {time.perf_counter() - start:.3f}s. Saved the compiled model to {path}")
    if device.type in PROBED_DEVICE_TYPES:  # before this process loads it, and before anything is timed
        seconds = probe_package(path, tuple(images.shape), device)
        print(f"torch {torch.__version__} loaded and ran the compiled model in a child process first "
              f"({seconds:.1f}s, not timed)")
    try:
        runner = load_compiled(path, device)
    except Exception as exc:  # a foreign or truncated file: one clear line
        reason = str(exc).splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        if not compiled_here(path):  # not cnns's to replace: --force-recompile would be refused
            raise CnnsError(f"cannot load {path} as a compiled model ({reason}); cnns did not compile it (no "
                            f"{_description_path(path).name} beside it): give another --artefact-path") from None
        raise CnnsError(f"cannot load the compiled model {path}: {reason} (use --force-recompile)") from None
    return _measure(runner, images.to(device), iterations=cfg.train.iterations, device=device)


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
