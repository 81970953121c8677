"""`cnns splits`: every cut of the model with what lies before it (parameters, activations, time of one
micro-batch forward and backward) and the cuts that balance --shards stages (at least 2).

`model_to_plan` is the model the planner times, here and for --pipeline-splits auto (train, restore and
validate pass it to `cnns.parallel.launch.join_run`): the one `cnns.engine.assembly.assemble` makes, so the
cuts balance the model that trains, fused passes and kernels included.
"""

from __future__ import annotations

import torch
from torch import nn

from cnns.config import RunConfig
from cnns.devices import resolve_device
from cnns.engine.assembly import assemble
from cnns.parallel.planning import Autocast, format_report, split_proposal
from cnns.parallel.world import World


def propose_splits(cfg: RunConfig) -> int:
    from cnns.commands.checks import check_no_sinks_without_a_folder

    check_no_sinks_without_a_folder(cfg, "cnns splits writes no run folder")
    print(format_report(split_proposal(cfg, max(2, cfg.parallel.shards), resolve_device(cfg.device), model_to_plan)))
    return 0


def model_to_plan(cfg: RunConfig, device: torch.device) -> tuple[nn.Module, Autocast]:
    """The model as one process trains it, in train mode, and the autocast of its step: `assemble` in a world of
    one process, whose `plain` model is what a pipeline cuts into stages (a stage is never compiled, and the
    pipeline's communication is not the pieces' time). No splits are chosen yet, so --enable-recomputation
    recomputes per block (as it does with --shards > 1)."""
    from cnns.models import build_model

    policy = cfg.precision.policy(device)
    assembled = assemble(build_model(cfg.model), cfg.with_splits([]), World(), device, policy)
    return assembled.plain.train(), policy.autocast
