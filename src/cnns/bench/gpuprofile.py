"""cnns profile on a GPU: an update's GPU time by kernel family, against each family's roofline.

For a CUDA entry both loops record CUDA activity too, and the trace's kernels, copies and memsets are read as
FunctionEvents of ``device_type`` CUDA (`cnns.bench.opprofile.function_events`). Kernels run asynchronously:
one belongs to the update whose mark's span holds the host call that launched it, the one its correlation id
names (a runtime or driver call, else the ``ac2g`` flow's start), on any thread (autograd launches the
backward's kernels from its own); a kernel whose launch the trace lacks falls back on its own start, in the
update that began last before it. Kernels launched outside
every update (the loop's host synchronisation, the profiler's own) belong to none; the first ``skip`` updates
(compilation, CUDA-graph recording) are left out.

**Families.** A kernel launched inside the optimiser's or the data's mark is theirs; otherwise its family is
its name's (`KERNEL_NAMES`, first match wins; Inductor's ``triton_<kind>_fused_<aten ops>_<n>`` kernels by
their kind and ops, `_triton_family`): a kernel fusing a norm with its addition and ReLU is *normalisation
apply* (what fusion saved shows as the *add* and *activation* rows' absence). A family's time is the sum of its
kernels' durations (``self_device_time_total``; two streams' overlapping kernels both count). An update's
*wall* time runs from its start to the later of its host end and its last kernel's end (never past the next
update's start); *GPU busy* is the union of all GPU activity in that window, *launch gaps* the rest.

**Rooflines** (`family_rooflines`), per update, from `cnns.bench.roofline`'s operators at the GPU's measured
matmul rate (in the run's dtype) and stream bandwidth: the convolutions and the classifier's matmuls; the
norms' statistics (the activation-sized inputs their reductions must read) and apply passes (their minimal
bytes); activations, additions and the optimiser (their minimal bytes). Copies, data, other and launch gaps
have none. *norm + act + add* sums the four memory-bound families against roofline.py's minimal for their
operators together: a norm's input read once for both passes, what only fusion can reach.
"""

from __future__ import annotations

import bisect
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.autograd import DeviceType

from cnns import profiling
from cnns.bench import roofline
from cnns.bench.opprofile import (Breakdown, function_events, profile_sides, read_trace, run_profiled,
                                  update_marks)
from cnns.errors import CnnsError

CONVOLUTION = "convolution"
NORM_STATISTICS = "normalisation statistics"
NORM_APPLY = "normalisation apply"
ACTIVATION = "activation"
ADD = "add"
OPTIMISER = "optimiser"
COPIES = "copies"
DATA = "data"
OTHER = "other"
KERNEL_FAMILIES = (CONVOLUTION, NORM_STATISTICS, NORM_APPLY, ACTIVATION, ADD, OPTIMISER, COPIES, DATA, OTHER)
LAUNCH_GAPS = "launch gaps"
MEMORY_BOUND = (NORM_STATISTICS, NORM_APPLY, ACTIVATION, ADD)  # the "norm + act + add" row

MARKS = {profiling.OPTIMISER: OPTIMISER, profiling.DATA: DATA}

