"""The run's header says what the run does (issue 65): the precision the weights and the compute really have, the
rounding only where the weights are half, the device, the cadence, for each precision, on this CPU and on a CPU
whose bfloat16 is hidden (emulated: 16.x falls back to float32 unless --half-dtype insists).

Each run is built with --compile-only (everything set up, the header printed, nothing trained or written); the test takes the objects the run set
up (its model's weights, its policy's compute type, its optimiser, its length) and writes the header's words from
them by its own reading, then compares with log.txt.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import scripts

HALF_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def expected_precision(weights: torch.dtype, compute: torch.dtype, stochastic: bool) -> str:
    """Graphcore's compute.master name of what runs and its words, the rounding only for half weights."""
    if weights in HALF_NAMES:
        rounding = "stochastic rounding" if stochastic else "round to nearest"
        return f"16.16 ({HALF_NAMES[weights]} weights and compute, {rounding})"
    if compute in HALF_NAMES:
        return f"16.32 ({HALF_NAMES[compute]} compute, float32 master weights)"
    return "32.32 (float32)"


def hide_bfloat16(monkeypatch) -> None:
    """A CPU without AVX512-BF16 or AMX, as tests/test_precision.py hides them."""
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)


@pytest.mark.parametrize("cpu", ["this", "bfloat16 emulated"])
@pytest.mark.parametrize("options", [("--precision", "32.32"), ("--precision", "16.32"), ("--precision", "16.16"),
                                     ("--precision", "16.16", "--no-stochastic-rounding"),
                                     ("--precision", "16.16", "--half-dtype", "bfloat16"),
                                     ("--precision", "32.32", "--no-stochastic-rounding")])
def test_the_header_says_the_precision_the_run_applies(capfd, monkeypatch, cpu, options):
    from cnns.engine import setup as setup_module

    if cpu != "this":
        hide_bfloat16(monkeypatch)
    seen = []
    print_startup = setup_module.print_startup

    def kept(log, cfg, setup, notes):
        seen.append(setup)
        return print_startup(log, cfg, setup, notes)

    monkeypatch.setattr(setup_module, "print_startup", kept)
    log = scripts.run_here(capfd, "train.py", "--synthetic-data", "--dataset", "cifar-10", "--model-size", "8",
                           "--micro-batch-size", "4", "--iterations", "12", "--log-freq", "4", "--device-iterations",
                           "3", "--compile-only", "--device", "cpu", *options).stdout  # what log.txt would hold
    (setup,) = seen
    convolution = next(m for m in setup.plain_model.modules() if isinstance(m, nn.Conv2d))
    words = expected_precision(convolution.weight.dtype, setup.policy.compute_dtype,
                               setup.optimiser.stochastic_rounding)
    assert f"resnet-8 on cifar-10, device cpu, precision {words}\n" in log
    assert f"{setup.length.describe()}\n" in log and " step lines every 4 updates;" in log
    if convolution.weight.dtype == torch.float32:
        header = [line for line in log.split("Total Parameters")[0].splitlines()
                  if not line.startswith("Command line:")]  # the command line may say it
        assert header and header[0].startswith("resnet-8 on cifar-10")
        assert not any("rounding" in line for line in header)  # no rounding where nothing is rounded
    fell_back = cpu != "this" and "--half-dtype" not in options and options[1] != "32.32"
    assert ("this CPU has no bfloat16 arithmetic" in log) is fell_back
    if fell_back:
        assert words == "32.32 (float32)"
