"""Hand-written CPU kernels that no library has at speed (norm_act.cpp, depthwise.cpp, rounding.cpp), built when
the package is installed (setup.py: an AVX2 and an AVX-512 build of each on x86)."""

from __future__ import annotations

import importlib
from types import ModuleType

import torch


def runnable_builds(name: str) -> list[ModuleType]:
    """The builds of extension ``name`` installed here that this CPU can run, the widest first (the AVX-512
    build also uses AVX512-BF16's conversions: it runs where the CPU has bfloat16 arithmetic)."""
    candidates = [f"cnns.kernels._{name}"]
    if torch.cpu._is_avx512_bf16_supported():
        candidates.insert(0, f"cnns.kernels._{name}_avx512")
    builds = []
    for module in candidates:
        try:
            builds.append(importlib.import_module(module))
        except ImportError:  # pragma: no cover - depends on the installation (no compiler at install time)
            continue
    return builds


def load_build(name: str) -> ModuleType | None:
    """The build of extension ``name`` for this CPU (the AVX-512 one where it runs), or None where none was built."""
    builds = runnable_builds(name)
    return builds[0] if builds else None
