"""cnns profile: where a training update's time goes, for cnns and the plain loop side by side.

Each side runs its command with torch.profiler (train.py's ``--profile``; the plain loop's ``profile_dir``) for
a few updates after ``warmup`` ones, and the Chrome trace it writes is read back into the FunctionEvents that
torch.profiler's ``events()`` holds (`function_events`): torch nests the operators of each thread and gives
each its own time (``self_cpu_time_total``), and the GPU's kernels are events of ``device_type`` CUDA.

Both loops mark their updates, the data they wait for and their optimiser steps (`cnns.profiling`), and the
fused kernels mark their passes. On a CPU each operator's own time in an update after the warm-up is put in
one family (`FAMILIES`): its mark's first (an addition inside the optimiser is the optimiser's), else its own
name's (`_NAMES`), else its nearest named ancestor's (an ``empty`` inside a convolution is the convolution's);
the update's time in no operator is *other*. ATen computes a convolution's input and weight gradients in one
operator: its time is split between them in the proportion of the two halves of each of the model's
convolutions timed alone (`convolution_backward_split`; the stem's input gradient, which neither loop
computes, left out). A CUDA entry is profiled by its GPU kernels instead (`cnns.bench.gpuprofile`).
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch.autograd import DeviceType
from torch.autograd.profiler_util import EventList, FunctionEvent

from cnns import profiling
from cnns.bench.rates import best_seconds
from cnns.errors import CnnsError

FAMILIES = ("convolution forward", "convolution input-gradient", "convolution weight-gradient",
            "normalisation forward", "normalisation backward", "activations", "additions", "optimiser", "data",
            "other")
CONV_BACKWARD = "convolution backward"  # split into input- and weight-gradient at the end
MARKS = {profiling.DATA: "data", profiling.OPTIMISER: "optimiser", profiling.NORM_FORWARD: "normalisation forward",
         profiling.NORM_BACKWARD: "normalisation backward"}

# Substrings of operator names (lower case), tried in order: backward names before forward ones.
_NAMES = (
    ("convolution_backward", CONV_BACKWARD), ("convolutionbackward", CONV_BACKWARD),
    ("depthwiseconvbackward", CONV_BACKWARD),  # cnns.engine.kernel_choice's routed depthwise backward
    ("_norm_backward", "normalisation backward"), ("normbackward", "normalisation backward"),
    ("threshold_backward", "activations"), ("relubackward", "activations"), ("silu_backward", "activations"),
    ("silubackward", "activations"), ("sigmoid_backward", "activations"), ("sigmoidbackward", "activations"),
    ("addbackward", "additions"),
    ("conv", "convolution forward"),
    ("batch_norm", "normalisation forward"), ("group_norm", "normalisation forward"),
    ("layer_norm", "normalisation forward"),
    ("relu", "activations"), ("clamp_min", "activations"), ("silu", "activations"), ("sigmoid", "activations"),
    ("aten::add", "additions"),
)

# Chrome-trace categories: what runs on the host (operators, marks, kernel launches), what on the GPU.
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
HOST_CATEGORIES = ("cpu_op", "user_annotation", *LAUNCH_CATEGORIES)
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def read_trace(folder: Path) -> list[dict[str, Any]]:
    """The events of the newest Chrome-format trace a torch.profiler wrote into `folder`."""
    traces = sorted(Path(folder).glob("*.pt.trace.json"))
    if not traces:
        raise FileNotFoundError(f"no profiler trace in {folder}")
    return json.loads(traces[-1].read_text())["traceEvents"]


def function_events(trace: list[dict[str, Any]]) -> EventList:
    """A trace's events as torch.profiler's FunctionEvents, nested by torch (``cpu_parent``, ``cpu_children``,
    hence ``self_cpu_time_total``) as ``prof.events()`` holds them. A GPU event and the host call that launched
    it (a runtime or driver call, else the start of the ``ac2g`` flow between them, an instant) share
    ``linked_correlation_id``."""
    def event(index: int, e: dict[str, Any], category: str, end: float, correlation: int) -> FunctionEvent:
        on_device = category in DEVICE_CATEGORIES
        made = FunctionEvent(index, e["name"], f"{e.get('pid')}/{e.get('tid')}", e["ts"], end,
                             device_type=DeviceType.CUDA if on_device else DeviceType.CPU,
                             use_device="cuda" if on_device else None)
        # Set, not passed: the constructor's keywords for these came late (torch 2.11's has neither
        # linked_correlation_id nor, before it, is_user_annotation), the attributes are read the same way.
        made.linked_correlation_id = correlation
        made.is_user_annotation = category == "user_annotation"
        return made

    events, launched = EventList(), set()
    for index, e in enumerate(trace):
        category = str(e.get("cat", "")).lower()
        if e.get("ph") == "X" and category in HOST_CATEGORIES + DEVICE_CATEGORIES:
            linked = category in LAUNCH_CATEGORIES + DEVICE_CATEGORIES
            correlation = (e.get("args") or {}).get("correlation", 0) if linked else 0
            launched |= {correlation} if category in LAUNCH_CATEGORIES else set()
            events.append(event(index, e, category, e["ts"] + e["dur"], correlation))
    for index, e in enumerate(trace):
        if e.get("ph") == "s" and e.get("cat") == "ac2g" and e.get("id") not in launched:
            events.append(event(index, e, "cpu_op", e["ts"], e["id"]))
    events._build_tree()  # what torch.profiler does for prof.events()
    return events


def update_marks(events: EventList, skip: int, where: str = "the trace") -> list[FunctionEvent]:
    """Every update's mark in time order, the first ``skip`` (the warm-up, left out by the caller) included."""
    updates = sorted((e for e in events if e.name == profiling.UPDATE), key=lambda e: e.time_range.start)
    if len(updates) <= skip:
        raise CnnsError(f"{where} holds {len(updates)} update(s); {skip} warm-up update(s) and at least one more "
                        f"are needed")
    return updates


