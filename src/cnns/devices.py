"""Which device a run uses: the rule written once, on the lowest floor, for every command.

`--device` (cpu, cuda, cuda:N) wins; `--select-ipus N` (Graphcore's application's option) means GPU N;
otherwise the GPU when this machine has one. The half type that 16.x computes in on a device is
`cnns.precision.default_half_dtype`.
"""

from __future__ import annotations

import os

import torch

from cnns.errors import ConfigError


def requested_device(device: str | None, select_ipus: list | tuple | None = None) -> str | None:
    """The device a command line names (--device, else --select-ipus N as cuda:N), or None for the default."""
    if device:
        return str(device)
    if select_ipus and str(select_ipus[0]).lower() != "auto":
        try:
            return f"cuda:{int(select_ipus[0])}"
        except ValueError:
            raise ConfigError(f"--select-ipus takes a device number or auto, got {select_ipus[0]!r}") from None
    return None


def default_device_name() -> str:
    """cuda when this machine has a GPU torch can use, else cpu."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_device(requested: str | None, select_ipus: list | tuple | None = None) -> torch.device:
    """The torch device of a request (`requested_device`'s rule): ConfigError, one line, for a device this
    machine does not have."""
    name = requested_device(requested, select_ipus) or default_device_name()
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"unknown device {name!r}; use cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {name} requested but CUDA is not available on this machine")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        count = torch.cuda.device_count()
        raise ConfigError(f"device {name} requested but this machine has {count} GPU{'s' if count != 1 else ''} "
                          f"({', '.join(f'cuda:{i}' for i in range(count))})")
    return device


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity: a batch system's share, not the machine's). The one
    count of them: worker threads, local workers and data-loading workers all share these."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
