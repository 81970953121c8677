"""`cnns splits`: every cut of the model with what lies before it (parameters, activations, time of one
micro-batch forward and backward) and the cuts that balance --shards stages (at least 2)."""

from __future__ import annotations

from cnns.config import RunConfig
from cnns.devices import resolve_device
from cnns.parallel.planning import format_report, split_proposal


def propose_splits(cfg: RunConfig) -> int:
    print(format_report(split_proposal(cfg, max(2, cfg.parallel.shards), resolve_device(cfg.device))))
    return 0
