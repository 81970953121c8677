"""Planning a pipeline: where to cut a model into stages (`cnns splits`, and --pipeline-splits auto).

A pipeline runs as fast as its slowest stage, and Graphcore's split names say nothing about how much
work lies between them. This profiles the model as one process trains it (assembled by the command that plans:
`ModelToPlan`), as the pieces a pipeline stage is made of
(`cnns.models.split_points.model_pieces`, cut at every possible split), one micro-batch forward and backward
per piece, and proposes the ``--pipeline-splits`` that minimise the slowest stage's time (an exact
linear partition). Per cut it reports what lies before it (parameters, activations saved for backward,
time) and the tensor a stage sends across it per micro-batch.

Times are those of the machine it runs on, measured piece by piece: they leave out the pipeline's communication
and bubbles, and one process measures them, so on a CPU stages that later share the cores run slower.
"""

from __future__ import annotations

import contextlib
import itertools
import statistics
import time
from dataclasses import dataclass
from typing import Callable, ContextManager, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from cnns.config import RunConfig
from cnns.errors import ConfigError
from cnns.models import ModelSpec, split_points
from cnns.models.model_spec import display_name
from cnns.models.split_points import main_split_names, model_pieces

Autocast = Callable[[], ContextManager]
# The model a run trains, for the planner to time: (configuration, device) -> (the model as one process trains it,
# in train mode, and the autocast its step runs under). The command passes it (`cnns.commands.splits.model_to_plan`:
# `cnns.engine.assembly.assemble`, which this floor does not import), so what is timed is what trains, fused
# passes included.
ModelToPlan = Callable[[RunConfig, torch.device], tuple[nn.Module, Autocast]]


@dataclass(frozen=True)
class PieceCost:
    """One piece of the model (between two possible cuts, or the stem/head): its own costs."""

    cut: str  # the cut after it ("stem" and "head" are not places to cut)
    params: int
    activation_bytes: int  # saved for backward, each storage counted once over the whole model
    seconds: float  # forward + backward of one micro-batch, median
    output_bytes: int  # the tensor it hands to the next piece


@dataclass(frozen=True)
class CutCost:
    """One place to cut, and everything before it (the pieces up to and including the one it ends)."""

    name: str  # the cut's name in Graphcore's application (``main_split_names``)
    cut: str  # the cut id (a value of ``split_points``)
    piece: int  # index in ``Profile.pieces`` of the piece ending at this cut
    params: int
    activation_bytes: int
    seconds: float
    crossing_bytes: int  # what a stage ending here sends per micro-batch


@dataclass(frozen=True)
class Profile:
    """The rows of every valid cut in model order, the pieces they were summed from and the totals."""

    title: str  # model, micro-batch, device and compute type, for the report
    pieces: list[PieceCost]
    rows: list[CutCost]
    total_params: int
    total_activation_bytes: int
    total_seconds: float


@dataclass(frozen=True)
class Proposal:
    """The balanced cut for ``stages`` stages: split names for --pipeline-splits and predicted stage times."""

    stages: int
    names: list[str]
    stage_seconds: list[float]  # sums of the profiled piece times of each stage
    profile: Profile


