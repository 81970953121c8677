"""What a benchmark invocation found, entry by entry: each loop's runs, the ratios and fractions computed
from them, and how they are printed and written (a table on the screen, CSV and JSON files)."""

from __future__ import annotations

import csv
import io
import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cnns.bench.benchmark_file import BACKENDS_KIND, COMMAND_KIND
from cnns.safe_writes import write_atomically

# The loops a command entry measures: cnns, and the plain loop in each of its modes (spec.BASELINE_MODES).
PLAIN_SIDES = {"eager": "plain", "compiled": "plain_compiled"}
SIDES = ("cnns", *PLAIN_SIDES.values())
LABELS = {"cnns": "cnns", "plain": "plain", "plain_compiled": "compiled"}


@dataclass
class Side:
    """One loop's runs of an entry, in images/s; for a plain loop also cnns over it in each repeat in which
    both ran: those two runs are adjacent in time, so they share the machine's state."""

    runs: list[float] = field(default_factory=list)
    pair_ratios: list[float] = field(default_factory=list)
    peak_fraction: float | None = None
    roofline_fraction: float | None = None

    @property
    def images_per_sec(self) -> float | None:
        """The best run: other processes on a shared machine only ever slow a run down."""
        return max(self.runs) if self.runs else None

    @property
    def ratio(self) -> float | None:
        """cnns over this loop: the median of the repeats' ratios, since a shared host's speed drifts within
        minutes and the best runs of two loops may come from different moments."""
        return statistics.median(self.pair_ratios) if self.pair_ratios else None


@dataclass
class Result:
    name: str
    command: str
    model: str = ""
    mode: str = ""
    data: str = ""
    batch_size: int = 0  # the micro-batch
    grad_accum: int = 1
    device: str = "cpu"
    kind: str = COMMAND_KIND
    baseline_command: str = ""
    flops_per_image: float | None = None
    roofline_images_per_sec: float | None = None
    sides: dict[str, Side] = field(default_factory=dict)  # by SIDES name: cnns and the plain modes that ran
    # inference-backends entries: one dict per backend (cnns.bench.backends.BackendResult's fields, the best
    # repeat's), plus "runs" (images/s per repeat) and "ratios" (over eager float32, per repeat)
    backends: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None

    def side(self, name: str) -> Side:
        return self.sides.setdefault(name, Side())

    def images_per_sec(self, name: str) -> float | None:
        return self.sides[name].images_per_sec if name in self.sides else None

    def add_error(self, error: str) -> None:
        self.error = f"{self.error}; {error}" if self.error else error


def entry_failed(result: Result) -> bool:
    """A command entry failed when our side gave no throughput; an inference-backends entry when any backend
    (or the process) failed. A backend skipped on this machine (bfloat16 where it is emulated) is no failure."""
    if result.kind == BACKENDS_KIND:
        return bool(result.error) or not result.backends or any(b.get("error") for b in result.backends)
    return result.images_per_sec("cnns") is None


def set_peak_fractions(result: Result, peak_gflops: float) -> None:
    """Each loop's images/s x FLOPs per image as a fraction of the measured matmul peak."""
    if not result.flops_per_image or not peak_gflops:
        return
    for side in result.sides.values():
        if side.images_per_sec:
            side.peak_fraction = side.images_per_sec * result.flops_per_image / (peak_gflops * 1e9)


def set_roofline_fractions(result: Result, roofline_images_per_sec: float) -> None:
    result.roofline_images_per_sec = roofline_images_per_sec
    for side in result.sides.values():
        if side.images_per_sec:
            side.roofline_fraction = side.images_per_sec / roofline_images_per_sec