# Substrings (regular expressions) of lower-cased kernel names and their family, tried in order.
KERNEL_NAMES: tuple[tuple[str, str], ...] = (
    # Copies first: cuDNN's layout transposes carry "cudnn" in their names but compute nothing; memset-like
    # fills (zeroing gradients and accumulators) move bytes the model's arithmetic does not need either.
    (r"memcpy|memset", COPIES), (r"direct_copy|copy_kernel|catarraybatchedcopy", COPIES),
    (r"nchwtonhwc|nhwctonchw", COPIES), (r"fillfunctor|fill_kernel", COPIES),
    # The optimiser's multi-tensor kernels and the loss scaler's checks, wherever they are launched.
    (r"multi_tensor_apply|foreach|fused_sgd|fusedsgd|adam|non_finite_check_and_unscale|amp_update_scale",
     OPTIMISER),
    # Normalisation that reduces: batch norm's statistics and its backward's per-channel sums (ATen),
    # Welford reductions (var_mean), group norm's moments and parameter gradients, cuDNN's training
    # passes (a reduction and the normalisation in one persistent kernel: the reduction is what it cannot
    # avoid, so it counts here).
    (r"collect_statistics|batch_norm_backward_reduce|reduce_statistics|update_stats|welford", NORM_STATISTICS),
    (r"rowwisemoments|compute_?stats|computefusedparams|computeinternalgradients|gammabetabackward"
     r"|computebackwardfusedparams", NORM_STATISTICS),
    (r"bn_fw_tr|bn_bw|batchnorm_fwtr|batchnorm_bwtr", NORM_STATISTICS),
    # Normalisation's elementwise passes: batch norm's transform and backward_elemt, group norm's
    # elementwise lambdas, cuDNN's inference pass.
    (r"batch_?norm|group_?norm|layer_?norm|bn_fw_inf", NORM_APPLY),
    # Convolutions (cuDNN, its xmma/CUTLASS engines, ATen's depthwise kernels) and GEMMs (cuBLAS, cuBLASLt's
    # nvjet kernels: the classifier). Their names can carry an epilogue's "relu": tried before activations.
    (r"conv(?!ert)|cudnn|implicit_gemm|xmma|cutlass|dgrad|wgrad|fprop|winograd|gemm|gemv|nvjet"
     r"|splitkreduce|sm[0-9]{2,3}_", CONVOLUTION),
    # Activations: ReLU runs as clamp_min (launch_clamp_scalar) forward and threshold backward.
    (r"clamp|relu|threshold|silu|sigmoid|hardswish|hardsigmoid|hardtanh|gelu|mish", ACTIVATION),
    # Elementwise additions: residual additions and the gradients' accumulations.
    (r"functor_add|functoronself_add|add_kernel", ADD),
)
_KERNEL_PATTERNS = tuple((re.compile(pattern), family) for pattern, family in KERNEL_NAMES)

# Inductor's Triton kernels: triton_<kind>_fused_<the aten ops it holds>_<n>.
_TRITON = re.compile(r"^triton_(?P<kind>[a-z]+)_(?P<ops>.*)$")
_TRITON_NORMS = ("batch_norm", "group_norm", "layer_norm", "rms_norm", "var_mean")
_TRITON_OPTIMISER = ("foreach", "fused_sgd", "adam")
_TRITON_ACTIVATIONS = ("relu", "threshold", "silu", "sigmoid", "hardswish", "hardsigmoid", "hardtanh", "clamp",
                       "gelu", "mish")
# The ops of a pointwise kernel that only puts data in a layout (a convolution's input in channels_last).
_TRITON_LAYOUT = {"", "to", "copy", "clone", "cat", "permute", "view", "unsafe", "transpose", "t", "expand",
                  "convolution", "reshape", "squeeze", "unsqueeze", "slice", "select", "alias", "contiguous"}


def kernel_family(name: str) -> str:
    """The family of a GPU kernel (or copy, or memset) by its name: the rules of the module docstring."""
    lowered = name.lower()
    triton = _TRITON.match(lowered)
    if triton:
        return _triton_family(triton["kind"], triton["ops"])
    for pattern, family in _KERNEL_PATTERNS:
        if pattern.search(lowered):
            return family
    return OTHER


def _triton_family(kind: str, ops: str) -> str:
    ops = re.sub(r"_?\d+$", "", ops.removeprefix("fused")).strip("_")  # the aten ops, without the kernel's index
    if kind == "tem":  # a GEMM/convolution template (max-autotune)
        return CONVOLUTION
    padded = f"_{ops}_"
    tokens = set(ops.split("_"))
    if any(norm in ops for norm in _TRITON_NORMS):
        return NORM_STATISTICS if kind in ("red", "per") else NORM_APPLY
    if any(op in ops for op in _TRITON_OPTIMISER):
        return OPTIMISER
    if "_add_" in padded:
        return ADD
    if tokens & set(_TRITON_ACTIVATIONS):
        return ACTIVATION
    if kind == "poi" and tokens <= _TRITON_LAYOUT:
        return COPIES
    return OTHER


# --- the trace read: kernels in updates

@dataclass
class GpuUpdate:
    """One update's GPU account, microseconds."""

    family_us: dict[str, float] = field(default_factory=dict)
    wall_us: float = 0.0
    busy_us: float = 0.0

    @property
    def gaps_us(self) -> float:
        return self.wall_us - self.busy_us