def profile_cuts(spec: ModelSpec, model: nn.Module, micro_batch: int, device: torch.device,
                 autocast: Autocast = contextlib.nullcontext, repeats: int = 3) -> Profile:
    """Measure every piece of ``model`` (as a run trains it: `ModelToPlan`) on one micro-batch of random images.

    Each piece runs forward then backward on the previous piece's output (detached, so each is timed
    alone); its time is the median of ``repeats`` after a warm-up. The warm-up forward also measures the
    activations saved for backward, with every piece's graph kept alive so no storage is freed and
    reused meanwhile: each storage is counted once, in the first piece that saves it, and parameters
    are not counted (under autocast their half copies are, as each step holds them too).
    """
    points = split_points(spec, model)
    cut_ids = list(dict.fromkeys(points.values()))
    pieces = model_pieces(spec, model, cut_ids)
    dtype = next(model.parameters()).dtype
    x = torch.randn(micro_batch, 3, spec.image_size, spec.image_size, device=device, dtype=dtype)
    x = x.contiguous(memory_format=torch.channels_last)

    # Warm-up and saved activations: all pieces forward, graphs alive, then all backward.
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set[int] = set()
    saved = [0] * len(pieces)
    inputs, outputs, gradients = [], [], []
    for index, piece in enumerate(pieces):

        def pack(tensor: torch.Tensor, index: int = index) -> torch.Tensor:
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in weights and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                saved[index] += storage.nbytes()
            return tensor

        with autocast(), torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            y = piece.run(x)
        inputs.append(x)
        outputs.append(y)
        gradients.append(None if piece.cut == "head" else torch.randn_like(y))
        x = y.detach().requires_grad_(y.is_floating_point())
    labels = torch.randint(0, spec.num_classes, (micro_batch,), device=device)
    for y, gradient in zip(outputs, gradients):
        _backward(y, gradient, labels)
    model.zero_grad(set_to_none=True)

    costs = []
    for index, (piece, params) in enumerate(zip(pieces, _piece_parameters(model, pieces))):
        times = []
        for _ in range(repeats):
            _sync(device)
            start = time.perf_counter()
            with autocast():
                y = piece.run(inputs[index])
            _backward(y, gradients[index], labels)
            _sync(device)
            times.append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)  # training starts every step without gradients
            inputs[index].grad = None
        costs.append(PieceCost(piece.cut, params, saved[index], statistics.median(times),
                               outputs[index].numel() * outputs[index].element_size()))

    names = dict(zip(cut_ids, main_split_names(spec, model)))  # both in model order, one per cut
    rows, params, activations, seconds = [], 0, 0, 0.0
    for index, cost in enumerate(costs):
        params, activations = params + cost.params, activations + cost.activation_bytes
        seconds += cost.seconds
        if cost.cut in names:
            rows.append(CutCost(names[cost.cut], cost.cut, index, params, activations, seconds, cost.output_bytes))
    context = autocast()
    compute = f"autocast to {_dtype(context.fast_dtype)}" if isinstance(context, torch.autocast) else "no autocast"
    title = (f"{display_name(spec)} at {spec.image_size} px, micro-batch {micro_batch}, {device.type}, "
             f"weights {_dtype(dtype)}, {compute}")
    return Profile(title, costs, rows, params, activations, seconds)


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _backward(y: torch.Tensor, gradient: torch.Tensor | None, labels: torch.Tensor) -> None:
    """Backward of a piece: of the loss for the head (logits), else with the given output gradient."""
    if gradient is None:
        F.cross_entropy(y.float(), labels).backward()
    else:
        y.backward(gradient)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _piece_parameters(model: nn.Module, pieces: Sequence) -> list[int]:
    """Trainable parameters of each piece's modules, each parameter counted once (in its first piece)."""
    seen: set[int] = set()
    counts = []
    for piece in pieces:
        count = 0
        for name in piece.modules:
            for parameter in model.get_submodule(name).parameters():
                if parameter.requires_grad and id(parameter) not in seen:
                    seen.add(id(parameter))
                    count += parameter.numel()
        counts.append(count)
    return counts


def balanced_cuts(piece_seconds: Sequence[float], allowed: Sequence[int], stages: int) -> list[int]:
    """The ``stages - 1`` cut indices (cut after piece i), among ``allowed``, that minimise the slowest
    stage's total time: the linear partition problem, solved exactly by dynamic programming over
    (stage, position of its last cut), O(stages x len(allowed)^2)."""
    n = len(piece_seconds)
    if stages < 1:
        raise ConfigError(f"a pipeline needs at least 1 stage, not {stages}")
    if any(not 0 <= i < n - 1 for i in allowed):
        raise ValueError(f"cut indices must lie in 0..{n - 2} (after a piece other than the last): {list(allowed)}")
    positions = sorted(set(allowed))
    if len(positions) < stages - 1:
        places = f"{len(positions)} place" + ("" if len(positions) == 1 else "s")
        raise ConfigError(f"cannot cut the model into {stages} stages: it has only {places} to cut, "
                          f"so at most {len(positions) + 1} stages")
    if stages == 1:
        return []
    prefix = [0.0, *itertools.accumulate(piece_seconds)]

    def span(start: int, end: int) -> float:  # the pieces after cut `start` up to and including `end`
        return prefix[end + 1] - prefix[start + 1]

    m = len(positions)
    # best[a]: the slowest of the stages so far when the last cut is positions[a]; back[j][a] its previous cut.
    best = [prefix[positions[a] + 1] for a in range(m)]
    back: list[list[int]] = []
    for _ in range(stages - 2):
        new, links = [float("inf")] * m, [-1] * m
        for a in range(m):
            for p in range(a):
                value = max(best[p], span(positions[p], positions[a]))
                if value < new[a]:
                    new[a], links[a] = value, p
        best = new
        back.append(links)
    finals = [max(best[a], span(positions[a], n - 1)) for a in range(m)]
    a = min(range(m), key=lambda k: finals[k])
    chosen = [a]
    for links in reversed(back):
        a = links[a]
        chosen.append(a)
    return [positions[k] for k in reversed(chosen)]


