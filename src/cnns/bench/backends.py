"""Inference backends side by side: eager PyTorch, an AOTInductor package and onnxruntime, in one process.

* **The same model and input**: the entry's inference_embedded.py command line, resolved (its model, batch,
  image size, --seed, --iterations), and the model that script compiles
  (`cnns.deploy.restored_model.build_inference_model`: the one assembly, behind the normalisation of uint8 NHWC
  images), its random weights drawn from --seed; every backend takes the same batch (`inference_batch`). Each
  one's logits are compared with eager float32's (``max_rel_diff``: over the largest |logit|, since randomly
  initialised EfficientNets give logits of about 1e-5); a float32 backend further off than `AGREEMENT_TOLERANCE`
  is an error, its speed not comparable.
* **Precision**: ``eager``, ``aoti`` and ``onnxruntime`` run that model at 32.32 (the package and the ONNX graph
  exported from it as ``cnns export`` writes them), ``eager-bf16`` and ``aoti-bf16`` at 16.16 in bfloat16 (what
  inference_embedded.py compiles by default); these two are skipped, with the reason, on a CPU that would
  emulate bfloat16.
* **Threads**: ``threads`` (default: this process's cores) for torch, and onnxruntime's intra-op threads
  (one inter-op thread, sequential execution).
* **Timing**: ``warmup`` batches, then --iterations batches each timed alone (latency avg and p99 by numpy's
  percentile; throughput = images / the timed seconds), split into ``rounds`` that visit the backends in
  alternating order. Per-batch clocks, not torch.utils.benchmark.Timer: its blocks give no per-batch p99.
* **Compilation** (``torch.export`` + AOTInductor; the dynamo ONNX exporter) is timed apart and never counted;
  the artefacts are kept in ``cache_dir`` under a key of model, batch, seed and library versions.

Run as ``python -m cnns.bench.backends '<json>'`` (`BackendsSpec`): `cnns benchmark` does so for a ``kind:
inference-backends`` entry and reads the JSON written to ``result_path``.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import nn
from torch.utils.benchmark.utils.common import set_torch_threads

from cnns.bench.rates import in_turn
from cnns.bench.benchmark_file import DEFAULT_BACKENDS, BackendsSpec, check_backends
from cnns.config import RunConfig
from cnns.deploy.graphs import export_onnx, export_pt2, load_compiled
from cnns.parallel.world import usable_cores
from cnns.precision import FLOAT32_PRECISION, HALF_PRECISION
from cnns.safe_writes import write_atomically

LABELS = {"eager": "eager float32", "eager-bf16": "eager bf16", "aoti": "AOTInductor float32",
          "aoti-bf16": "AOTInductor bf16", "onnxruntime": "onnxruntime float32"}
# A float32 backend may differ from eager float32 by this much, relative to the largest |logit|: different
# kernels sum in different orders (1e-7..1e-6 relative measured), a wrong graph differs by O(1).
AGREEMENT_TOLERANCE = 1e-3


@dataclass
class BackendResult:
    backend: str  # one of spec.BACKENDS
    label: str
    dtype: str
    batch_size: int
    iterations: int = 0  # timed batches
    images_per_sec: float | None = None
    latency_avg_ms: float | None = None
    latency_p50_ms: float | None = None
    latency_p99_ms: float | None = None
    latency_max_ms: float | None = None
    ratio_vs_eager: float | None = None  # images/s over eager float32's, in the same process
    compile_s: float | None = None  # export + compilation of the artefact (None for eager)
    cached: bool = False  # the artefact came from the cache (compile_s is then the time it took when made)
    load_s: float | None = None  # loading the package / creating the onnxruntime session
    max_abs_diff: float | None = None  # largest |logit - eager float32 logit| on the measured batch
    max_rel_diff: float | None = None  # max_abs_diff over the largest |eager float32 logit|
    threads: int = 0
    skipped: str | None = None  # why the backend did not run on this machine (not an error)
    error: str | None = None


# --- the model every backend runs

def at_precision(cfg: RunConfig, backend: str) -> RunConfig:
    """`cfg` with the precision `backend` runs: 16.16 in bfloat16 for a -bf16 one, else 32.32."""
    half = backend.endswith("-bf16")
    precision = replace(cfg.precision, precision=HALF_PRECISION if half else FLOAT32_PRECISION,
                        half_dtype="bfloat16", half_dtype_given=half)
    return replace(cfg, precision=precision)


def inference_module(cfg: RunConfig, backend: str) -> nn.Module:
    """The model inference_embedded.py compiles, at `backend`'s precision, with the same random weights for
    every backend (drawn from --seed)."""
    from cnns.deploy.restored_model import build_inference_model

    torch.manual_seed(cfg.train.seed or 0)
    return build_inference_model(at_precision(cfg, backend), None, torch.device("cpu"))


def cache_key(cfg: RunConfig) -> str:
    """A folder name for one model at one batch size: readable, plus a hash of everything that shapes the artefact."""
    import onnx

    from cnns.engine.fusion import fused_norms

    m = cfg.model
    fused = [norm.__name__ for norm in fused_norms(torch.device("cpu"), cfg.train.fused_norm)]  # the assembly's passes in the graph
    identity = json.dumps({"model": asdict(m), "batch": cfg.train.micro_batch_size, "seed": cfg.train.seed,
                           "image_size": cfg.data.image_size, "normalise": cfg.data.normalise_input,
                           "fused": fused, "torch": torch.__version__, "onnx": onnx.__version__}, sort_keys=True)
    digest = hashlib.sha256(identity.encode()).hexdigest()[:10]
    return f"{m.arch}{m.size}-{m.image_size}px-bs{cfg.train.micro_batch_size}-{digest}"


# --- artefacts

def _read_meta(folder: Path) -> dict[str, Any]:
    try:
        return json.loads((folder / "meta.json").read_text())
    except (OSError, ValueError):
        return {}


def make_artefact(backend: str, module: nn.Module, example: torch.Tensor, folder: Path,
                  force: bool = False) -> tuple[Path, float, bool]:
    """The backend's compiled file in `folder` (made unless there): (path, seconds it took to make, cached)."""
    path = folder / ("model.onnx" if backend == "onnxruntime" else f"{backend}.pt2")
    meta = _read_meta(folder)
    if path.is_file() and not force and backend in meta:
        return path, float(meta[backend]), True
    folder.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    if backend == "onnxruntime":
        export_onnx(module, example, False, path)
    else:
        export_pt2(module, example, False, path)
    seconds = time.perf_counter() - start
    write_atomically(folder / "meta.json", json.dumps({**_read_meta(folder), backend: seconds}, indent=2) + "\n")
    return path, seconds, False