def _union_us(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of (start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        total += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    return total


def _span(event) -> tuple[float, float]:
    return event.time_range.start, event.time_range.end


def gpu_updates(trace: list[dict[str, Any]], skip: int = 1, where: str = "the trace") -> list[GpuUpdate]:
    """Each update after the first ``skip``: its kernels' time by family, its wall and busy time."""
    events = function_events(trace)
    updates = update_marks(events, skip, where)
    kernels = [e for e in events if e.device_type != DeviceType.CPU]
    if not kernels:
        raise CnnsError(f"{where} holds no GPU kernels: its profiler did not record CUDA activity "
                        f"(ProfilerActivity.CUDA)")
    # By time, not by nesting: on a GPU the backward pass runs on autograd's own thread, outside the update's mark.
    launches = {e.linked_correlation_id: e.time_range.start for e in events
                if e.device_type == DeviceType.CPU and e.linked_correlation_id}
    marks = [(*_span(e), MARKS[e.name]) for e in events if e.name in MARKS]
    starts = [update.time_range.start for update in updates]
    mine: list[list[tuple[Any, str]]] = [[] for _ in updates]
    for kernel in kernels:
        launch = launches.get(kernel.linked_correlation_id)
        index = bisect.bisect_right(starts, kernel.time_range.start if launch is None else launch) - 1
        if index < 0 or (launch is not None and launch > updates[index].time_range.end):
            continue  # before the first update, or launched outside every update
        mark = next((family for a, b, family in marks if launch is not None and a <= launch <= b), None)
        mine[index].append((kernel, mark or kernel_family(kernel.name)))
    out = []
    for index in range(skip, len(updates)):
        start = starts[index]
        end = max([updates[index].time_range.end] + [kernel.time_range.end for kernel, _ in mine[index]])
        end = min(end, starts[index + 1]) if index + 1 < len(updates) else end
        families: dict[str, float] = defaultdict(float)
        for kernel, family in mine[index]:
            families[family] += kernel.self_device_time_total
        busy = _union_us([(max(a, start), min(b, end)) for a, b in map(_span, kernels) if a < end and b > start])
        out.append(GpuUpdate(dict(families), end - start, busy))
    return out


def breakdown_of_updates(updates: list[GpuUpdate]) -> Breakdown:
    def mean_ms(values) -> float:
        return sum(values) / len(updates) / 1e3

    return Breakdown({family: mean_ms(u.family_us.get(family, 0.0) for u in updates) for family in KERNEL_FAMILIES},
                        mean_ms(u.wall_us for u in updates), mean_ms(u.busy_us for u in updates), len(updates))


def gpu_breakdown_of_trace(folder: Path, skip: int) -> Breakdown:
    try:
        trace = read_trace(folder)
    except FileNotFoundError as exc:
        raise CnnsError(str(exc)) from None
    return breakdown_of_updates(gpu_updates(trace, skip, where=f"the profiler trace in {folder}"))


# --- rooflines

def _roofline_family(op_name: str) -> str | None:
    """The kernel family that does an ATen operator's work (`cnns.bench.roofline` names), or None."""
    if op_name in ("convolution", "convolution_backward", "mm", "addmm", "bmm"):
        return CONVOLUTION
    if any(norm in op_name for norm in ("batch_norm", "group_norm", "layer_norm")):
        return NORM_APPLY  # and its statistics: `_norm_statistics_bytes`
    if op_name.rstrip("_") in ("relu", "threshold_backward", "silu", "silu_backward", "sigmoid", "sigmoid_backward",
                               "hardswish", "hardswish_backward", "clamp_min", "gelu", "gelu_backward"):
        return ACTIVATION
    if op_name in ("add", "add_"):
        return ADD
    if op_name == "optimiser":
        return OPTIMISER
    return None


def family_rooflines(model_spec, batch_size: int, accumulation: int, dtype: torch.dtype, matmul_gflops: float,
                     bandwidth_gbs: float) -> dict[str, float]:
    """Roofline milliseconds per update of the families that have one, and of ``norm + act + add``."""
    def seconds(flops: float, moved: float) -> float:
        return max(flops / (matmul_gflops * 1e9), moved / (bandwidth_gbs * 1e9))

    out = {family: 0.0 for family in (CONVOLUTION, NORM_STATISTICS, NORM_APPLY, ACTIVATION, ADD, OPTIMISER)}
    fused = 0.0  # norm + act + add: roofline.py's minimal of their operators together
    for op in roofline.model_operators(model_spec, batch_size, True, dtype):
        family = _roofline_family(op.name)
        if family is None:
            continue
        times = 1 if family == OPTIMISER else accumulation
        out[family] += times * seconds(op.flops, op.bytes)
        if family == NORM_APPLY:
            out[NORM_STATISTICS] += times * seconds(0.0, op.largest_input_bytes)
        if family in MEMORY_BOUND:
            fused += times * seconds(op.flops, op.bytes)
    out = {family: s * 1e3 for family, s in out.items()}
    out["norm + act + add"] = fused * 1e3
    return out


# --- the report

@dataclass
class GpuProfileReport:
    name: str
    sides: dict[str, Breakdown]  # "cnns", optionally "cnns eager", "plain"
    rooflines: dict[str, float] = field(default_factory=dict)  # ms per update by family; empty if it failed
    rates_line: str = ""
    dtype: str = ""
    skipped: int = 1
    notes: list[str] = field(default_factory=list)


def _cell(value: float | None, width: int, digits: int = 2) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:{width}.{digits}f}"


def format_gpu_report(report: GpuProfileReport) -> str:
    sides = report.sides
    first = next(iter(sides.values()))
    lines = [f"{report.name}: GPU milliseconds per update (mean of {first.updates} updates after the first "
             f"{report.skipped}), by kernel family"]
    if report.rates_line:
        lines.append(f"roofline: {report.dtype} {report.rates_line}")
    header = f"{'family':<26}" + "".join(f" {side + ' ms':>13} {'%':>6}" for side in sides)
    header += f" {'roofline ms':>12}" + "".join(f" {side + '/roofline':>19}" for side in sides if side != "plain")
    lines.append(header)

    def row(label: str, values: dict[str, float], roofline: float | None) -> str:
        text = f"{label:<26}"
        for side, value in values.items():
            wall = sides[side].update_ms
            text += f" {value:13.2f} {100 * value / wall if wall else 0.0:5.1f}%"
        text += f" {_cell(roofline, 12)}"
        for side, value in values.items():
            if side != "plain":
                text += f" {_cell(value / roofline if roofline else None, 19)}"
        return text

    for family in KERNEL_FAMILIES:
        lines.append(row(family, {side: b.ms.get(family, 0.0) for side, b in sides.items()},
                         report.rooflines.get(family)))
    lines.append(row(LAUNCH_GAPS, {side: b.gaps_ms for side, b in sides.items()}, None))
    lines.append(row("GPU busy", {side: b.busy_ms for side, b in sides.items()}, None))
    lines.append(row("update (wall)", {side: b.update_ms for side, b in sides.items()}, None))
    lines.append(row("norm + act + add", {side: sum(b.ms.get(f, 0.0) for f in MEMORY_BOUND)
                                          for side, b in sides.items()}, report.rooflines.get("norm + act + add")))
    lines.append("kernel families overlap where streams run concurrently; launch gaps = wall - GPU busy; "
                 "norm + act + add's roofline reads a norm's input once for both passes")
    lines.extend(report.notes)
    return "\n".join(lines)


# --- running the sides

CUDA_WARMUP = 3  # updates left out on a GPU: compilation, CUDA-graph warm-up and recording


def profile_cuda_entry(name: str, plan, spec_dir: Path, folder: Path, timeout: float, run=run_profiled,
                       eager: bool = False, rates=None, warmup: int = CUDA_WARMUP) -> GpuProfileReport:
    """Both sides of one planned CUDA training entry (its command line already carries
    `cnns.bench.opprofile.profile_arguments`), and with ``eager`` cnns again without compilation."""
    traces = profile_sides(plan, spec_dir, folder, timeout, run, eager)
    sides = {side: gpu_breakdown_of_trace(trace, warmup) for side, trace in traces.items()}
    report = GpuProfileReport(name, sides, skipped=warmup)
    if rates is None:
        from cnns.bench.rates import DeviceRates

        rates = DeviceRates(torch.device(plan.device)).measure()
    dtype = str(plan.activation_dtype).removeprefix("torch.")
    matmul = rates.rates.get(dtype)
    report.dtype = dtype if matmul else f"{dtype} (not measured: the peak)"
    matmul = matmul or rates.peak
    report.rates_line = (f"matmul {matmul:.0f} GFLOP/s, stream {rates.bandwidth:.0f} GB/s "
                         f"({rates.describe()})")
    try:
        report.rooflines = family_rooflines(plan.model_spec, plan.batch_size, plan.grad_accum,
                                            plan.activation_dtype, matmul, rates.bandwidth)
    except Exception as exc:  # a report, never a reason to lose the measurement
        report.notes.append(f"no rooflines: {exc}")
    return report
