"""Hand-written CPU kernels that no library has at speed (norm_act.cpp, depthwise.cpp, rounding.cpp, jpeg.cpp).

setup.py compiles each, when the package is installed, into a plain shared library with a C ABI: raw pointers
and sizes in, nothing of torch's or Python's headers (torch's were most of every build's compile time, and the
builds most of a fresh machine's set-up; docs/performance-history.md has the figures). This package loads them with ctypes; each kernel's module
declares its entry points' signatures, checks the tensors it hands them and allocates their results. On x86
the numeric kernels have two builds, AVX2 + FMA (x86-64-v3) and AVX-512 with AVX512-BF16 (x86-64-v4), and
the widest this CPU runs is chosen when a module is imported, so a machine that gains AVX-512 after the
install (a container moved to another host) runs the AVX-512 build, and one that loses it the AVX2 build.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
from dataclasses import dataclass
from pathlib import Path

import torch

_HERE = Path(__file__).resolve().parent

# The storage types the numeric kernels take, as their C entry points number them (vectors.h's Dtype).
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}

# ctypes argument types, named as the entry points' C declarations read.
POINTER = ctypes.c_void_p  # any data pointer (None for a null one)
INT64 = ctypes.c_int64
INT = ctypes.c_int
DOUBLE = ctypes.c_double


@dataclass(frozen=True)
class Library:
    """One compiled build of a kernel source: ``name`` as setup.py built it ("norm_act", "norm_act_avx512")."""

    name: str
    path: Path
    handle: ctypes.CDLL

    @property
    def instructions(self) -> str:
        """The vector instructions the build was compiled for, as a run's header names them."""
        if self.name.endswith("_avx512"):
            return "AVX-512"
        return "AVX2" if _x86() else "native"

    def entry(self, symbol: str, result, *arguments):
        """The C function ``symbol`` with its argument and result types declared (ctypes then converts Python
        ints and floats, and rejects anything else, instead of guessing). ctypes releases the GIL for the call."""
        function = getattr(self.handle, symbol)
        function.restype = result
        function.argtypes = list(arguments)
        return function


def _x86() -> bool:
    import platform

    return platform.machine() in ("x86_64", "AMD64")


def library_path(stem: str) -> Path | None:
    """The built shared library ``_<stem>`` beside this file (setup.py names it like an extension module)."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = _HERE / f"_{stem}{suffix}"
        if path.is_file():
            return path
    return None


def runnable_builds(name: str) -> list[Library]:
    """The builds of kernel ``name`` installed here that this CPU can run, the widest first (the AVX-512
    build also uses AVX512-BF16's conversions: it runs where the CPU has bfloat16 arithmetic)."""
    stems = [name]
    if torch.cpu._is_avx512_bf16_supported():
        stems.insert(0, f"{name}_avx512")
    builds = []
    for stem in stems:
        path = library_path(stem)
        if path is None:  # not built at install time (no compiler, no libjpeg headers)
            continue
        try:
            # torch is imported first (above), so the libgomp.so.1 the kernels link resolves to the one torch
            # loaded: one OpenMP runtime, one thread pool.
            builds.append(Library(stem, path, ctypes.CDLL(str(path))))
        except OSError:  # pragma: no cover - a build for another machine or Python left in the tree
            continue
    return builds


def load_build(name: str) -> Library | None:
    """The build of kernel ``name`` for this CPU (the AVX-512 one where it runs), or None where none was built."""
    builds = runnable_builds(name)
    return builds[0] if builds else None


def threads() -> int:
    """The threads every numeric kernel splits its work over: torch's, as torch.set_num_threads set them."""
    return torch.get_num_threads()


def address(tensor: torch.Tensor | None) -> int | None:
    """A tensor's data pointer for a C entry point (None: a null pointer)."""
    return None if tensor is None else tensor.data_ptr()


# The numeric kernels a CPU run may use, as the header names them.
NUMERIC_KERNELS = {"norm_act": "fused norms", "depthwise": "depthwise backward", "rounding": "stochastic rounding"}


def describe() -> str:
    """One line for a CPU run's header: which build of each numeric kernel this CPU runs, or that torch's own
    kernels stand in where one was not built (the run is then correct, only slower)."""
    chosen = {name: load_build(name) for name in NUMERIC_KERNELS}
    built = {name: build for name, build in chosen.items() if build is not None}
    missing = [NUMERIC_KERNELS[name] for name, build in chosen.items() if build is None]
    if not built:
        return ("CPU kernels: torch's own (cnns's C++ kernels are not built here: `pip install -e .` with a C++ "
                "compiler builds them)")
    groups: dict[str, list[str]] = {}
    for name, build in built.items():
        groups.setdefault(build.instructions, []).append(NUMERIC_KERNELS[name])
    parts = [f"cnns {isa} ({', '.join(names)})" for isa, names in groups.items()]
    if missing:
        parts.append(f"torch's own for {', '.join(missing)} (not built here)")
    return "CPU kernels: " + "; ".join(parts)
