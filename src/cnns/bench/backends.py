"""Inference backends side by side: eager PyTorch, an AOTInductor package and onnxruntime, in one process.

* **The same model and input**: `cnns.models.build_model` from a fixed seed behind
  `cnns.deploy.restored.NormalisedClassifier`, every backend taking the same random uint8 NHWC batch. Each one's
  logits are compared with eager float32's (``max_rel_diff``: over the largest |logit|, since randomly
  initialised EfficientNets give logits of about 1e-5); a float32 backend further off than `AGREEMENT_TOLERANCE`
  is an error, its speed not comparable.
* **Precision**: ``eager``, ``aoti`` and ``onnxruntime`` run float32 (channels_last; the package and the ONNX
  graph exported from that module as ``cnns export`` writes them). ``eager-bf16`` is cnns's eager 16.16
  (`PrecisionPolicy.apply_to_model`), ``aoti-bf16`` what ``inference_embedded.py`` compiles at 16.16 (the
  whole module in bfloat16); both skipped, with the reason, on a CPU that would emulate bfloat16.
* **Threads**: ``threads`` (default: this process's cores) for torch, and onnxruntime's intra-op threads
  (one inter-op thread, sequential execution).
* **Timing**: ``warmup`` batches, then ``iterations`` batches each timed alone (latency avg and p99 by numpy's
  percentile; throughput = images / the timed seconds), split into ``rounds`` that visit the backends in
  alternating order. Per-batch clocks, not torch.utils.benchmark.Timer: its blocks give no per-batch p99.
* **Compilation** (``torch.export`` + AOTInductor; the dynamo ONNX exporter) is timed apart and never counted;
  the artefacts are kept in ``cache_dir`` under a key of model, batch, seed and library versions.

Run as ``python -m cnns.bench.backends '<json>'`` (`BackendsSpec`): `cnns benchmark` does so for a ``kind:
inference-backends`` entry and reads the JSON written to ``result_path``.
"""

from __future__ import annotations

import copy
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

from cnns.bench.rates import available_cores, in_turn
from cnns.bench.spec import DEFAULT_BACKENDS, BackendsSpec, check_backends
from cnns.files import write_atomically

LABELS = {"eager": "eager float32", "eager-bf16": "eager bf16", "aoti": "AOTInductor float32",
          "aoti-bf16": "AOTInductor bf16", "onnxruntime": "onnxruntime float32"}
# A float32 backend may differ from eager float32 by this much, relative to the largest |logit|: different
# kernels sum in different orders (1e-7..1e-6 relative measured), a wrong graph differs by O(1).
AGREEMENT_TOLERANCE = 1e-3
IMAGENET_STD = (0.229, 0.224, 0.225)


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


# --- the module every backend runs

def float32_module(model_spec, seed: int) -> nn.Module:
    """uint8 NHWC -> float32 logits, float32 channels_last weights, the same for every seed."""
    from cnns.deploy.restored import NormalisedClassifier
    from cnns.models import build_model

    torch.manual_seed(seed)
    model = build_model(model_spec).to(memory_format=torch.channels_last).eval()
    return NormalisedClassifier(model, IMAGENET_STD, torch.float32).eval()


def bf16_module(reference: nn.Module, whole: bool) -> nn.Module:
    """cnns's eager 16.16 inference (bfloat16 weights, normalisation layers in float32: mixed-type kernels), or
    with `whole` what inference_embedded.py compiles at 16.16 (the whole model in bfloat16)."""
    from cnns.deploy.restored import NormalisedClassifier
    from cnns.precision import PrecisionPolicy

    model = copy.deepcopy(reference.model)
    if whole:
        model.to(dtype=torch.bfloat16)
    else:
        PrecisionPolicy.resolve("16.16", "bfloat16", torch.device("cpu")).apply_to_model(model)
    model = model.to(memory_format=torch.channels_last).eval()
    return NormalisedClassifier(model, reference.std, torch.bfloat16).eval()


def cache_key(model_spec, batch_size: int, seed: int) -> str:
    """A folder name for one model at one batch size: readable, plus a hash of everything that shapes the artefact."""
    import onnx

    identity = json.dumps({"spec": repr(model_spec), "batch": batch_size, "seed": seed, "torch": torch.__version__,
                           "onnx": onnx.__version__}, sort_keys=True)
    digest = hashlib.sha256(identity.encode()).hexdigest()[:10]
    return f"{model_spec.arch}{model_spec.size}-{model_spec.image_size}px-bs{batch_size}-{digest}"


# --- artefacts

def _read_meta(folder: Path) -> dict[str, Any]:
    try:
        return json.loads((folder / "meta.json").read_text())
    except (OSError, ValueError):
        return {}


def make_artefact(backend: str, module: nn.Module, example: torch.Tensor, folder: Path,
                  force: bool = False) -> tuple[Path, float, bool]:
    """The backend's compiled file in `folder` (made unless there): (path, seconds it took to make, cached)."""
    from cnns.deploy.graphs import export_onnx, export_pt2

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


