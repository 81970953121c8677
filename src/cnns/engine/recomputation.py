"""Recomputation (--enable-recomputation): a block's, or a segment's between --pipeline-splits, activations are
not kept for the backward pass but computed again there, trading compute for memory. The module keeps its
parameters, buffers and state-dict keys (`cnns.engine.specialise.specialise`); running statistics are updated
once, by the first forward.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from cnns.engine.specialise import specialise


@contextlib.contextmanager
def _batch_norm_statistics_kept(module: nn.Module):
    """Undo what a recomputed forward does to running statistics: they were updated once already.

    The recomputation runs the block's forward again in training mode, so without this every batch
    norm would fold the same batch into its running mean and variance twice (and count it twice).
    """
    saved = [(buffer, buffer.clone()) for norm in module.modules()
             if isinstance(norm, nn.modules.batchnorm._BatchNorm) for buffer in norm.buffers(recurse=False)]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)


def recomputed(function, owner: nn.Module):
    """`function` (a part of `owner`'s computation) with its activations recomputed in the backward
    pass when `owner` trains; batch-norm statistics of `owner` are updated once."""

    def run(*args, **kwargs):
        if not (owner.training and torch.is_grad_enabled()):
            return function(*args, **kwargs)
        # context_fn: nothing around the first forward, statistics restored around the recomputation.
        return checkpoint(function, *args, use_reentrant=False, preserve_rng_state=True,
                          context_fn=lambda: (contextlib.nullcontext(), _batch_norm_statistics_kept(owner)), **kwargs)

    return run


class _Recomputed:
    """A block whose forward (its class's, or the fused one of `cnns.engine.fusion`) is recomputed."""

    def forward(self, *args, **kwargs):
        return recomputed(super().forward, self)(*args, **kwargs)


class _RecomputedSegments:
    """A whole model run as its segments between recomputation points (``_cnns_segments``)."""

    def forward(self, x):
        for run in self._cnns_segments:
            x = run(x)
        return x


def recompute(model: nn.Module, spec, splits: tuple[str, ...] | None, between_splits: bool) -> int:
    """--enable-recomputation: per segment between the --pipeline-splits when the run marks recomputation points
    on one device (`between_splits`), else per block. Returns the number of segments or blocks recomputed."""
    from cnns.models import recomputation_blocks, resolve_splits
    from cnns.models.split_points import model_pieces, stage_pieces

    if between_splits:
        cuts = resolve_splits(spec, model, list(splits or ()))
        return recompute_between_splits(model, stage_pieces(model_pieces(spec, model, cuts), cuts))
    return recompute_blocks(model, recomputation_blocks(spec, model))


def recompute_blocks(model: nn.Module, blocks: list[str]) -> int:
    """Graphcore's application's --enable-recomputation on one device: keep only each block's input,
    recompute the rest.

    ``blocks`` are qualified module names (the residual units or EfficientNet blocks, see
    `cnns.models.recomputation_blocks`). In training each block runs under non-reentrant
    `torch.utils.checkpoint`: its inner activations are freed after the forward and recomputed in the
    backward, with the random state replayed (dropout, drop-path) and batch-norm statistics updated
    once. Gradients are bitwise those of the plain model. Returns the number of blocks wrapped.
    """
    for name in blocks:
        specialise(model.get_submodule(name), _Recomputed)
    return len(blocks)


def keep_recomputation(pieces: list, model: nn.Module) -> list:
    """`pieces` of `model` (`cnns.models.split_points.Piece`) with the recomputation `recompute` gave the model: the
    parts of a recomputed block that a pipeline cut runs on their own (not through the block's forward) are
    each recomputed, the stage boundary between them kept."""
    def kept(piece):
        block = model.get_submodule(piece.block) if piece.block else None
        return replace(piece, run=recomputed(piece.run, block)) if isinstance(block, _Recomputed) else piece

    return [kept(piece) for piece in pieces]


def recompute_between_splits(model: nn.Module, segments: list) -> int:
    """Graphcore's application's recomputation points on one device (`--pipeline --shards 1 --pipeline-splits ...
    --enable-recomputation`): the model runs as its segments between the splits (lists of
    `cnns.models.split_points.Piece`), and only each segment's input is kept for the backward pass;
    everything inside a segment is recomputed. Returns the number of segments."""

    def segment(pieces):
        def run(x):
            for piece in pieces:
                x = piece.run(x)
            return x

        return recomputed(run, model)

    model._cnns_segments = [segment(pieces) for pieces in segments]
    specialise(model, _RecomputedSegments)
    return len(model._cnns_segments)