def family_of_name(name: str) -> str | None:
    lowered = name.lower()
    return next((family for part, family in _NAMES if part in lowered), None)


def _families(event: FunctionEvent, mark: str | None, inherited: str) -> Iterator[tuple[FunctionEvent, str]]:
    """(operator, family) of everything below `event`: mark, else own name, else the parent's family."""
    for child in event.cpu_children:
        child_mark = MARKS.get(child.name) or mark
        family = child_mark or family_of_name(child.name) or inherited
        yield child, family
        yield from _families(child, child_mark, family)


def family_times(trace: list[dict[str, Any]], skip: int = 1) -> tuple[dict[str, float], float, int]:
    """Microseconds by family summed over the updates after the first ``skip``, their wall time and count."""
    updates = update_marks(function_events(trace), skip)[skip:]
    totals: dict[str, float] = defaultdict(float)
    for update in updates:
        totals["other"] += update.self_cpu_time_total  # time in no operator: Python, the loop
        for event, family in _families(update, None, "other"):
            totals[family] += event.self_cpu_time_total
    return dict(totals), sum(u.cpu_time_total for u in updates), len(updates)


def split_convolution_backward(totals_us: dict[str, float], input_share: float) -> dict[str, float]:
    out = dict.fromkeys(FAMILIES, 0.0)
    for family, us in totals_us.items():
        if family == CONV_BACKWARD:
            out["convolution input-gradient"] += us * input_share
            out["convolution weight-gradient"] += us * (1 - input_share)
        else:
            out[family] += us
    return out


@dataclass
class Breakdown:
    """Milliseconds per update, means over ``updates`` updates: by family (on a CPU the convolution backward
    already split), the update's wall time and, on a GPU, the time the GPU was busy within it."""

    ms: dict[str, float] = field(default_factory=dict)
    update_ms: float = 0.0
    busy_ms: float = 0.0
    updates: int = 0

    @property
    def gaps_ms(self) -> float:
        return self.update_ms - self.busy_ms


def breakdown_of_trace(folder: Path, input_share: float, skip: int = 1) -> Breakdown:
    totals, wall, count = family_times(read_trace(folder), skip)
    split = split_convolution_backward(totals, input_share)
    return Breakdown({f: us / count / 1e3 for f, us in split.items()}, wall / count / 1e3, updates=count)


# --- the two halves of the convolutions' backward

def model_convolutions(model_spec, batch_size: int) -> list[tuple]:
    """The model's convolutions as one training forward meets them (shapes read on the meta device): (input
    shape, weight shape, stride, padding, dilation, groups, whether the input needs its gradient)."""
    from cnns.models import build_model

    with torch.device("meta"):
        model = build_model(model_spec)
    found: list[tuple] = []

    def hook(module, inputs, _output):
        found.append((tuple(inputs[0].shape), tuple(module.weight.shape), tuple(module.stride),
                      tuple(module.padding), tuple(module.dilation), module.groups, inputs[0].requires_grad))

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    model.train()(torch.empty(batch_size, 3, model_spec.image_size, model_spec.image_size, device="meta"))
    for handle in handles:
        handle.remove()
    return found


def _backward_half_seconds(conv: tuple, dtype: torch.dtype, mask: list[bool]) -> float:
    input_shape, weight_shape, stride, padding, dilation, groups, _ = conv
    x = torch.randn(input_shape, dtype=dtype).contiguous(memory_format=torch.channels_last)
    weight = torch.randn(weight_shape, dtype=dtype).contiguous(memory_format=torch.channels_last)
    grad = torch.randn_like(torch.nn.functional.conv2d(x, weight, None, stride, padding, dilation, groups))
    return best_seconds(lambda: torch.ops.aten.convolution_backward(
        grad, x, weight, None, stride, padding, dilation, False, [0, 0], groups, mask))


