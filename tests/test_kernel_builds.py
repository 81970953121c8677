"""The C++ kernels as installed: plain C libraries (no torch header), the build this CPU runs chosen when loaded,
and a run's header naming what it uses, including where nothing was built."""

from __future__ import annotations

import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cnns import kernels
from cnns.kernels import depthwise, norm_act, rounding

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted((ROOT / "src" / "cnns" / "kernels").glob("*.cpp")) + sorted(
    (ROOT / "src" / "cnns" / "kernels").glob("*.h"))
X86 = platform.machine() in ("x86_64", "AMD64")


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_no_kernel_source_includes_torch_or_python(source):
    """torch's headers were most of a kernel's compile time, and the compiles most of a fresh
    machine's set-up: the kernels take raw pointers through a C ABI instead."""
    includes = re.findall(r"^\s*#\s*include\s*[<\"]([^>\"]+)[>\"]", source.read_text(), flags=re.M)
    heavy = [i for i in includes if i.split("/")[0] in ("torch", "ATen", "c10", "pybind11") or i == "Python.h"]
    assert heavy == []


@pytest.mark.parametrize("name", list(kernels.NUMERIC_KERNELS) + ["jpeg"])
def test_every_kernel_is_built_here(name):
    """setup.py builds every kernel on every machine with a C++ compiler (CI's included): the suite checks the
    kernels, not torch's stand-ins."""
    assert kernels.library_path(name) is not None, f"_{name} was not built (setup.py's compile failed?)"
    if X86 and name != "jpeg":
        assert kernels.library_path(f"{name}_avx512") is not None, f"_{name}_avx512 was not built"


def test_the_widest_build_this_cpu_runs_is_chosen(monkeypatch):
    """Both x86 builds are installed whatever CPU installed them, so a CPU that gains (or loses) AVX512-BF16
    after the install runs the build for it: chosen from the CPU at load time, not at install time."""
    if not X86:
        pytest.skip("one build off x86")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    assert [b.name for b in kernels.runnable_builds("norm_act")] == ["norm_act"]
    assert kernels.describe() == "CPU kernels: cnns AVX2 (fused norms, depthwise backward, stochastic rounding)"
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    assert [b.name for b in kernels.runnable_builds("norm_act")] == ["norm_act_avx512", "norm_act"]
    assert kernels.describe() == ("CPU kernels: cnns AVX-512 (fused norms, depthwise backward, "
                                  "stochastic rounding)")


def test_the_header_says_when_torchs_kernels_stand_in(monkeypatch):
    """Nothing built (no compiler at install time): the run is correct on torch's kernels and its header says so;
    one kernel missing: the others are named, and torch's stand-in for it."""
    original = kernels.library_path
    monkeypatch.setattr(kernels, "library_path", lambda stem: None)
    assert kernels.runnable_builds("norm_act") == []
    assert kernels.describe().startswith("CPU kernels: torch's own (cnns's C++ kernels are not built here")
    monkeypatch.setattr(kernels, "library_path",
                        lambda stem: None if stem.startswith("rounding") else original(stem))
    line = kernels.describe()
    assert line.endswith("; torch's own for stochastic rounding (not built here)")
    assert "fused norms, depthwise backward)" in line


def test_each_module_loaded_the_build_describe_names():
    chosen = kernels.load_build("norm_act").name
    assert norm_act._ext.name == chosen
    assert depthwise._ext.name == kernels.load_build("depthwise").name
    assert rounding._ext.name == kernels.load_build("rounding").name
    assert norm_act.wide_build() == chosen.endswith("_avx512")


def test_a_cpu_run_prints_its_kernels(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "train.py"), "--synthetic-data", "--dataset", "cifar-10",
                          "--model-size", "8", "--micro-batch-size", "4", "--iterations", "1", "--no-validation",
                          "--ckpts-per-epoch", "0", "--logs-path", str(tmp_path / "run")],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert kernels.describe() in lines
    assert (tmp_path / "run" / "log.txt").read_text().count(kernels.describe()) == 1