def flat_row(result: Result) -> dict[str, Any]:
    """A command entry as one flat record (the CSV row and the JSON object): ``<side>_images_per_sec``,
    ``_runs``, ``_peak_fraction``, ``_roofline_fraction``, and for a plain loop ``_ratio`` and ``_pair_ratios``."""
    row = {k: v for k, v in asdict(result).items() if k not in ("sides", "backends")}
    row["baseline_modes"] = [mode for mode, side in PLAIN_SIDES.items() if side in result.sides]
    for name, side in result.sides.items():
        row.update({f"{name}_images_per_sec": side.images_per_sec, f"{name}_runs": side.runs,
                    f"{name}_peak_fraction": side.peak_fraction, f"{name}_roofline_fraction": side.roofline_fraction})
        if name != "cnns":
            row.update({f"{name}_ratio": side.ratio, f"{name}_pair_ratios": side.pair_ratios})
    return row


def _fmt(value: float | None, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


def _percent(fraction: float | None) -> str:
    return _fmt(None if fraction is None else 100 * fraction, "{:.1f}%")


def _aligned(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(header)]
    return ([" | ".join(h.ljust(w) for h, w in zip(header, widths)), "-|-".join("-" * w for w in widths)]
            + [" | ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows])


def _by_device(values: dict[str, float], devices: list[str], unit: str) -> str:
    return ", ".join(f"{device} {values[device]:.1f} {unit}" for device in devices if device in values)


def format_table(results: list[Result], peaks: dict[str, float], bandwidths: dict[str, float] | None = None) -> str:
    """The command entries' table; `peaks` (GFLOP/s) and `bandwidths` (GB/s) by device, as measured at the
    start and end of the invocation (each entry's fractions use its own device's)."""
    shown = [s for s in SIDES if s == "cnns" or any(s in r.sides for r in results)] if results else list(SIDES[:2])
    plain = [s for s in shown if s != "cnns"]
    # per-repeat ratios are worth a column once there are repeats
    paired = any(len(r.sides[s].pair_ratios) > 1 for r in results for s in plain if s in r.sides)
    header = ["benchmark", "model", "mode", "data", "batch"]
    for s in shown:
        header += [f"{LABELS[s]} img/s"] + ([f"vs {LABELS[s]}"] if s != "cnns" else [])
    header += [f"{LABELS[s]} %peak" for s in shown] + ["roofline img/s"] + [f"{LABELS[s]} %roof" for s in shown]
    header += [f"vs {LABELS[s]} per repeat" for s in plain] if paired else []
    rows = []
    for r in results:
        sides = [r.sides.get(s, Side()) for s in shown]
        row = [r.name, r.model, r.mode, r.data, str(r.batch_size) + (f"x{r.grad_accum}" if r.grad_accum > 1 else "")]
        for s, side in zip(shown, sides):
            row += [_fmt(side.images_per_sec, "{:.2f}")] + ([_fmt(side.ratio, "{:.2f}x")] if s != "cnns" else [])
        row += [_percent(side.peak_fraction) for side in sides] + [_fmt(r.roofline_images_per_sec, "{:.1f}")]
        row += [_percent(side.roofline_fraction) for side in sides]
        if paired:
            row += [" ".join(f"{v:.2f}" for v in side.pair_ratios) or "-"
                    for s, side in zip(shown, sides) if s != "cnns"]
        rows.append(row)
    lines = _aligned(header, rows)
    devices = sorted({r.device for r in results}) or ["cpu"]
    lines.append(f"peak: the faster 2048x2048 matmul (bfloat16 or float32): {_by_device(peaks, devices, 'GFLOP/s')}; "
                 "training FLOPs = 3 x forward; batch MxA = micro-batch x accumulation (both loops); vs X: cnns img/s "
                 "over X's.")
    if "plain_compiled" in shown:
        lines.append("plain: the plain loop as written (eager); compiled: the same loop with torch.compile(model) "
                     "(default mode), its compilation in the dropped first interval.")
    if bandwidths:
        lines.append(f"roofline: sum over the operators of max(FLOPs / peak, minimal bytes / stream triad bandwidth: "
                     f"{_by_device(bandwidths, devices, 'GB/s')}) (cnns.bench.roofline); %roof = img/s over the "
                     "roofline's.")
    if paired:
        lines.append("img/s: the best run of each loop; vs X: the median of the repeats' ratios of adjacent runs.")
    lines += [f"{r.name}: {r.error}" for r in results if r.error]
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
            state = "skipped" if b.get("skipped") else "error"
            row = [r.name, r.model, str(r.batch_size), b["label"],
                   _fmt(b.get("images_per_sec"), "{:.2f}") if b.get("images_per_sec") is not None else state,
                   _fmt(b.get("latency_avg_ms"), "{:.2f}"), _fmt(b.get("latency_p99_ms"), "{:.2f}"),
                   _fmt(b.get("ratio_vs_eager"), "{:.2f}x"), _compile_cell(b), _fmt(b.get("max_rel_diff"), "{:.1e}")]
            if repeated:
                row.append(" ".join(f"{v:.2f}" for v in b.get("ratios", [])) or "-")
            rows.append(row)
    lines = _aligned(header, rows)
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


BASE_COLUMNS = ("name", "model", "mode", "data", "batch_size", "grad_accum", "device", "kind", "flops_per_image",
                "roofline_images_per_sec", "command", "baseline_command", "baseline_modes", "error")
SIDE_COLUMNS = tuple(f"{side}_{what}" for side in SIDES for what in
                     ("images_per_sec", "runs", "peak_fraction", "roofline_fraction")
                     + (("ratio", "pair_ratios") if side != "cnns" else ()))
# inference-backends entries: one row per backend (runs: images/s per repeat; ratios: over eager, per repeat)
BACKEND_COLUMNS = ("backend", "images_per_sec", "latency_avg_ms", "latency_p99_ms", "ratio_vs_eager", "compile_s",
                   "max_abs_diff", "max_rel_diff", "runs", "ratios")
CSV_COLUMNS = BASE_COLUMNS + SIDE_COLUMNS + BACKEND_COLUMNS


def _backend_rows(r: Result) -> list[dict[str, Any]]:
    rows = []
    for b in r.backends:
        problems = [f"skipped: {b['skipped']}" if b.get("skipped") else None, b.get("error"), r.error]
        rows.append({**{k: getattr(r, k) for k in BASE_COLUMNS if hasattr(r, k)},
                     **{k: b.get(k) for k in BACKEND_COLUMNS}, "error": "; ".join(p for p in problems if p) or None})
    return rows


def _csv_cell(value: Any) -> Any:
    if isinstance(value, list):
        return " ".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in value)
    return value


def write_results(results: list[Result], meta: dict[str, Any], out_dir: Path, stem: str) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path, json_path = out_dir / f"{stem}.csv", out_dir / f"{stem}.json"
    rows = [row for r in results for row in (_backend_rows(r) if r.kind == BACKENDS_KIND else [flat_row(r)])]
    table = io.StringIO()
    writer = csv.DictWriter(table, fieldnames=CSV_COLUMNS, extrasaction="ignore")
    writer.writeheader()
    writer.writerows({k: _csv_cell(v) for k, v in row.items()} for row in rows)
    write_atomically(csv_path, table.getvalue())
    records = [{**flat_row(r), "backends": r.backends} if r.kind == BACKENDS_KIND else flat_row(r) for r in results]
    write_atomically(json_path, json.dumps({**meta, "results": records}, indent=2) + "\n")
    return csv_path, json_path


def print_tables(results: list[Result], peaks: dict[str, float], bandwidths: dict[str, float] | None = None) -> None:
    commands = [r for r in results if r.kind != BACKENDS_KIND]
    backends = [r for r in results if r.kind == BACKENDS_KIND]
    print()
    if commands or not backends:
        print(format_table(commands, peaks, bandwidths))
    if backends:
        if commands:
            print()
        print(format_backends_table(backends))