def convolution_backward_split(model_spec, batch_size: int, dtype: torch.dtype) -> float:
    """The input gradients' share of the time of the model's convolution backward passes."""
    convs, times = model_convolutions(model_spec, batch_size), {}
    for conv in dict.fromkeys(convs):  # each shape timed once
        times[conv] = (_backward_half_seconds(conv, dtype, [True, False, False]) if conv[-1] else 0.0,
                       _backward_half_seconds(conv, dtype, [False, True, False]))
    input_s, weight_s = sum(times[c][0] for c in convs), sum(times[c][1] for c in convs)
    return input_s / (input_s + weight_s)


# --- running the sides (on a CPU and on a GPU)

def profile_arguments(updates: int, folder: Path, warmup: int = 1) -> list[str]:
    """What train.py's command line gets appended (its last values win): ``warmup`` updates, then ``updates``,
    traced into the entry's ``folder`` where `profile_sides` reads it, its run folder beside the trace."""
    return ["--iterations", str(updates + warmup), "--log-freq", "1", "--profile", "--profile-dir",
            str(folder / "cnns"), "--logs-path", str(folder / "cnns-run")]


def run_profiled(argv: list[str], timeout: float, log_path: Path) -> None:
    """One profiled side; a failure or a timeout is one line (CnnsError) naming the log."""
    from cnns.bench.runner import run_child

    error = run_child(argv, timeout, log_path)
    if error:
        raise CnnsError(f"{argv[1]}: {error} (log: {log_path})")


def profile_sides(plan, spec_dir: Path, folder: Path, timeout: float, run: Callable = run_profiled,
                  eager: bool = False) -> dict[str, Path]:
    """Run each side of a planned training entry (`cnns.bench.runner.Plan`, whose command line carries
    `profile_arguments`): cnns, with ``eager`` cnns again without compilation, and the plain loop. Each side's
    trace folder by name."""
    from cnns.bench.runner import command_argv

    folder.mkdir(parents=True, exist_ok=True)
    cnns = command_argv(plan.script, plan.argv, spec_dir)
    sides = {"cnns": cnns}
    if eager:  # the last --profile-dir, --logs-path and --compile/--no-compile win
        sides["cnns eager"] = cnns + ["--no-compile", "--profile-dir", str(folder / "cnns-eager"),
                                      "--logs-path", str(folder / "cnns-eager-run")]
    plain = dict(plan.baseline, profile_dir=str(folder / "plain"))
    sides["plain"] = [sys.executable, "-m", "cnns.bench.baseline", json.dumps(plain)]
    for side, argv in sides.items():
        run(argv, timeout, folder / f"{side.replace(' ', '-')}.log")
    return {side: folder / side.replace(" ", "-") for side in sides}


@dataclass
class ProfileReport:
    name: str
    cnns: Breakdown
    plain: Breakdown
    input_share: float


def profile_entry(name: str, plan, spec_dir: Path, folder: Path, timeout: float,
                  run: Callable = run_profiled, warmup: int = 1) -> ProfileReport:
    """Both sides of one planned CPU training entry, profiled into ``folder``: their operators by family."""
    traces = profile_sides(plan, spec_dir, folder, timeout, run)
    share = convolution_backward_split(plan.model_spec, plan.batch_size, plan.activation_dtype)
    return ProfileReport(name, breakdown_of_trace(traces["cnns"], share, warmup),
                         breakdown_of_trace(traces["plain"], share, warmup), share)


def format_report(report: ProfileReport) -> str:
    cnns, plain = report.cnns, report.plain
    lines = [f"{report.name}: milliseconds per update (mean of {cnns.updates} updates after the first)",
             f"{'family':<28} {'cnns ms':>9} {'%':>6} {'plain ms':>9} {'%':>6}"]
    for family in FAMILIES:
        a, b = cnns.ms.get(family, 0.0), plain.ms.get(family, 0.0)
        lines.append(f"{family:<28} {a:9.1f} {100 * a / cnns.update_ms:5.1f}% {b:9.1f} {100 * b / plain.update_ms:5.1f}%")
    lines.append(f"{'update':<28} {cnns.update_ms:9.1f} {100.0:5.1f}% {plain.update_ms:9.1f} {100.0:5.1f}%")
    lines.append(f"convolution backward split {100 * report.input_share:.0f}% input-gradient / "
                 f"{100 * (1 - report.input_share):.0f}% weight-gradient (each layer's two halves timed alone)")
    return "\n".join(lines)