# --- measurement

def _fail(result: BackendResult, exc: Exception, say: Callable[[str], None]) -> None:
    first = (str(exc).strip().splitlines() or [""])[0][:300]
    result.error = f"{type(exc).__name__}: {first}"
    say(f"{result.label}: {result.error}")


def _finish(result: BackendResult, latencies_ms: list[float], seconds: float) -> None:
    values = np.asarray(latencies_ms, dtype=np.float64)
    result.iterations = len(values)
    result.images_per_sec = result.batch_size * len(values) / seconds
    result.latency_avg_ms = float(values.mean())
    result.latency_p50_ms = float(np.percentile(values, 50))
    result.latency_p99_ms = float(np.percentile(values, 99))
    result.latency_max_ms = float(values.max())


def _compare(result: BackendResult, logits: torch.Tensor, reference: torch.Tensor) -> None:
    result.max_abs_diff = float((logits.float() - reference).abs().max())
    scale = float(reference.abs().max())
    result.max_rel_diff = result.max_abs_diff / scale if scale > 0 else (0.0 if result.max_abs_diff == 0 else None)


def _agreement_error(result: BackendResult) -> str | None:
    if result.dtype != "float32" or result.max_abs_diff is None:
        return None
    if result.max_rel_diff is None or result.max_rel_diff > AGREEMENT_TOLERANCE:
        return (f"logits differ from eager float32 by {result.max_abs_diff:.3g} (relative "
                f"{result.max_rel_diff if result.max_rel_diff is not None else float('inf'):.3g}): "
                "not the same computation")
    return None


def measure_backends(cfg: RunConfig, backends: tuple[str, ...] | list[str] = DEFAULT_BACKENDS, warmup: int = 3,
                     threads: int | None = None, cache_dir: str | Path | None = None, rounds: int = 1,
                     log: Callable[[str], None] | None = None) -> list[BackendResult]:
    """One `BackendResult` per backend, in the order asked, for the inference_embedded.py run `cfg` (see the
    module docstring for what each does). ``cache_dir`` keeps the compiled artefacts (default: a temporary
    folder, removed at the end); ``log`` receives one line per step."""
    import tempfile

    from cnns.deploy.restored_model import inference_batch
    from cnns.precision import cpu_half_is_emulated

    check_backends(backends)
    iterations = cfg.train.iterations  # inference_embedded.py's --iterations (its default: cnns.cli.parsing's)
    if warmup < 0 or rounds < 1:
        raise ValueError("rounds must be at least 1, warmup at least 0")
    say = log or (lambda line: None)
    threads = threads or usable_cores()
    images = inference_batch(cfg)
    batch_size = len(images)
    results = {b: BackendResult(b, LABELS[b], "bfloat16" if b.endswith("bf16") else "float32", batch_size,
                                 threads=threads) for b in backends}
    emulated = cpu_half_is_emulated(torch.device("cpu"), torch.bfloat16)
    cache = tempfile.TemporaryDirectory(prefix="cnns-backends-") if cache_dir is None else nullcontext(cache_dir)
    with cache as where, set_torch_threads(threads):
        folder = Path(where) / cache_key(cfg)
        # Built and first called outside inference mode: torch.export refuses inference tensors. The eager
        # call comes before any export, so that normalise()'s cached constants are made outside tracing.
        modules = {"float32": inference_module(cfg, "eager")}
        with torch.no_grad():
            reference = modules["float32"](images)
        calls: dict[str, Callable[[], torch.Tensor]] = {}
        for backend in backends:
            result = results[backend]
            if result.dtype == "bfloat16" and emulated:
                result.skipped = "this CPU has no bfloat16 arithmetic (no AVX512-BF16 or AMX): bfloat16 is emulated"
                say(f"{result.label}: skipped, {result.skipped}")
                continue
            try:
                if result.dtype not in modules:  # called once, outside inference mode, as the reference is
                    modules[result.dtype] = inference_module(cfg, backend)
                    with torch.no_grad():
                        modules[result.dtype](images)
                calls[backend] = _prepare(backend, result, modules[result.dtype], images, folder, threads, reference,
                                          say)
            except Exception as exc:  # one backend failing must not lose the others' measurements
                _fail(result, exc, say)
        _time_all(calls, results, batch_size, warmup, iterations, rounds, say)
    eager = results.get("eager")
    for result in results.values():
        if eager is not None and eager.images_per_sec and result.images_per_sec:
            result.ratio_vs_eager = result.images_per_sec / eager.images_per_sec
    return [results[b] for b in backends]


