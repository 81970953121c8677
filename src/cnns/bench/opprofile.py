"""cnns profile: where a training update's time goes, for cnns and the plain loop side by side.

For a training entry of benchmarks.yml, each side runs its command with a profiler (train.py's ``--profile``;
the plain loop's ``profile_dir``) for a few updates, and each operator's own time (its duration less its
children's) in every update after the first is put in one family:

    convolution forward | convolution input-gradient | convolution weight-gradient | normalisation forward |
    normalisation backward | activations | additions | optimiser | data | other

Both loops mark their updates, the data they wait for and their optimiser steps (`cnns.profiling`), and
those marks decide first: an addition inside the optimiser is the optimiser's. Otherwise an operator's
family is its own name's (batch norm, group norm, ReLU, SiLU, ``add``...), else its nearest named
ancestor's (an ``empty`` inside a convolution is the convolution's). The fused kernels mark their passes
as normalisation forward and backward (the activation and residual addition they include are counted there).

ATen computes a convolution's input and weight gradients in one operator; its time is split between
them in the proportion of the two halves of each of the model's convolutions timed alone
(`convolution_backward_split`), with the stem's input gradient, which neither loop computes, left out.

A CUDA entry is profiled by its GPU kernels instead (`cnns.bench.gpuprofile`): the same marks, each kernel in
the update that launched it, its family by its name, and each family against its roofline on the GPU.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from cnns import profiling
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
    ("depthwiseconvbackward", CONV_BACKWARD),  # cnns.engine.wrappers' routed depthwise backward
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


def read_trace(folder: Path) -> list[dict[str, Any]]:
    """The events of the newest Chrome-format trace a torch.profiler wrote into `folder` (both loops' traces,
    on a CPU and on a GPU)."""
    traces = sorted(Path(folder).glob("*.pt.trace.json"))
    if not traces:
        raise FileNotFoundError(f"no profiler trace in {folder}")
    return json.loads(traces[-1].read_text())["traceEvents"]


def family_of_name(name: str) -> str | None:
    lowered = name.lower()
    for part, family in _NAMES:
        if part in lowered:
            return family
    return None


@dataclass
class Breakdown:
    """Milliseconds per update by family (the convolution backward already split), over ``updates`` updates."""

    ms: dict[str, float] = field(default_factory=dict)
    update_ms: float = 0.0  # the wall time of an update, mean
    updates: int = 0


def family_times(events: list[dict[str, Any]], skip: int = 1) -> tuple[dict[str, float], float, int]:
    """Microseconds by family summed over the updates after the first ``skip``, their wall time and count."""
    spans = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation")]
    updates = sorted((e for e in spans if e["name"] == profiling.UPDATE), key=lambda e: e["ts"])[skip:]
    if not updates:
        raise ValueError(f"the trace holds no more than {skip} update(s)")
    totals: dict[str, float] = defaultdict(float)
    for update in updates:
        start, end, tid = update["ts"], update["ts"] + update["dur"], update["tid"]
        inside = [e for e in spans if e["tid"] == tid and start <= e["ts"] and e["ts"] + e["dur"] <= end
                  and e is not update]
        for family, us in _self_times(inside):
            totals[family] += us
    wall = sum(u["dur"] for u in updates)
    totals["other"] += max(0.0, wall - sum(totals.values()))  # time in no operator: Python, the loop
    return dict(totals), wall, len(updates)


def _self_times(events: list[dict[str, Any]]) -> Iterable[tuple[str, float]]:
    """(family, own time) of each event of one thread, nesting read from the time intervals."""
    events = sorted(events, key=lambda e: (e["ts"], -e["dur"]))
    stack: list[dict[str, Any]] = []  # open events, each with "family", "mark" and "children_us"
    finished: list[tuple[str, float]] = []

    def close(node):
        finished.append((node["family"], node["dur"] - node["children_us"]))

    for event in events:
        while stack and stack[-1]["end"] <= event["ts"]:
            close(stack.pop())
        parent = stack[-1] if stack else None
        if parent is not None:
            parent["children_us"] += event["dur"]
        mark = MARKS.get(event["name"]) or (parent["mark"] if parent else None)
        family = mark or family_of_name(event["name"]) or (parent["family"] if parent else "other")
        stack.append({"end": event["ts"] + event["dur"], "dur": event["dur"], "children_us": 0.0,
                      "family": family, "mark": mark})
    while stack:
        close(stack.pop())
    return finished


def split_convolution_backward(totals_us: dict[str, float], input_share: float) -> dict[str, float]:
    out = {f: 0.0 for f in FAMILIES}
    for family, us in totals_us.items():
        if family == CONV_BACKWARD:
            out["convolution input-gradient"] += us * input_share
            out["convolution weight-gradient"] += us * (1 - input_share)
        else:
            out[family] += us
    return out


def breakdown_of_trace(folder: Path, input_share: float, skip: int = 1) -> Breakdown:
    totals, wall, count = family_times(read_trace(folder), skip)
    split = split_convolution_backward(totals, input_share)
    return Breakdown({f: us / count / 1e3 for f, us in split.items()}, wall / count / 1e3, count)


# ------------------------------------------------------------------------------------------------
# the two halves of the convolutions' backward


@dataclass(frozen=True)
class _Conv:
    input_shape: tuple[int, ...]
    weight_shape: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    groups: int
    needs_input_grad: bool


def model_convolutions(model_spec, batch_size: int) -> list[_Conv]:
    """The model's convolutions as one training forward meets them (shapes read on the meta device)."""
    from cnns.models import build_model

    with torch.device("meta"):
        model = build_model(model_spec)
    found: list[_Conv] = []

    def hook(module, inputs, _output):
        x = inputs[0]
        found.append(_Conv(tuple(x.shape), tuple(module.weight.shape), tuple(module.stride), tuple(module.padding),
                           tuple(module.dilation), module.groups, x.requires_grad))

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    size = model_spec.image_size
    model.train()(torch.empty(batch_size, 3, size, size, device="meta"))
    for handle in handles:
        handle.remove()
    return found


