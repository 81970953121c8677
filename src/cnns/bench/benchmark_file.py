"""A benchmark spec (`benchmarks.yml`) read: its entries, checked, and the ones chosen by name.

Every entry is one of Graphcore's command lines. A ``kind: command`` entry (the default: train.py or
validation.py) runs beside the plain loop in each of its ``baseline_modes`` (``eager``; ``compiled``:
``torch.compile(model)``; by default eager on a CPU, where compiling measured no faster and costs about a minute,
and both on a GPU, where cnns compiles). A ``kind: inference-backends`` entry's inference_embedded.py command line
names the model, batch, image size, seed and timed batches that `cnns.bench.backends` measures on several
inference backends, with its own keys ``backends``, ``warmup``, ``rounds`` and ``threads``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from cnns.errors import ConfigError

COMMAND_KIND = "command"
BACKENDS_KIND = "inference-backends"
KINDS = (COMMAND_KIND, BACKENDS_KIND)
BACKENDS = ("eager", "eager-bf16", "aoti", "aoti-bf16", "onnxruntime")  # cnns.bench.backends measures them
DEFAULT_BACKENDS = ("eager", "aoti", "onnxruntime")
BASELINE_MODES = ("eager", "compiled")  # the plain loop as written, and torch.compile(model) of it
# A `kind: inference-backends` entry's keys besides a command entry's: how `cnns.bench.backends` times it.
BACKENDS_SETTINGS = ("backends", "warmup", "rounds", "threads")


@dataclass
class Entry:
    name: str
    command: str
    baseline: bool = True
    description: str = ""
    timeout: float = 1800.0
    kind: str = COMMAND_KIND
    settings: dict[str, Any] = field(default_factory=dict)  # an inference-backends entry's BACKENDS_SETTINGS
    device: str = "cpu"  # where the command and the plain loop run: cpu, cuda or cuda:N
    # the plain loop's runs (BASELINE_MODES); None until loaded: [eager] on the CPU, [eager, compiled] on a GPU
    baseline_modes: tuple[str, ...] | None = None

    def missing_device(self) -> str | None:
        """Why this entry cannot run on this machine, or None."""
        device = torch.device(self.device)
        if device.type != "cuda":
            return None
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            return f"needs {self.device}; this machine has {count} CUDA GPU{'s' if count != 1 else ''}"
        return None


def load_spec(path: str | Path) -> tuple[list[Entry], dict[str, Any]]:
    from cnns.config.config_files import read_yaml

    path = Path(path)
    document = read_yaml(path, "benchmark spec") or {}
    if not isinstance(document, dict):
        raise ConfigError(f"{path} is not a benchmark list (a mapping with 'benchmarks:')")
    raw, defaults = document.get("benchmarks"), document.get("defaults") or {}
    if not isinstance(raw, list) or not raw:
        raise ConfigError(f"{path} has no 'benchmarks:' list")
    entries = [command_entry(path, item, defaults) for item in raw]
    names = [e.name for e in entries]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ConfigError(f"{path}: duplicate benchmark names {', '.join(duplicates)}")
    return entries, document


def command_entry(path: Path, item: Any, defaults: dict[str, Any]) -> Entry:
    if isinstance(item, dict) and item.get("kind", COMMAND_KIND) not in KINDS:
        raise ConfigError(f"{path}: benchmark {item.get('name')!r} has kind {item['kind']!r}; "
                          f"valid kinds: {', '.join(KINDS)}")
    if not isinstance(item, dict) or "name" not in item or "command" not in item:
        raise ConfigError(f"{path}: every benchmark needs a name and a command, got {item!r}")
    backends = item.get("kind") == BACKENDS_KIND
    keys = {*Entry.__dataclass_fields__, *(BACKENDS_SETTINGS if backends else ())} - {"settings"}
    unknown = sorted(k for k in item if k not in keys)
    if unknown:
        raise ConfigError(f"{path}: benchmark {item['name']}: {', '.join(unknown)} not understood; its keys: "
                          f"{', '.join(sorted(keys))}")
    entry = Entry(**{k: v for k, v in {**defaults, **item}.items() if k in Entry.__dataclass_fields__
                     and k != "settings"}, settings={k: item[k] for k in BACKENDS_SETTINGS if k in item})
    _check_device(path, entry)
    if not backends:
        _check_baseline_modes(path, entry)
        return entry
    if entry.device != "cpu":
        raise ConfigError(f"{path}: benchmark {entry.name}: {BACKENDS_KIND} run on the CPU (onnxruntime's CPU "
                          f"provider), not {entry.device}")
    entry.baseline, entry.baseline_modes = False, ()  # no plain loop beside the backends
    return entry


def _check_device(path: Path, entry: Entry) -> None:
    try:
        device = torch.device(str(entry.device))
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ConfigError(f"{path}: benchmark {entry.name} has device {entry.device!r}; use cpu, cuda or cuda:N")
    entry.device = str(device)


def _check_baseline_modes(path: Path, entry: Entry) -> None:
    modes = entry.baseline_modes
    if modes is None:
        entry.baseline_modes = ("eager",) if entry.device == "cpu" else BASELINE_MODES
        return
    if isinstance(modes, str):
        modes = [modes]
    if not isinstance(modes, (list, tuple)) or not modes:
        raise ConfigError(f"{path}: benchmark {entry.name}: baseline_modes must be a list of "
                          f"{', '.join(BASELINE_MODES)}, got {modes!r}")
    wrong = [m for m in modes if m not in BASELINE_MODES]
    if wrong:
        raise ConfigError(f"{path}: benchmark {entry.name} has baseline mode {', '.join(map(repr, wrong))}; "
                          f"valid modes: {', '.join(BASELINE_MODES)}")
    entry.baseline_modes = tuple(dict.fromkeys(modes))


@dataclass
class BackendsSpec:
    """What the runner passes to ``python -m cnns.bench.backends`` (as JSON): the resolved options of an
    inference-backends entry's inference_embedded.py command line and its BACKENDS_SETTINGS, checked."""

    options: dict[str, Any]  # `cnns.config.RunConfig.from_options` makes the run's configuration of them
    backends: list[str] = field(default_factory=lambda: list(DEFAULT_BACKENDS))
    warmup: int = 3
    rounds: int = 1
    threads: int | None = None
    cache_dir: str | None = None
    result_path: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.backends, list):
            raise ValueError(f"backends must be a list, got {self.backends!r}")
        check_backends(self.backends)
        for key, least in (("warmup", 0), ("rounds", 1), ("threads", 1)):
            value = getattr(self, key)
            if not (value is None and key == "threads") and (not isinstance(value, int) or value < least):
                raise ValueError(f"{key} must be an integer of at least {least}, got {value!r}")


def check_backends(backends) -> None:
    unknown = [str(b) for b in backends if b not in BACKENDS]
    if unknown or not backends:
        raise ValueError(f"unknown backend {', '.join(unknown) or '(none)'}; valid backends: {', '.join(BACKENDS)}")


def select(entries: list[Entry], names: list[str] | None) -> list[Entry]:
    if not names:
        return entries
    by_name = {e.name: e for e in entries}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise ConfigError(f"unknown benchmark {', '.join(unknown)}; valid names: {', '.join(by_name)}")
    return [by_name[n] for n in names]
