"""cnns profile (cnns.bench.opprofile): an update's time by op family, read from profiler traces."""

from __future__ import annotations

import textwrap

import pytest
import torch

from cnns import profiling
from cnns.bench.opprofile import FAMILIES, family_times, read_trace, split_convolution_backward
from cnns.cli.tools import profile_main
from cnns.engine.fusion import fused_norms


def _op(name, ts, dur, cat="cpu_op", tid=1):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid}


def _mark(name, ts, dur):
    return _op(name, ts, dur, cat="user_annotation")


def test_own_times_go_to_the_family_of_the_mark_then_the_name_then_the_parent():
    events = [
        _mark(profiling.UPDATE, 0, 1000),  # skipped: the first update is the warm-up
        _op("aten::convolution", 10, 500),
        _mark(profiling.UPDATE, 2000, 1000),
        _mark(profiling.DATA, 2000, 100), _op("aten::copy_", 2010, 50),  # the data's copy is data
        _op("aten::conv2d", 2100, 300), _op("aten::empty", 2110, 20),  # an empty inside a conv is the conv's
        _op("aten::mkldnn_convolution", 2150, 200),
        _op("autograd::engine::evaluate_function: ConvolutionBackward0", 2400, 200),
        _op("aten::convolution_backward", 2410, 180),
        _op("aten::native_batch_norm_backward", 2600, 100), _op("aten::relu_", 2700, 40),
        _mark(profiling.OPTIMISER, 2750, 200), _op("aten::add_", 2760, 100),  # an addition in the optimiser
        _op("_DepthwiseConvBackward", 2950, 10),  # cnns' routed depthwise backward: a convolution's, not "conv"
        _op("aten::add_", 2960, 10),  # an addition outside it: a gradient accumulation
        _op("aten::relu_", 2970, 10, tid=2),  # another thread: not this update's
    ]
    totals, wall, count = family_times(events, skip=1)
    assert (wall, count) == (1000, 1)
    assert totals["data"] == 100 and totals["convolution forward"] == 300
    assert totals["convolution backward"] == 210 and totals["normalisation backward"] == 100
    assert totals["activations"] == 40 and totals["optimiser"] == 200 and totals["additions"] == 10
    assert totals["other"] == 1000 - 960  # the time in no operator
    split = split_convolution_backward(totals, 0.2)
    assert split["convolution input-gradient"] == 42 and split["convolution weight-gradient"] == 168
    assert set(split) == set(FAMILIES) and sum(split.values()) == wall


def test_the_fused_passes_count_as_normalisation(tmp_path):
    from cnns.kernels import norm_act as kernels

    if not kernels.available():
        pytest.skip("the fused kernels were not built")
    # Large enough (8 MB) that the passes, not the profiler's and autograd's per-call costs, fill the update.
    x = torch.randn(16, 64, 32, 32).contiguous(memory_format=torch.channels_last).requires_grad_()
    weight, bias = torch.ones(64, requires_grad=True), torch.zeros(64, requires_grad=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            with profiling.marked(profiling.UPDATE):
                kernels.group_norm_act(x, 4, weight, bias, 1e-5, "silu").sum().backward()
    prof.export_chrome_trace(str(tmp_path / "x.pt.trace.json"))
    totals, wall, _ = family_times(read_trace(tmp_path))
    # The extension's calls and the layout views around them, inside the marks
    forward, backward = totals["normalisation forward"], totals["normalisation backward"]
    assert forward > 0 and backward > 0
    assert totals.get("activations", 0) == 0  # SiLU is inside the passes
    assert forward + backward > 0.5 * wall


def test_cnns_profile_breaks_both_loops_updates_down(tmp_path, capsys):
    spec = tmp_path / "tiny.yml"
    spec.write_text(textwrap.dedent("""\
        cifar10_images: 256
        benchmarks:
          - name: tiny
            command: >-
              train.py --model resnet --model-size 8 --dataset cifar-10 --data-dir {cifar10}
              --micro-batch-size 16 --iterations 20 --log-freq 1 --no-validation --ckpts-per-epoch 0
        """))
    assert profile_main(["--spec", str(spec), "--benchmark", "tiny", "--updates", "2",
                         "--output-dir", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    rows = {line[:28].strip(): line[28:].split() for line in printed.splitlines()
            if line[:28].strip() in FAMILIES + ("update",)}
    assert set(rows) == set(FAMILIES) | {"update"}, printed
    cnns_ms = {family: float(cells[0]) for family, cells in rows.items()}
    plain_ms = {family: float(cells[2]) for family, cells in rows.items()}
    # Where the norms are fused, cnns's ReLUs run inside the normalisation passes (and are counted there).
    fused = bool(fused_norms(torch.device("cpu")))
    for side in (cnns_ms, plain_ms):
        for family in ("convolution forward", "convolution weight-gradient", "convolution input-gradient",
                       "normalisation forward", "normalisation backward", "activations", "optimiser"):
            if not (family == "activations" and side is cnns_ms and fused):
                assert side[family] > 0, (family, printed)
        # every microsecond of an update is in one family (the table's rounding aside)
        assert sum(side[f] for f in FAMILIES) == pytest.approx(side["update"], abs=0.1 * len(FAMILIES))
    if fused:
        assert cnns_ms["activations"] == 0, printed
    assert plain_ms["data"] > 0  # the plain loop waits for its DataLoader's batches
    assert "mean of 2 updates after the first" in printed


def test_a_failing_or_hanging_side_is_one_line(tmp_path):
    import sys

    from cnns.bench.opprofile import run_profiled
    from cnns.errors import CnnsError

    with pytest.raises(CnnsError, match=r"exited with 3: boom \(log: "):
        run_profiled([sys.executable, "-c", "import sys; print('boom', file=sys.stderr); sys.exit(3)"], 60, {},
                     tmp_path / "a.log")
    assert "boom" in (tmp_path / "a.log").read_text()
    with pytest.raises(CnnsError, match="did not finish within 1 s"):
        run_profiled([sys.executable, "-c", "import time; time.sleep(30)"], 1, {}, tmp_path / "b.log")


def test_only_training_entries_are_profiled(tmp_path):
    from cnns.errors import ConfigError

    spec = tmp_path / "infer.yml"
    spec.write_text(textwrap.dedent("""\
        benchmarks:
          - name: infer
            command: validation.py --model resnet --model-size 8 --dataset cifar-10 --synthetic-data
        """))
    with pytest.raises(ConfigError, match="^benchmark infer: cnns profile takes training entries"):
        profile_main(["--spec", str(spec), "--benchmark", "infer", "--output-dir", str(tmp_path / "out")])