def load_artefact(backend: str, path: Path, threads: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """A call images -> logits (a torch tensor) for the compiled file."""
    if backend == "onnxruntime":
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        name = session.get_inputs()[0].name

        def run_onnx(images: torch.Tensor) -> torch.Tensor:
            return torch.from_numpy(session.run(None, {name: images.numpy()})[0])

        return run_onnx
    runner = torch._inductor.aoti_load_package(str(path))
    return lambda images: runner(images)


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


def measure_backends(model_spec, batch_size: int, image_size: int | None = None,
                     backends: tuple[str, ...] | list[str] = DEFAULT_BACKENDS, warmup: int = 3, iterations: int = 20,
                     threads: int | None = None, cache_dir: str | Path | None = None, seed: int = 0,
                     rounds: int = 1, log: Callable[[str], None] | None = None) -> list[BackendResult]:
    """One `BackendResult` per backend, in the order asked (see the module docstring for what each does).

    ``image_size`` overrides ``model_spec.image_size``; ``cache_dir`` keeps the compiled artefacts
    (default: a temporary folder, removed at the end); ``log`` receives one line per step.
    """
    import tempfile

    from cnns.precision import cpu_half_is_emulated

    check_backends(backends)
    if batch_size < 1 or iterations < 1 or warmup < 0 or rounds < 1:
        raise ValueError("batch_size, iterations and rounds must be at least 1, warmup at least 0")
    say = log or (lambda line: None)
    if image_size is not None and image_size != model_spec.image_size:
        model_spec = replace(model_spec, image_size=image_size)
    threads = threads or available_cores()
    size = model_spec.image_size
    images = torch.randint(0, 256, (batch_size, size, size, 3), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(seed))
    results = {b: BackendResult(b, LABELS[b], "bfloat16" if b.endswith("bf16") else "float32", batch_size,
                                 threads=threads) for b in backends}
    emulated = cpu_half_is_emulated(torch.device("cpu"), torch.bfloat16)
    cache = tempfile.TemporaryDirectory(prefix="cnns-backends-") if cache_dir is None else nullcontext(cache_dir)
    with cache as where, set_torch_threads(threads):
        folder = Path(where) / cache_key(model_spec, batch_size, seed)
        # Built and first called outside inference mode: torch.export refuses inference tensors. The eager
        # call comes before any export, so that normalise()'s cached constants are made outside tracing.
        reference_module = float32_module(model_spec, seed)
        with torch.no_grad():
            reference = reference_module(images)
        calls: dict[str, Callable[[], torch.Tensor]] = {}
        for backend in backends:
            result = results[backend]
            if result.dtype == "bfloat16" and emulated:
                result.skipped = "this CPU has no bfloat16 arithmetic (no AVX512-BF16 or AMX): bfloat16 is emulated"
                say(f"{result.label}: skipped, {result.skipped}")
                continue
            try:
                calls[backend] = _prepare(backend, result, reference_module, images, folder, threads, reference, say)
            except Exception as exc:  # one backend failing must not lose the others' measurements
                _fail(result, exc, say)
        _time_all(calls, results, batch_size, warmup, iterations, rounds, say)
    eager = results.get("eager")
    for result in results.values():
        if eager is not None and eager.images_per_sec and result.images_per_sec:
            result.ratio_vs_eager = result.images_per_sec / eager.images_per_sec
    return [results[b] for b in backends]


def _prepare(backend: str, result: BackendResult, reference_module: nn.Module, images: torch.Tensor, folder: Path,
             threads: int, reference: torch.Tensor, say) -> Callable[[], torch.Tensor]:
    """Build (or load) the backend, check its logits against eager float32, and return its call."""
    if backend in ("eager", "eager-bf16"):
        run = reference_module if backend == "eager" else bf16_module(reference_module, whole=False)
    else:
        run = _compiled(backend, result, reference_module, images, folder, threads, reference, say)

    def call() -> torch.Tensor:
        with torch.inference_mode():
            return run(images)

    _compare(result, call(), reference)
    problem = _agreement_error(result)
    if problem is not None:
        raise RuntimeError(problem)
    return call


def _compiled(backend: str, result: BackendResult, reference_module: nn.Module, images: torch.Tensor, folder: Path,
              threads: int, reference: torch.Tensor, say) -> Callable[[torch.Tensor], torch.Tensor]:
    """The backend's artefact loaded (made first unless cached): one that disagrees with eager float32 and came
    from the cache (made by other code) is made again, once."""
    source = bf16_module(reference_module, whole=True) if backend == "aoti-bf16" else reference_module
    for attempt in range(2):
        path, seconds, cached = make_artefact(backend, source, images, folder, force=attempt > 0)
        result.compile_s, result.cached = seconds, cached
        say(f"{result.label}: {'cached ' if cached else ''}artefact {path} ({seconds:.1f} s to make)")
        start = time.perf_counter()
        run = load_artefact(backend, path, threads)
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
    keep_freed_host_memory(torch.device("cpu"))  # as cnns's own runs do; the same for every backend here
    results = measure_backends(spec.model_spec(), spec.batch_size, spec.image_size, tuple(spec.backends),
                               warmup=spec.warmup, iterations=spec.iterations, threads=spec.threads,
                               cache_dir=spec.cache_dir, seed=spec.seed, rounds=spec.rounds,
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
