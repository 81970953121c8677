"""Starting and joining a run's processes: `train.py --replicas N` without a launcher starts the N local
workers with torchrun's own agent; every process then joins the world (`join_run`).

Graphcore's single command line still works (its `TestReplicatedTraining` runs exactly that), and it
behaves as `torchrun --standalone --nproc-per-node N -m cnns train ...` would: the same agent
(torch.distributed.launcher), the same environment in the workers, SIGTERM/SIGINT forwarded to
every worker (each finishes its update, they agree to stop, one checkpoint is written), workers in
sessions of their own so a terminal's Ctrl-C reaches them once, through the agent. A worker that
fails stops the others: its own error line is the one the user sees.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import uuid
from pathlib import Path

from cnns.parallel.world import join_world, launched, timeout_seconds

# Seconds the workers get to write their checkpoint after a SIGTERM before the agent kills them.
SHUTDOWN_TIMEOUT_S = 300


def spawn_local_workers(command: str, argv: list[str], processes: int) -> int:
    """Run `cnns <command> <argv>` in `processes` local worker processes; their exit code."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # The agent logs every start and stop, and each failure again; the workers print what a user needs.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    source_root = str(Path(__file__).resolve().parents[2])  # the src/ folder: workers import this cnns
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (source_root, os.environ.get("PYTHONPATH")) if p)
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=processes, run_id=str(uuid.uuid4()),
        rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", rdzv_configs={"timeout": int(timeout_seconds())},
        max_restarts=0, monitor_interval=0.1, start_method="spawn", shutdown_timeout=SHUTDOWN_TIMEOUT_S,
    )
    try:
        elastic_launch(config, sys.executable)("-m", "cnns", command, *argv)
        return 0
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        if failure.exitcode < 0:  # killed by a signal: nothing was printed by the worker itself
            name = signal.Signals(-failure.exitcode).name
            print(f"error: worker rank {rank} was killed by {name}; the others were stopped", file=sys.stderr)
            return 1
        return failure.exitcode  # the worker printed its own one-line error
    except SignalException as exc:
        # The agent forwarded the signal; the workers checkpointed and said how to continue. Ctrl-C ends with
        # 130 as one process does (`cnns.engine.session.INTERRUPTED_EXIT_CODES`), SIGTERM cleanly.
        return 0 if exc.sigval == signal.SIGTERM else 128 + int(exc.sigval)


def needs_local_workers(replicas: int, shards: int) -> bool:
    """Several processes asked for and none started by a launcher: this process starts them."""
    return replicas * shards > 1 and not launched()


def join_run(cfg) -> tuple:
    """(this process's World, the RunConfig every process agreed on, the notices rank 0 prints): the world on
    the run's device, rank 0's random seed, and rank 0's cuts for --pipeline-splits auto."""
    from cnns.devices import resolve_device
    from cnns.parallel.planning import settle_auto_splits

    device = resolve_device(cfg.device)
    notices: list[str] = []

    def agree(world, cfg):
        cfg, notice = settle_auto_splits(cfg, world, device)
        notices.extend([notice] if notice else [])
        return cfg

    world, cfg = join_world(cfg, device, agree)
    return world, cfg, notices
