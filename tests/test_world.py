"""The process world's own life: the process groups it joins are gone, threads and all, when it closes.

A real gloo group of one process on 127.0.0.1 (the launcher's variables set as torchrun sets them), in
this test's process: what is checked is this process's threads, so no peer is needed.
"""

from __future__ import annotations

import gc
from pathlib import Path

import torch
import torch.distributed as dist

from processes import free_port

from cnns.parallel.world import init_world


def gloo_threads() -> int:
    """This process's threads that gloo started: its transport loops and the process groups' workers."""
    names = []
    for task in Path("/proc/self/task").iterdir():
        try:
            names.append((task / "comm").read_text().strip())
        except OSError:  # ended meanwhile
            continue
    return sum(name.startswith(("gloo", "pt_gloo")) for name in names)


class Holder:
    """A module or an optimiser keeping a group, in a reference cycle as models often are."""

    def __init__(self, group):
        self.group = group
        self.me = self


def test_closing_the_world_ends_its_process_groups_threads_while_the_interpreter_is_whole(monkeypatch):
    # Left alive to the interpreter's shutdown, a gloo worker thread that releases a tensor takes the GIL of
    # a finalising interpreter and aborts the process ("terminate called without an active exception").
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(name, value)
    before = gloo_threads()
    world = init_world(1, 1, 1, torch.device("cpu"), timeout_s=30)
    gc.disable()  # no collection but close's own
    try:
        holder = Holder(world.control)
        dist.all_reduce(torch.ones(3), group=world.control)  # a group that has worked
        del holder  # unreachable now, but a cycle: only a collection frees it
        assert gloo_threads() > before
        world.close()
        assert gloo_threads() == before
    finally:
        world.close()  # (again: a no-op once closed) no group left to this worker's later tests
        gc.enable()
