"""A benchmark spec (`benchmarks.yml`) read: its entries, checked, and the ones chosen by name.

An entry is one of Graphcore's command lines (``kind: command``, the default), run beside the plain loop in each
of its ``baseline_modes`` (``eager``; ``compiled``: ``torch.compile(model)``; by default eager on a CPU, where
compiling measured no faster and costs about a minute, and both on a GPU, where cnns compiles), or ``kind:
inference-backends``: a model and batch measured on several inference backends (`cnns.bench.backends`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from cnns.errors import ConfigError
from cnns.models.spec import ModelSpec, normalise_size

COMMAND_KIND = "command"
BACKENDS_KIND = "inference-backends"
KINDS = (COMMAND_KIND, BACKENDS_KIND)
BACKENDS = ("eager", "eager-bf16", "aoti", "aoti-bf16", "onnxruntime")  # cnns.bench.backends measures them
DEFAULT_BACKENDS = ("eager", "aoti", "onnxruntime")
BASELINE_MODES = ("eager", "compiled")  # the plain loop as written, and torch.compile(model) of it
# The keys of a `kind: inference-backends` entry (besides name, kind, description, timeout), and the
# cnns.bench.backends.BackendsSpec field each one fills.
BACKENDS_KEYS = {"model": "arch", "model_size": "size", "batch_size": "batch_size", "image_size": "image_size",
                 "num_classes": "num_classes", "norm": "norm", "backends": "backends", "warmup": "warmup",
                 "iterations": "iterations", "rounds": "rounds", "threads": "threads", "seed": "seed"}


@dataclass
class Entry:
    name: str
    command: str
    baseline: bool = True
    description: str = ""
    timeout: float = 1800.0
    kind: str = COMMAND_KIND
    settings: dict[str, Any] = field(default_factory=dict)  # an inference-backends entry's BACKENDS_KEYS
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
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"benchmark spec not found: {path}")
    try:
        document = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {str(exc).splitlines()[0]}") from None
    raw, defaults = document.get("benchmarks"), document.get("defaults") or {}
    if not isinstance(raw, list) or not raw:
        raise ConfigError(f"{path} has no 'benchmarks:' list")
    entries = [backends_entry(path, item, defaults) if isinstance(item, dict) and item.get("kind") == BACKENDS_KIND
               else command_entry(path, item, defaults) for item in raw]
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
    entry = Entry(**{k: v for k, v in {**defaults, **item}.items() if k in Entry.__dataclass_fields__
                     and k != "settings"})
    _check_device(path, entry)
    _check_baseline_modes(path, entry)
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
    """What a ``kind: inference-backends`` entry measures (its keys, BACKENDS_KEYS), checked: the JSON the runner
    passes to ``python -m cnns.bench.backends``."""

    arch: str
    size: str
    batch_size: int
    image_size: int = 224
    num_classes: int = 1000
    norm: str = "batch"
    backends: list[str] = field(default_factory=lambda: list(DEFAULT_BACKENDS))
    warmup: int = 3
    iterations: int = 20
    rounds: int = 1
    threads: int | None = None
    seed: int = 0
    cache_dir: str | None = None
    result_path: str | None = None

    def __post_init__(self) -> None:
        check_backends(self.backends)
        for key in ("batch_size", "iterations", "rounds"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                raise ValueError(f"{key} must be a positive integer, got {getattr(self, key)!r}")

    def model_spec(self) -> ModelSpec:
        return ModelSpec(self.arch, self.size, self.num_classes, self.image_size, norm=self.norm)


def check_backends(backends) -> None:
    unknown = [str(b) for b in backends if b not in BACKENDS]
    if unknown or not backends:
        raise ValueError(f"unknown backend {', '.join(unknown) or '(none)'}; valid backends: {', '.join(BACKENDS)}")


def backends_entry(path: Path, item: dict[str, Any], defaults: dict[str, Any]) -> Entry:
    """A `kind: inference-backends` entry: no command line, the model and batch as keys (BACKENDS_KEYS)."""
    name = item.get("name")
    if not name:
        raise ConfigError(f"{path}: every benchmark needs a name, got {item!r}")
    common = {"name", "kind", "description", "timeout"}
    unknown = sorted(k for k in item if k not in common and k not in BACKENDS_KEYS)
    if unknown:
        raise ConfigError(f"{path}: benchmark {name}: {', '.join(unknown)} not understood by a {BACKENDS_KIND} "
                          f"entry; its keys: {', '.join(sorted(BACKENDS_KEYS))}")
    missing = [k for k in ("model", "model_size", "batch_size") if k not in item]
    if missing:
        raise ConfigError(f"{path}: benchmark {name}: a {BACKENDS_KIND} entry needs {', '.join(missing)}")
    settings = {k: item[k] for k in BACKENDS_KEYS if k in item}
    backends = settings.get("backends")
    if backends is not None and (not isinstance(backends, list) or not backends):
        raise ConfigError(f"{path}: benchmark {name}: backends must be a list, got {backends!r}")
    timeout = item.get("timeout", defaults.get("timeout", Entry.timeout))
    size = normalise_size(str(settings["model"]).lower(), settings["model_size"])
    summary = (f"{BACKENDS_KIND} {settings['model']}-{size} "
               f"{settings.get('image_size', 224)}px batch {settings['batch_size']}: "
               + ", ".join(backends or DEFAULT_BACKENDS))
    return Entry(name=str(name), command=summary, baseline=False, description=str(item.get("description", "")),
                 timeout=float(timeout), kind=BACKENDS_KIND, settings=settings)


def select(entries: list[Entry], names: list[str] | None) -> list[Entry]:
    if not names:
        return entries
    by_name = {e.name: e for e in entries}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise ConfigError(f"unknown benchmark {', '.join(unknown)}; valid names: {', '.join(by_name)}")
    return [by_name[n] for n in names]