def _backward_half_seconds(conv: _Conv, dtype: torch.dtype, mask: tuple[bool, bool, bool], repeats: int = 3) -> float:
    x = torch.randn(conv.input_shape, dtype=dtype).contiguous(memory_format=torch.channels_last)
    weight = torch.randn(conv.weight_shape, dtype=dtype).contiguous(memory_format=torch.channels_last)
    out = torch.nn.functional.conv2d(x, weight, None, conv.stride, conv.padding, conv.dilation, conv.groups)
    grad = torch.randn_like(out)

    def run():
        torch.ops.aten.convolution_backward(grad, x, weight, None, conv.stride, conv.padding, conv.dilation, False,
                                            [0, 0], conv.groups, list(mask))

    run()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def convolution_backward_split(model_spec, batch_size: int, dtype: torch.dtype) -> float:
    """The input gradients' share of the time of the model's convolution backward passes."""
    times = {}
    input_s = weight_s = 0.0
    for conv in model_convolutions(model_spec, batch_size):
        if conv not in times:
            times[conv] = (_backward_half_seconds(conv, dtype, (True, False, False)) if conv.needs_input_grad else 0.0,
                           _backward_half_seconds(conv, dtype, (False, True, False)))
        input_s += times[conv][0]
        weight_s += times[conv][1]
    return input_s / (input_s + weight_s)


# ------------------------------------------------------------------------------------------------
# running both sides


def profile_arguments(updates: int, folder: Path, warmup: int = 1) -> list[str]:
    """What train.py's command line gets appended (its last values win): ``warmup`` updates, then ``updates``,
    traced into the entry's ``folder`` where `profile_entry` reads it, its run folder beside the trace."""
    return ["--iterations", str(updates + warmup), "--log-freq", "1", "--profile", "--profile-dir",
            str(folder / "cnns"), "--logs-path", str(folder / "cnns-run")]


def run_profiled(argv: list[str], timeout: float, log_path: Path) -> None:
    """One profiled side; a failure or a timeout is one line (CnnsError) naming the log."""
    from cnns.bench.runner import run_child

    error = run_child(argv, timeout, log_path)
    if error:
        raise CnnsError(f"{argv[1]}: {error} (log: {log_path})")


@dataclass
class ProfileReport:
    name: str
    cnns: Breakdown
    plain: Breakdown
    input_share: float


def profile_entry(name: str, plan, spec_dir: Path, folder: Path, timeout: float,
                  run: Callable[[list[str], float, Path], None] = run_profiled, warmup: int = 1) -> ProfileReport:
    """Both sides of one planned CPU training entry (`cnns.bench.runner.Plan`, whose command line already carries
    `profile_arguments` with ``warmup``), profiled into ``folder``: their operators by family."""
    import sys

    from cnns.bench.runner import command_argv

    folder.mkdir(parents=True, exist_ok=True)
    run(command_argv(plan.script, plan.argv, spec_dir), timeout, folder / "cnns.log")
    baseline = dict(plan.baseline, profile_dir=str(folder / "plain"))
    run([sys.executable, "-m", "cnns.bench.baseline", json.dumps(baseline)], timeout, folder / "plain.log")
    share = convolution_backward_split(plan.model_spec, plan.batch_size, plan.activation_dtype)
    return ProfileReport(name, breakdown_of_trace(folder / "cnns", share, warmup),
                         breakdown_of_trace(folder / "plain", share, warmup), share)


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
