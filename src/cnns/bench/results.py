"""What a benchmark invocation found, entry by entry: its figures, the ratios and fractions computed
from them, and how they are printed and written (a table on the screen, CSV and JSON files)."""

from __future__ import annotations

import csv
import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cnns.bench.spec import BACKENDS_KIND, COMMAND_KIND

# The measured sides of a command entry: cnns, the plain loop eager, the plain loop torch.compile'd. Each has
# <side>_images_per_sec, <side>_runs, <side>_peak_fraction and <side>_roofline_fraction; each plain side has
# its ratio (cnns over it) and per-repeat ratios: ratio / pair_ratios (eager), ratio_compiled /
# pair_ratios_compiled (compiled).
SIDES = ("cnns", "plain", "plain_compiled")


@dataclass
class Result:
    name: str
    command: str
    model: str = ""
    mode: str = ""
    data: str = ""
    batch_size: int = 0  # the micro-batch
    grad_accum: int = 1
    cnns_images_per_sec: float | None = None
    plain_images_per_sec: float | None = None
    ratio: float | None = None
    cnns_peak_fraction: float | None = None
    plain_peak_fraction: float | None = None
    flops_per_image: float | None = None
    cnns_roofline_fraction: float | None = None
    plain_roofline_fraction: float | None = None
    roofline_images_per_sec: float | None = None
    cnns_runs: list[float] = field(default_factory=list)
    plain_runs: list[float] = field(default_factory=list)
    # cnns over plain for each repeat in which both sides ran: the two runs are adjacent in time, so they
    # share the machine's state (a shared host drifts 10-15 % within minutes); their spread shows the noise.
    pair_ratios: list[float] = field(default_factory=list)
    baseline_command: str = ""
    error: str | None = None
    kind: str = COMMAND_KIND
    device: str = "cpu"
    # The plain loop's modes that ran beside cnns (spec.BASELINE_MODES): eager fills the plain_* fields and
    # ratio / pair_ratios, compiled the plain_compiled_* fields and ratio_compiled / pair_ratios_compiled.
    baseline_modes: list[str] = field(default_factory=lambda: ["eager"])
    plain_compiled_images_per_sec: float | None = None
    ratio_compiled: float | None = None
    plain_compiled_peak_fraction: float | None = None
    plain_compiled_roofline_fraction: float | None = None
    plain_compiled_runs: list[float] = field(default_factory=list)
    pair_ratios_compiled: list[float] = field(default_factory=list)
    # inference-backends entries: one dict per backend (cnns.bench.backends.BackendResult's fields, the best
    # repeat's), plus "runs" (images/s per repeat) and "ratios" (over eager float32, per repeat)
    backends: list[dict[str, Any]] = field(default_factory=list)


def entry_failed(result: Result) -> bool:
    """A command entry failed when our side gave no throughput; an inference-backends entry when any backend
    (or the process) failed. A backend skipped on this machine (bfloat16 where it is emulated) is no failure."""
    if result.kind == BACKENDS_KIND:
        return bool(result.error) or not result.backends or any(b.get("error") for b in result.backends)
    return result.cnns_images_per_sec is None


def paired_ratio(result: Result, mode: str = "eager") -> float | None:
    """The median of the per-repeat ratios against the plain loop in `mode` (eager or compiled): on a shared
    host whose speed drifts within minutes, the runs of a repeat see the same machine, while the best run of
    each side may come from different moments (one ResNet-20 invocation gave pairs of 1.39, 1.13 and 0.89x).
    With one repeat it is the plain ratio."""
    pairs = result.pair_ratios_compiled if mode == "compiled" else result.pair_ratios
    return statistics.median(pairs) if pairs else None


def set_peak_fractions(result: Result, peak_gflops: float) -> None:
    """images/s x FLOPs per image as a fraction of the measured bfloat16 matmul rate."""
    if not result.flops_per_image or not peak_gflops:
        return
    for side in SIDES:
        rate = getattr(result, f"{side}_images_per_sec")
        if rate:
            setattr(result, f"{side}_peak_fraction", rate * result.flops_per_image / (peak_gflops * 1e9))


