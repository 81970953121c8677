"""cnns benchmark: run each benchmarks.yml entry as Graphcore's command line, beside the plain PyTorch loop.

A command entry's ``train.py`` / ``validation.py`` command line runs in a subprocess, its run folder placed with
``--logs-path`` and ``--device`` added from the entry's ``device:`` key; its throughput is what the engine
recorded there (``img_per_sec`` of training.csv, or validation.csv), averaged as Graphcore's benchmarking
instructions average the printed values (dropping the first interval: warm-up). The plain loop
(`cnns.bench.baseline`) runs on the same model, batch, data and device, once per ``baseline_modes`` mode, writing
the same column into the same file name. The sides alternate ``--repeats`` times (`cnns.bench.rates.in_turn`):
the best run of each counts, and as the ratio the median of the repeats' ratios of adjacent runs
(`cnns.bench.results.Side`); each side's fractions of the measured matmul peak (training FLOPs = 3 x forward)
and of the roofline (`cnns.bench.roofline`) beside them. An ``inference-backends`` entry's inference_embedded.py
command line is resolved as that script resolves it, and ``python -m cnns.bench.backends '<json>'`` measures
its model once per repeat instead (its artefacts kept in ``<output-dir>/backend-cache``). An entry whose device
this machine lacks is skipped with one line; ``{cifar10}`` in a command is a CIFAR-10-format folder of drawn
shapes written once. Results go to the screen and to ``<output-dir>/<spec>-<time>/results.{csv,json}``, beside
each run's folder and output.
"""

from __future__ import annotations

import csv
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from cnns.bench import roofline
from cnns.bench.rates import DeviceRates, forward_flops, in_turn
from cnns.bench.results import (PLAIN_SIDES, Result, entry_failed, print_tables, set_peak_fractions,
                                set_roofline_fractions, write_results)
from cnns.bench.benchmark_file import (BACKENDS_KIND, COMMAND_KIND, DEFAULT_BACKENDS, BackendsSpec, Entry, load_spec,
                              select)
from cnns.errors import ConfigError
from cnns.models import ModelSpec
from cnns.parallel.world import usable_cores
from cnns.precision import cpu_half_is_emulated
from cnns.safe_writes import write_atomically
from cnns.runfolder.log import RunLog

SCRIPTS = {"train.py": "train", "validation.py": "validate", "inference_embedded.py": "infer"}
# The scripts each kind of entry runs (an inference-backends entry: the model inference_embedded.py compiles).
KIND_SCRIPTS = {COMMAND_KIND: ("train.py", "validation.py"), BACKENDS_KIND: ("inference_embedded.py",)}
# The file of a run folder holding a mode's measured intervals (an img_per_sec column), both loops alike.
MEASUREMENTS = {"train": "training.csv", "infer": "validation.csv"}
CIFAR_IMAGES = 10_000
# validation.py with generated/synthetic data evaluates at most this many batches per pass
INFERENCE_BATCHES_PER_PASS = 20


def mean_dropping_first(values: list[float]) -> float | None:
    """Graphcore's rule: the first interval includes warm-up, so average the others (or the only one)."""
    if not values:
        return None
    rest = values[1:] or values
    return sum(rest) / len(rest)


def recorded_rates(path: Path) -> list[float]:
    """The ``img_per_sec`` column of a run folder's training.csv or validation.csv, in order."""
    with open(path, newline="") as f:
        return [float(row["img_per_sec"]) for row in csv.DictReader(f)]


# --- planning one entry

@dataclass
class Plan:
    """An entry resolved: the cnns command to run and the plain loop's specification."""

    argv: list[str]
    script: str
    mode: str  # "train" | "infer"
    model_spec: ModelSpec
    model_label: str
    data: str
    batch_size: int
    grad_accum: int
    baseline: dict[str, Any]
    activation_dtype: torch.dtype = torch.bfloat16  # what both loops compute in (the roofline's bytes)
    device: str = "cpu"  # where both loops run
    baseline_modes: tuple[str, ...] = ("eager",)  # the plain loop's runs beside the command (spec.BASELINE_MODES)

    def baseline_for(self, mode: str, folder: Path | None = None) -> dict[str, Any]:
        """The plain loop's BaselineSpec fields for one of its modes (eager or compiled), writing into `folder`."""
        return {**self.baseline, "compile": mode == "compiled", "log_dir": str(folder) if folder else None}


