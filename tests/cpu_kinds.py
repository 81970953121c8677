"""The CPU kinds whose precision differs (`cnns.precision.cpu_half_is_emulated`), for tests of runs of several
processes: bfloat16 native (AVX512-BF16 or AMX) or emulated (AVX2-only CPUs, where a run's default precision is
float32 and a run that insists on bfloat16 computes its convolutions with float32 kernels:
`cnns.engine.kernel_choice`).

The emulated kind is simulated on every CPU by answering torch's CPU-feature probes "no", in this process (the
launcher of a run of several processes, or the run itself) and, through a sitecustomize on PYTHONPATH, in every
worker it starts. The native kind runs only where the hardware is: simulating it on an AVX2-only CPU would emulate
bfloat16 arithmetic, many times float32's time.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

PROBES = ("_is_avx512_bf16_supported", "_is_amx_tile_supported", "_is_amx_fp16_supported")
EMULATED_PROBES = "import torch.cpu\n" + "".join(f"torch.cpu.{probe} = lambda: False\n" for probe in PROBES)


def bfloat16_is_native() -> bool:
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def skip_unless_native() -> None:
    if not bfloat16_is_native():
        pytest.skip("this CPU has no bfloat16 arithmetic; its own kind (emulated) is the other case")


def simulate_emulated_bfloat16(folder: Path, monkeypatch) -> None:
    """This process and every process it starts from now on (until monkeypatch undoes it) see a CPU without
    bfloat16 or float16 arithmetic. `folder` receives the workers' sitecustomize."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(EMULATED_PROBES)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")])))
    for probe in PROBES:
        monkeypatch.setattr(torch.cpu, probe, lambda: False)