def _fmt(value: float | None, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


def _percent(fraction: float | None) -> str:
    return _fmt(None if fraction is None else 100 * fraction, "{:.1f}%")


def _table_row(r: Result, paired: bool, compiled: bool) -> list[str]:
    row = [r.name, r.model, r.mode, r.data, str(r.batch_size) + (f"x{r.grad_accum}" if r.grad_accum > 1 else ""),
           _fmt(r.cnns_images_per_sec, "{:.2f}"), _fmt(r.plain_images_per_sec, "{:.2f}"), _fmt(r.ratio, "{:.2f}x")]
    if compiled:
        row += [_fmt(r.plain_compiled_images_per_sec, "{:.2f}"), _fmt(r.ratio_compiled, "{:.2f}x")]
    row += [_percent(r.cnns_peak_fraction), _percent(r.plain_peak_fraction), _fmt(r.roofline_images_per_sec, "{:.1f}"),
            _percent(r.cnns_roofline_fraction), _percent(r.plain_roofline_fraction)]
    if compiled:
        row.append(_percent(r.plain_compiled_roofline_fraction))
    if paired:
        row.append(" ".join(f"{v:.2f}" for v in r.pair_ratios) or "-")
        if compiled:
            row.append(" ".join(f"{v:.2f}" for v in r.pair_ratios_compiled) or "-")
    return row


def format_table(results: list[Result], peak_gflops: float, bandwidth_gbs: float | None = None) -> str:
    # columns worth showing once there are repeats, and once a plain loop ran compiled (the GPU entries)
    paired = any(len(r.pair_ratios) > 1 or len(r.pair_ratios_compiled) > 1 for r in results)
    compiled = any("compiled" in r.baseline_modes for r in results)
    header = ["benchmark", "model", "mode", "data", "batch", "cnns img/s", "plain img/s", "ratio"]
    header += ["compiled img/s", "vs compiled"] if compiled else []
    header += ["cnns %peak", "plain %peak", "roofline img/s", "cnns %roof", "plain %roof"]
    header += ["compiled %roof"] if compiled else []
    header += ["ratio per repeat"] if paired else []
    header += ["vs compiled per repeat"] if paired and compiled else []
    rows = [_table_row(r, paired, compiled) for r in results]
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = [" | ".join(h.ljust(w) for h, w in zip(header, widths)),
             "-|-".join("-" * w for w in widths)]
    lines += [" | ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
    lines.append(f"peak: the faster 2048x2048 matmul (bfloat16 or float32) {peak_gflops:.1f} GFLOP/s; "
                 "training FLOPs = 3 x forward; "
                 "batch MxA = micro-batch x accumulation (both loops).")
    if compiled:
        lines.append("plain: the plain loop as written (eager); compiled: the same loop with torch.compile(model) "
                     "(default mode), its compilation in the dropped first interval; ratio / vs compiled: cnns "
                     "img/s over each.")
    if any(r.device != "cpu" for r in results):
        lines.append("(the CPU's peak and bandwidth; an entry on a GPU is measured against that GPU's, printed "
                     "at the start)")
    if bandwidth_gbs:
        lines.append(f"roofline: sum over the operators of max(FLOPs / peak, minimal bytes / {bandwidth_gbs:.1f} GB/s "
                     "stream triad) (cnns.bench.roofline); %roof = img/s over the roofline's.")
    if paired:
        lines.append("img/s: the best run of each side; ratio: the median of the repeats' ratios of adjacent runs.")
    for r in results:
        if r.error:
            lines.append(f"{r.name}: {r.error}")
    return "\n".join(lines)


def _compile_cell(row: dict[str, Any]) -> str:
    if row.get("compile_s") is None:
        return "-"
    return f"{row['compile_s']:.1f}" + (" (cached)" if row.get("cached") else "")


def format_backends_table(results: list[Result]) -> str:
    """The inference-backends entries: one line per backend, and which was fastest in each entry."""
    repeated = any(len(b.get("runs", [])) > 1 for r in results for b in r.backends)
    header = ["benchmark", "model", "batch", "backend", "img/s", "latency avg ms", "p99 ms", "vs eager",
              "compile s", "rel diff"] + (["vs eager per repeat"] if repeated else [])
    rows = []
    for r in results:
        for b in r.backends:
            measured = b.get("images_per_sec") is not None
            state = "skipped" if b.get("skipped") else "error"
            row = [r.name, r.model, str(r.batch_size), b["label"],
                   _fmt(b.get("images_per_sec"), "{:.2f}") if measured else state,
                   _fmt(b.get("latency_avg_ms"), "{:.2f}"), _fmt(b.get("latency_p99_ms"), "{:.2f}"),
                   _fmt(b.get("ratio_vs_eager"), "{:.2f}x"), _compile_cell(b), _fmt(b.get("max_rel_diff"), "{:.1e}")]
            if repeated:
                row.append(" ".join(f"{v:.2f}" for v in b.get("ratios", [])) or "-")
            rows.append(row)
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = [" | ".join(h.ljust(w) for h, w in zip(header, widths)), "-|-".join("-" * w for w in widths)]
    lines += [" | ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
    lines.append("All on the same random uint8 NHWC batch, normalisation inside the model, one process per run, "
                 "the same threads; latency per batch (p99: numpy percentile of the timed batches, warm-up "
                 "excluded); vs eager: images/s over eager float32's in the same process"
                 + (" (median of the repeats)" if repeated else "") + "; compile s: export + compilation, "
                 "not timed (cached: made by an earlier run); rel diff: the largest |logit - eager float32's| over the largest |logit|.")
    for r in results:
        measured = [b for b in r.backends if b.get("images_per_sec")]
        if measured:
            # By the ratio to eager in the same process where there is one (its median over repeats pairs
            # runs of the same moment); the best runs of two backends may come from different moments.
            paired = all(b.get("ratio_vs_eager") for b in measured)
            fastest = max(measured, key=lambda b: b["ratio_vs_eager"] if paired else b["images_per_sec"])
            quickest = min(measured, key=lambda b: b["latency_avg_ms"])
            lines.append(f"{r.name}: fastest {fastest['label']} ({fastest['images_per_sec']:.2f} img/s"
                         + (f", {fastest['ratio_vs_eager']:.2f}x eager float32" if fastest.get("ratio_vs_eager")
                            else "") + f"); lowest latency {quickest['label']} ({quickest['latency_avg_ms']:.2f} ms)")
        for b in r.backends:
            if b.get("skipped"):
                lines.append(f"{r.name}: {b['label']} skipped: {b['skipped']}")
            if b.get("error"):
                lines.append(f"{r.name}: {b['label']}: {b['error']}")
        if r.error:
            lines.append(f"{r.name}: {r.error}")
    return "\n".join(lines)


CSV_COLUMNS = ("name", "model", "mode", "data", "batch_size", "grad_accum", "cnns_images_per_sec",
               "plain_images_per_sec", "ratio", "cnns_peak_fraction", "plain_peak_fraction", "flops_per_image",
               "roofline_images_per_sec", "cnns_roofline_fraction", "plain_roofline_fraction",
               "cnns_runs", "plain_runs", "pair_ratios", "command", "baseline_command", "error", "device",
               # inference-backends entries: one row per backend
               "kind", "backend", "images_per_sec", "latency_avg_ms", "latency_p99_ms", "ratio_vs_eager",
               "compile_s", "max_abs_diff", "max_rel_diff",
               # the plain loop torch.compile'd (baseline_modes: compiled, the GPU entries' default)
               "baseline_modes", "plain_compiled_images_per_sec", "ratio_compiled", "plain_compiled_peak_fraction",
               "plain_compiled_roofline_fraction", "plain_compiled_runs", "pair_ratios_compiled")


def _backend_csv_rows(r: Result) -> list[dict[str, Any]]:
    rows = []
    for b in r.backends:
        row = {key: getattr(r, key) for key in ("name", "model", "mode", "data", "batch_size", "grad_accum",
                                                "command", "kind")}
        row.update({key: b.get(key) for key in ("backend", "images_per_sec", "latency_avg_ms", "latency_p99_ms",
                                                "ratio_vs_eager", "compile_s", "max_abs_diff", "max_rel_diff")})
        row["cnns_runs"] = " ".join(f"{v:.3f}" for v in b.get("runs", []))
        row["pair_ratios"] = " ".join(f"{v:.3f}" for v in b.get("ratios", []))
        problems = [f"skipped: {b['skipped']}" if b.get("skipped") else None, b.get("error"), r.error]
        row["error"] = "; ".join(p for p in problems if p) or None
        rows.append(row)
    return rows


def write_results(results: list[Result], meta: dict[str, Any], out_dir: Path, stem: str) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path, json_path = out_dir / f"{stem}.csv", out_dir / f"{stem}.json"
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for r in results:
            if r.kind == BACKENDS_KIND:
                writer.writerows(_backend_csv_rows(r))
                continue
            row = asdict(r)
            row["cnns_runs"] = " ".join(f"{v:.3f}" for v in r.cnns_runs)
            row["plain_runs"] = " ".join(f"{v:.3f}" for v in r.plain_runs)
            row["pair_ratios"] = " ".join(f"{v:.3f}" for v in r.pair_ratios)
            row["plain_compiled_runs"] = " ".join(f"{v:.3f}" for v in r.plain_compiled_runs)
            row["pair_ratios_compiled"] = " ".join(f"{v:.3f}" for v in r.pair_ratios_compiled)
            row["baseline_modes"] = " ".join(r.baseline_modes)
            writer.writerow(row)
    json_path.write_text(json.dumps({**meta, "results": [asdict(r) for r in results]}, indent=2) + "\n")
    return csv_path, json_path


def print_tables(results: list[Result], peak: float, bandwidth: float | None = None) -> None:
    commands = [r for r in results if r.kind != BACKENDS_KIND]
    backends = [r for r in results if r.kind == BACKENDS_KIND]
    print()
    if commands or not backends:
        print(format_table(commands, peak, bandwidth))
    if backends:
        if commands:
            print()
        print(format_backends_table(backends))