def plain_loop_workers(device: str) -> int:
    """The plain loop's DataLoader workers: 2 on a CPU that computes too; on a GPU machine the host only
    feeds, so as many as a user would give it there (up to 8, its cores allowing)."""
    return 2 if torch.device(device).type == "cpu" else max(2, min(8, usable_cores()))


PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the folder holding `cnns` (src/ in a checkout)


def subprocess_env() -> dict[str, str]:
    """This environment, the package first on PYTHONPATH and the output unbuffered (each line as it comes)."""
    path = os.pathsep.join(filter(None, [str(PACKAGE_ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": os.environ.get("PYTHONUNBUFFERED", "1")}


def command_argv(script: str, args: list[str], spec_dir: Path) -> list[str]:
    """The root script next to benchmarks.yml (or in the checkout), else `python -m cnns <command>`."""
    for folder in (spec_dir, PACKAGE_ROOT.parent):
        if (folder / script).is_file():
            return [sys.executable, str(folder / script), *args]
    return [sys.executable, "-m", "cnns", SCRIPTS[script], *args]


def entry_command(entry: Entry, substitutions: dict[str, str]) -> tuple[str, list[str]]:
    """(script, arguments) of an entry, placeholders filled and its device added."""
    words = shlex.split(entry.command.format(**substitutions))
    scripts = KIND_SCRIPTS[entry.kind]
    if not words or Path(words[0]).name not in scripts:
        raise ConfigError(f"benchmark {entry.name}: a {entry.kind} entry's command must start with "
                          f"{' or '.join(scripts)}")
    script, args = Path(words[0]).name, words[1:]
    if "--device" in args or "--select-ipus" in args or "--select-ipu" in args:
        raise ConfigError(f"benchmark {entry.name}: say where it runs with the entry's device: key, "
                          f"not on its command line")
    return script, args + ["--device", entry.device]


def plan_entry(entry: Entry, script: str, args: list[str], options: dict[str, Any]) -> Plan:
    """A command entry's plan from its command line (`entry_command`) and the options that command line
    resolves to (parsed by the caller, as the script would parse it)."""
    from cnns.config import RunConfig
    from cnns.data.formats import CIFAR_10_BINARY, formats_of
    from cnns.data.formats.cifar import CifarBinary

    mode = "train" if script == "train.py" else "infer"
    cfg = RunConfig.from_options(options)
    if cfg.data.source in ("synthetic", "generated"):
        data = cfg.data.source
    elif all(isinstance(f, CifarBinary) and f.records == CIFAR_10_BINARY.records for f in formats_of(options["dataset"])):
        data = "cifar"  # the plain loop reads CIFAR-10's binary records (`cnns.bench.baseline`), the built-in set's too
    else:
        raise ConfigError(f"benchmark {entry.name}: the plain loop knows synthetic, generated and CIFAR-10 data")
    m = cfg.model
    # The plain loop is one process: it runs the replicas' combined micro-batch (the same global
    # batch) and accumulates as many micro-batches per update.
    batch = cfg.train.micro_batch_size * (cfg.parallel.replicas if mode == "train" else 1)
    if mode == "train":
        if cfg.train.iterations is None:
            raise ConfigError(f"benchmark {entry.name}: training benchmarks need --iterations")
        iterations, repeat = cfg.train.iterations, 1
    else:
        if data == "cifar":
            raise ConfigError(f"benchmark {entry.name}: inference benchmarks use --synthetic-data or --generated-data")
        iterations = min(INFERENCE_BATCHES_PER_PASS, max(1, 50_000 // batch))
        repeat = int(options.get("repeat") or 1)
    baseline = {
        "mode": mode, "model": asdict(m), "batch_size": batch, "data": data,
        "grad_accum": cfg.train.gradient_accumulation_count if mode == "train" else 1,
        "iterations": iterations, "log_freq": max(1, min(cfg.train.log_freq, iterations)), "repeat": repeat,
        "data_dir": cfg.data.data_dir if data == "cifar" else None, "workers": plain_loop_workers(entry.device),
        "lr": cfg.optim.learning_rate, "momentum": cfg.optim.used("momentum") or 0.0,
        "weight_decay": cfg.optim.used("weight_decay") or 0.0, "device": entry.device,
    }
    label = f"{m.arch}-{m.size} {m.image_size}px" + (f" on {entry.device}" if entry.device != "cpu" else "")
    return Plan(args, script, mode, m, label, data, batch, baseline["grad_accum"], baseline,
                activation_dtype(cfg, torch.device(entry.device)),
                entry.device, tuple(entry.baseline_modes or ("eager",)))


def activation_dtype(cfg, device: torch.device) -> torch.dtype:
    """What both loops compute in: the compute type of the run's precision policy on `device`, float32 on a CPU
    that would only emulate it (the plain loop runs float32 there even where cnns was told to insist)."""
    compute = cfg.precision.policy(device).compute_dtype
    emulated = compute != torch.float32 and cpu_half_is_emulated(device, compute)
    return torch.float32 if emulated else compute


@dataclass
class BackendsPlan:
    """An inference-backends entry resolved: the JSON for `cnns.bench.backends` (its BackendsSpec) and the model."""

    spec: dict[str, Any]
    argv: list[str]
    model_label: str
    batch_size: int
    script: str = "inference_embedded.py"
    device: str = "cpu"


def plan_backends(entry: Entry, args: list[str], options: dict[str, Any], cache_dir: Path) -> BackendsPlan:
    """An inference-backends entry's plan from its inference_embedded.py arguments and the options they resolve
    to: the backends choose the precision (float32, or bfloat16 for a -bf16 one) and run on the CPU."""
    from cnns.config import RunConfig

    if "--precision" in args:
        raise ConfigError(f"benchmark {entry.name}: a backend's name says its precision (eager, eager-bf16, ...), "
                          f"not --precision")
    try:
        spec = BackendsSpec(options, **entry.settings, cache_dir=str(cache_dir))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"benchmark {entry.name}: {exc}") from None
    m, batch = RunConfig.from_options(options).model, int(options["micro_batch_size"])
    return BackendsPlan(asdict(spec), args, f"{m.arch}-{m.size} {m.image_size}px", batch)


# --- running one entry

def run_child(argv: list[str], timeout: float, log_path: Path) -> str:
    """Run one benchmark process, its output kept in `log_path`; '' or why it failed, in one line."""
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=subprocess_env())
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout:.0f}s"
    write_atomically(log_path, out.stdout + ("\n--- stderr ---\n" + out.stderr if out.stderr else ""))
    if out.returncode != 0:
        tail = (out.stderr.strip().splitlines() or out.stdout.strip().splitlines() or ["(no output)"])[-1]
        return f"exit {out.returncode}: {tail[:300]}"
    return ""


def run_and_read(argv: list[str], timeout: float, log_path: Path, measurements: Path) -> tuple[float | None, str]:
    """One run of one loop: (the mean of its recorded images/s dropping the first interval, error or '')."""
    error = run_child(argv, timeout, log_path)
    if error:
        return None, error
    if not measurements.is_file():
        return None, f"it wrote no {measurements.name} in {measurements.parent}"
    try:
        value = mean_dropping_first(recorded_rates(measurements))
    except (KeyError, ValueError) as exc:
        return None, f"{measurements} has no img_per_sec column of numbers: {exc}"
    return (value, "") if value is not None else (None, f"{measurements} holds no rows")


PLAIN_LOOP = [sys.executable, "-m", "cnns.bench.baseline"]
BACKENDS_PROCESS = [sys.executable, "-m", "cnns.bench.backends"]


def run_side(plan: Plan | BackendsPlan, side: str, r: int, stem: Path, timeout: float,
             spec_dir: Path) -> tuple[Any, str]:
    """One run of one side into `stem` (its run folder, or its JSON file), its output in `stem`.log: (images/s,
    or a backends run's rows by backend, or None; why not, or ''). A backends process exits 1 when a backend
    failed but still writes the others' rows, so its JSON is read whatever its exit status."""
    log_path = stem.with_name(stem.name + ".log")
    if isinstance(plan, BackendsPlan):
        result_path = stem.with_name(stem.name + ".json")
        result_path.unlink(missing_ok=True)
        order = in_turn(plan.spec["backends"], r)
        error = run_child([*BACKENDS_PROCESS, json.dumps({**plan.spec, "backends": order,
                                                          "result_path": str(result_path)})], timeout, log_path)
        try:
            return {row["backend"]: row for row in json.loads(result_path.read_text())["results"]}, ""
        except (OSError, ValueError, KeyError):
            return None, error or "no results written"
    stem.mkdir(parents=True, exist_ok=True)
    if side == "cnns":
        argv = command_argv(plan.script, [*plan.argv, "--logs-path", str(stem)], spec_dir)
    else:
        mode = next(m for m, name in PLAIN_SIDES.items() if name == side)
        argv = [*PLAIN_LOOP, json.dumps(plan.baseline_for(mode, stem))]
    return run_and_read(argv, timeout, log_path, stem / MEASUREMENTS[plan.mode])


def new_result(entry: Entry, plan: Plan | BackendsPlan, with_baseline: bool) -> tuple[Result, list[str]]:
    """The entry's empty Result and its sides: cnns and the plain loop's modes, or the one backends process."""
    if isinstance(plan, BackendsPlan):
        command = shlex.join([plan.script, *plan.argv]) + f" (backends: {', '.join(plan.spec['backends'])})"
        return Result(entry.name, command, model=plan.model_label, mode="infer", data="synthetic uint8",
                      batch_size=plan.batch_size, kind=BACKENDS_KIND), ["backends"]
    modes = list(plan.baseline_modes) if with_baseline and entry.baseline else []
    result = Result(entry.name, shlex.join([plan.script, *plan.argv]), model=plan.model_label, mode=plan.mode,
                    data=plan.data, batch_size=plan.batch_size, grad_accum=plan.grad_accum, device=plan.device,
                    baseline_command=" ; ".join(shlex.join([*PLAIN_LOOP[1:], json.dumps(plan.baseline_for(mode))])
                                                for mode in modes))
    sides = ["cnns", *(PLAIN_SIDES[mode] for mode in modes)]
    for name in sides:
        result.side(name)
    return result, sides


def run_entry(entry: Entry, plan: Plan | BackendsPlan, spec_dir: Path, repeats: int, with_baseline: bool,
              folder: Path, log: RunLog | None = None, bar=None) -> Result:
    """Every side of one entry, `repeats` times in turns (`in_turn`), each run's folder and output under `folder`;
    `bar` (a terminal's progress bar) advances by one per run. The one runner of both kinds of entry."""
    log = log or RunLog(None)
    result, sides = new_result(entry, plan, with_baseline)
    backends = isinstance(plan, BackendsPlan)
    runs: list[dict[str, Any]] = []
    for r in range(repeats):
        runs.append({})
        for side in in_turn(sides, r):  # alternate which side goes first
            order = f" ({', '.join(in_turn(plan.spec['backends'], r))})" if backends else ""
            log.print(f"  [{entry.name}] {side} run {r + 1}/{repeats}{order} ...")
            value, error = run_side(plan, side, r, folder / f"{entry.name}-{side}-{r + 1}", entry.timeout, spec_dir)
            if bar is not None:
                bar.update(1)
            if value is None:
                result.add_error(f"{f'run {r + 1}' if backends else side}: {error}")
                continue
            runs[-1][side] = value
            rates = [(row["label"], row.get("images_per_sec")) for row in value.values()] if backends else None
            for label, rate in rates or [(side, value)]:
                if rate:
                    log.print(f"  [{entry.name}] {label}: {rate:.2f} images/s")
    if backends:
        result.backends = combine_backend_runs(list(plan.spec["backends"]), [run["backends"] for run in runs if run])
    else:
        record_runs(result, plan, runs)
    return result


def record_runs(result: Result, plan: Plan, runs: list[dict[str, float]]) -> None:
    """Each side's runs, and cnns over each plain loop in every repeat in which both ran (adjacent in time)."""
    for run in runs:
        for side, value in run.items():
            result.sides[side].runs.append(value)
            if side != "cnns" and "cnns" in run and value:
                result.sides[side].pair_ratios.append(run["cnns"] / value)
    try:
        result.flops_per_image = forward_flops(plan.model_spec) * (3.0 if plan.mode == "train" else 1.0)
    except Exception as exc:  # FLOP counting is a report, never a reason to lose the measurement
        result.add_error(f"flop count failed: {exc}")


def combine_backend_runs(backends: list[str], runs: list[dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per backend over the repeats: the fields of its fastest run, its images/s per repeat ("runs"),
    and as ratio_vs_eager the median of its per-repeat ratios to eager float32 in the same process."""
    rows = []
    for backend in backends:
        candidates = [run[backend] for run in runs if backend in run]
        if not candidates:
            continue
        measured = [c for c in candidates if c.get("images_per_sec")]
        row = dict(max(measured, key=lambda c: c["images_per_sec"]) if measured else candidates[-1])
        row["runs"] = [c["images_per_sec"] for c in measured]
        row["ratios"] = [c["ratio_vs_eager"] for c in measured if c.get("ratio_vs_eager")]
        row["ratio_vs_eager"] = statistics.median(row["ratios"]) if row["ratios"] else None
        made = [c for c in candidates if c.get("compile_s") is not None and not c.get("cached")]
        if made:  # the time it took when this invocation made the artefact
            row["compile_s"], row["cached"] = made[0]["compile_s"], False
        errors = list(dict.fromkeys(c["error"] for c in candidates if c.get("error")))
        row["error"] = "; ".join(errors) or None
        rows.append(row)
    return rows


def roofline_images_per_sec(plan: Plan, peak_gflops: float, bandwidth_gbs: float) -> float:
    seconds = roofline.update_seconds(plan.model_spec, plan.batch_size, plan.grad_accum, plan.mode == "train",
                                      plan.activation_dtype, peak_gflops, bandwidth_gbs)
    return plan.batch_size * plan.grad_accum / seconds


# --- the command

def ensure_cifar10(folder: Path, images: int = CIFAR_IMAGES) -> Path:
    """A CIFAR-10-format folder of drawn shapes (made once; reused while its files are complete)."""
    from cnns.data.drawn_shapes import draw_shapes
    from cnns.data.cifar_records import write_cifar10
    from cnns.data.formats import CIFAR_10_BINARY

    marker = folder / f".complete-{images}"
    if marker.is_file() and CIFAR_10_BINARY.recognise(folder):
        return folder
    pictures, labels = draw_shapes(images + images // 5, seed=2024)
    write_cifar10(folder, (pictures[:images], labels[:images]), (pictures[images:], labels[images:]))
    write_atomically(marker, "ok\n")
    return folder


class BenchmarkSuite:
    """The chosen entries of a benchmark spec, and where this invocation writes."""

    def __init__(self, spec: str | Path, names: list[str] | None = None, output_dir: str | Path = "benchmark-results",
                 data_dir: str | Path | None = None):
        self.spec_path = Path(spec)
        entries, self.document = load_spec(self.spec_path)
        chosen = select(entries, names)
        # Entries whose device this machine lacks (a CUDA entry without a GPU): one line each, nothing else.
        self.skipped = {e.name: why for e in chosen if (why := e.missing_device())}
        self.entries = [e for e in chosen if e.name not in self.skipped]
        if chosen and not self.entries:
            raise ConfigError("nothing to run here: " + "; ".join(f"benchmark {name} {why}"
                                                                   for name, why in self.skipped.items()))
        self.output_dir = Path(output_dir)
        self.data_dir = Path(data_dir) if data_dir else None
        self.stamp = time.strftime("%Y%m%d-%H%M%S")
        self.run_dir = self.output_dir / f"{self.spec_path.stem}-{self.stamp}"
        self._commands: dict[str, tuple[str, list[str]]] | None = None

    def listing(self) -> list[str]:
        def where(e: Entry) -> str:
            if e.kind == BACKENDS_KIND:
                return f" [backends: {', '.join(e.settings.get('backends') or DEFAULT_BACKENDS)}]"
            return f" [{e.device}]" if e.device != "cpu" else ""

        return ([f"{e.name}: {e.command}{where(e)}" for e in self.entries]
                + [f"{name}: skipped, {why}" for name, why in self.skipped.items()])

    def entry_commands(self) -> dict[str, tuple[str, list[str]]]:
        """(script, arguments) of every entry by name, for the caller to parse; writes the generated CIFAR-10
        folder that commands name as ``{cifar10}`` first (once)."""
        if self._commands is not None:
            return self._commands
        substitutions: dict[str, str] = {}
        if any("{cifar10}" in e.command for e in self.entries):
            images = int(self.document.get("cifar10_images", CIFAR_IMAGES))
            folder = self.data_dir or self.output_dir / "data" / f"cifar10-{images}"
            substitutions["cifar10"] = str(ensure_cifar10(folder, images))
        self._commands = {e.name: entry_command(e, substitutions) for e in self.entries}
        return self._commands

    def run(self, options: dict[str, dict[str, Any]], repeats: int | None = None, baseline: bool = True,
            keep_runs: bool = False) -> int:
        """Run every entry (`options`: each entry's resolved options, by name); print the tables and write the
        results. 1 when an entry failed."""
        repeats = repeats or int((self.document.get("defaults") or {}).get("repeats", 1))
        if repeats < 1:
            raise ConfigError(f"--repeats must be at least 1, got {repeats}")
        runs = self.run_dir / "runs"
        runs.mkdir(parents=True, exist_ok=True)
        commands = self.entry_commands()
        cache = self.output_dir / "backend-cache"  # inference-backends artefacts, kept across invocations
        plans = [(e, plan_backends(e, commands[e.name][1], options[e.name], cache) if e.kind == BACKENDS_KIND
                  else plan_entry(e, *commands[e.name], options[e.name])) for e in self.entries]  # errors first
        for name, why in self.skipped.items():
            print(f"{name}: skipped, {why}", flush=True)
        machine = {name: DeviceRates(torch.device(name)).measure()
                   for name in sorted({"cpu"} | {plan.device for _, plan in plans})}
        for rates in machine.values():
            print(rates.describe(), flush=True)
        results, log = [], RunLog(None)
        count = sum(repeats * len(new_result(entry, plan, baseline)[1]) for entry, plan in plans)
        with log.progress(count, description="benchmark", unit="run") as bar:
            for entry, plan in plans:
                log.print(f"{entry.name}: {entry.command}")
                results.append(run_entry(entry, plan, self.spec_path.resolve().parent, repeats, baseline, runs, log,
                                         bar))
        for rates in machine.values():  # again at the end, the best of both kept
            rates.measure()
        for result, (_, plan) in zip(results, plans):
            rates = machine[plan.device]
            set_peak_fractions(result, rates.peak)
            if isinstance(plan, Plan):
                try:
                    set_roofline_fractions(result, roofline_images_per_sec(plan, rates.peak, rates.bandwidth))
                except Exception as exc:  # a report, never a reason to lose the measurement
                    result.add_error(f"roofline failed: {exc}")
        if not keep_runs:  # the runs' checkpoints (up to 100 MB per entry); their measurements and logs stay
            for checkpoint in runs.rglob("*.pt"):
                checkpoint.unlink()
        cpu = machine["cpu"]
        meta = {"spec": str(self.spec_path), "time": self.stamp, "peak_matmul_gflops": cpu.peak,
                "matmul_gflops": cpu.rates, "stream_bandwidth_gbs": cpu.bandwidth,
                "devices": {name: {"peak_matmul_gflops": r.peak, "matmul_gflops": r.rates,
                                   "stream_bandwidth_gbs": r.bandwidth} for name, r in machine.items()},
                "skipped": self.skipped,
                "native_bfloat16": not cpu_half_is_emulated(torch.device("cpu"), torch.bfloat16),
                "repeats": repeats, "threads": torch.get_num_threads(), "torch": torch.__version__}
        csv_path, json_path = write_results(results, meta, self.run_dir, "results")
        print_tables(results, {name: r.peak for name, r in machine.items()},
                     {name: r.bandwidth for name, r in machine.items()})
        print(f"results: {csv_path} {json_path}")
        return 1 if any(entry_failed(r) for r in results) else 0