def _prepare(backend: str, result: BackendResult, module: nn.Module, images: torch.Tensor, folder: Path,
             threads: int, reference: torch.Tensor, say) -> Callable[[], torch.Tensor]:
    """Build (or load) the backend from `module` (the model at its precision), check its logits against eager
    float32, and return its call."""
    run = module if backend.startswith("eager") else _compiled(backend, result, module, images, folder, threads,
                                                               reference, say)

    def call() -> torch.Tensor:
        with torch.inference_mode():
            return run(images)

    _compare(result, call(), reference)
    problem = _agreement_error(result)
    if problem is not None:
        raise RuntimeError(problem)
    return call


def _compiled(backend: str, result: BackendResult, module: nn.Module, images: torch.Tensor, folder: Path,
              threads: int, reference: torch.Tensor, say) -> Callable[[torch.Tensor], torch.Tensor]:
    """The backend's artefact loaded (made first unless cached): one that disagrees with eager float32 and came
    from the cache (made by other code) is made again, once."""
    for attempt in range(2):
        path, seconds, cached = make_artefact(backend, module, images, folder, force=attempt > 0)
        result.compile_s, result.cached = seconds, cached
        say(f"{result.label}: {'cached ' if cached else ''}artefact {path} ({seconds:.1f} s to make)")
        start = time.perf_counter()
        run = load_compiled(path, threads=threads)
        result.load_s = time.perf_counter() - start
        with torch.inference_mode():
            _compare(result, run(images), reference)
        problem = _agreement_error(result)
        if problem is None or not cached:
            break
        say(f"{result.label}: the cached artefact disagrees ({problem}); compiling it again")
    return run


def _time_all(calls: dict[str, Callable[[], torch.Tensor]], results: dict[str, BackendResult], batch_size: int,
              warmup: int, iterations: int, rounds: int, say) -> None:
    """Warm up each backend, then time them batch by batch in `rounds` rounds of alternating order."""
    latencies: dict[str, list[float]] = {backend: [] for backend in calls}
    seconds = dict.fromkeys(calls, 0.0)

    def run(backend: str, count: int) -> None:
        if results[backend].error:
            return
        start = time.perf_counter()
        try:
            for _ in range(count):
                t0 = time.perf_counter()
                calls[backend]()
                latencies[backend].append(1000.0 * (time.perf_counter() - t0))
        except Exception as exc:  # e.g. out of memory at a large batch: the others still count
            _fail(results[backend], exc, say)
        seconds[backend] += time.perf_counter() - start

    for backend in calls:
        run(backend, warmup)
        latencies[backend], seconds[backend] = [], 0.0  # the warm-up is not counted
    for r in range(rounds):
        for backend in in_turn(list(calls), r):
            run(backend, iterations // rounds + (1 if r < iterations % rounds else 0))
    for backend, result in results.items():
        if latencies.get(backend) and not result.error:
            _finish(result, latencies[backend], seconds[backend])
            say(f"{result.label}: {result.images_per_sec:.2f} images/s, latency avg {result.latency_avg_ms:.2f} ms, "
                f"p99 {result.latency_p99_ms:.2f} ms over {result.iterations} batches of {batch_size}")


# --- the subprocess that `cnns benchmark` runs

def main(argv: list[str] | None = None) -> int:
    from cnns.engine.build import keep_freed_host_memory

    argv = sys.argv[1:] if argv is None else argv
    spec = BackendsSpec(**json.loads(argv[0]))
    cfg = RunConfig.from_options(spec.options)
    keep_freed_host_memory(torch.device("cpu"), cfg.train.malloc_tuning)  # as cnns's runs do; for every backend
    results = measure_backends(cfg, tuple(spec.backends), warmup=spec.warmup,
                               threads=spec.threads, cache_dir=spec.cache_dir, rounds=spec.rounds,
                               log=lambda line: print(line, flush=True))
    document = {"spec": asdict(spec), "torch": torch.__version__, "results": [asdict(r) for r in results]}
    text = json.dumps(document, indent=2) + "\n"
    if spec.result_path:
        write_atomically(spec.result_path, text)
    else:
        print(text)
    return 1 if any(r.error for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