def propose_from_profile(profile: Profile, stages: int) -> Proposal:
    """The balanced cut of a profile into ``stages`` stages."""
    seconds = [piece.seconds for piece in profile.pieces]
    if stages - 1 > len(profile.rows):
        raise ConfigError(f"{profile.title.split(' at ')[0]} can be cut in {len(profile.rows)} places: "
                          f"at most {len(profile.rows) + 1} stages, not {stages}")
    chosen = balanced_cuts(seconds, [row.piece for row in profile.rows], stages)
    by_piece = {row.piece: row.name for row in profile.rows}
    bounds = [0, *(index + 1 for index in chosen), len(seconds)]
    stage_seconds = [sum(seconds[start:end]) for start, end in zip(bounds, bounds[1:])]
    return Proposal(stages, [by_piece[index] for index in chosen], stage_seconds, profile)


def propose(spec: ModelSpec, model: nn.Module, stages: int, micro_batch: int, device: torch.device,
            autocast: Autocast = contextlib.nullcontext, repeats: int = 3) -> Proposal:
    """Profile ``model`` and propose the split names that balance ``stages`` pipeline stages."""
    return propose_from_profile(profile_cuts(spec, model, micro_batch, device, autocast, repeats), stages)


def _params(count: int) -> str:
    return f"{count / 1e6:.2f}M" if count >= 100_000 else f"{count / 1e3:.1f}k"


def _bytes(count: int) -> str:
    return f"{count / 2**20:.2f} MiB" if count >= 2**20 else f"{count / 2**10:.1f} KiB"


def format_report(proposal: Proposal) -> str:
    """The table of cuts (what lies before each, what crosses it) and the proposed --pipeline-splits."""
    profile = proposal.profile
    width = max(len("whole model"), *(len(row.name) for row in profile.rows))
    header = f"{'cut':<{width}}  {'params':>9}  {'activations':>12}  {'fwd+bwd':>10}  {'crosses':>11}"
    lines = [profile.title, "what lies before each cut, and the tensor a stage sends across it per micro-batch:",
             header]
    for row in profile.rows:
        lines.append(f"{row.name:<{width}}  {_params(row.params):>9}  {row.activation_bytes / 2**20:>8.2f} MiB  "
                     f"{1000 * row.seconds:>7.2f} ms  {_bytes(row.crossing_bytes):>11}")
    lines.append(f"{'whole model':<{width}}  {_params(profile.total_params):>9}  "
                 f"{profile.total_activation_bytes / 2**20:>8.2f} MiB  {1000 * profile.total_seconds:>7.2f} ms")
    splits = " ".join(proposal.names) if proposal.names else "(none: one stage)"
    lines.append(f"Proposed for --shards {proposal.stages}: --pipeline-splits {splits}")
    slowest = max(range(proposal.stages), key=lambda s: proposal.stage_seconds[s])
    mean = sum(proposal.stage_seconds) / proposal.stages
    times = ", ".join(f"{1000 * t:.2f}" + (" (slowest)" if s == slowest else "")
                      for s, t in enumerate(proposal.stage_seconds))
    balance = proposal.stage_seconds[slowest] / mean if mean > 0 else 1.0
    lines.append(f"Predicted fwd+bwd per stage and micro-batch (ms): {times}; balance {balance:.2f} (slowest / mean)")
    return "\n".join(lines)


def split_proposal(cfg: RunConfig, stages: int, device: torch.device, model_to_plan: ModelToPlan) -> Proposal:
    """The profiled, balanced proposal for a run's model, micro-batch and precision on `device`."""
    model, autocast = model_to_plan(cfg, device)
    return propose(cfg.model, model, stages, cfg.train.micro_batch_size, device, autocast)


def settle_auto_splits(cfg: RunConfig, world, device: torch.device,
                       model_to_plan: ModelToPlan) -> tuple[RunConfig, str | None]:
    """--pipeline-splits auto: rank 0 profiles the model and every process takes its proposal
    (`world` is the run's `cnns.parallel.world.World`). Returns the configuration with the splits, and on
    rank 0 the notice that names them."""
    if cfg.parallel.pipeline_splits != ("auto",):
        return cfg, None
    names, notice = None, None
    if world.is_writer:
        proposal = split_proposal(cfg, cfg.parallel.shards, device, model_to_plan)
        names = proposal.names
        times = ", ".join(f"{1000 * t:.1f}" for t in proposal.stage_seconds)
        notice = (f"--pipeline-splits auto: {' '.join(names)} (measured forward + backward per stage and "
                  f"micro-batch: {times} ms; `cnns splits` shows every cut)")
    return cfg.with_splits(world.broadcast(names)), notice
