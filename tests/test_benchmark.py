"""cnns benchmark: reading the throughput a run recorded, the result files, and one tiny entry end to end.

No test asserts a speed: only that numbers are read, compared and written.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import json
from unittest import mock
import textwrap
from pathlib import Path

import pytest
import torch

from cnns.bench.results import Result, Side, format_table, set_peak_fractions, write_results
from cnns.bench.runner import mean_dropping_first, recorded_rates
from cnns.bench.benchmark_file import BACKENDS_KIND, load_spec, select
from cnns.cli.measure import benchmark_main as benchmark_command
from cnns.config import RunConfig
from cnns.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def _cuda_present(bfloat16: bool, count: int = 1):
    """torch.cuda as a machine with `count` GPUs reports it (with or without bfloat16 arithmetic)."""
    with mock.patch("torch.cuda.is_available", return_value=True), \
            mock.patch("torch.cuda.device_count", return_value=count), \
            mock.patch("torch.cuda.get_device_capability", return_value=(8, 0) if bfloat16 else (7, 0)):
        yield


def _plan(entry, cache_dir: Path = Path("/tmp/unused")):
    """An entry's plan, its command line parsed as `cnns benchmark` parses it."""
    from cnns.bench.runner import entry_command, plan_backends, plan_entry
    from cnns.cli.measure import script_options

    script, args = entry_command(entry, {"cifar10": "/nonexistent"})
    if entry.kind == BACKENDS_KIND:
        return plan_backends(entry, args, script_options(script, args), cache_dir)
    return plan_entry(entry, script, args, script_options(script, args))


def test_the_rates_are_read_from_the_run_folders_csv_as_the_engine_writes_it(tmp_path):
    from cnns.runfolder.log import RunLog

    log = RunLog(tmp_path)
    for iteration, rate in ((2, 10.5), (4, 1200.0), (6, 1400.0)):
        log.training_step({"step": iteration, "iteration": iteration, "epoch": 0.01 * iteration, "lr": 0.1,
                           "loss_batch": 2.3, "loss_avg": 2.3, "train_acc_batch": 10.0, "train_acc_avg": 10.0,
                           "it_time": 16 / rate, "img_per_sec": rate, "total_time": 1.0})
    assert recorded_rates(tmp_path / "training.csv") == [10.5, 1200.0, 1400.0]
    log.validation_result({"name": "random_init", "iteration": -1, "epoch": 0.0, "val_acc": 10.0, "raw_acc": 10.0,
                           "val_time": 0.1, "val_size": 300, "img_per_sec": 3000.0, "latency": 2.0, "val_top5": 50.0})
    assert recorded_rates(tmp_path / "validation.csv") == [3000.0]


def test_the_mean_drops_the_first_value_as_graphcores_instructions_say():
    assert mean_dropping_first([10.5, 1200.0, 1400.0]) == pytest.approx(1300.0)
    assert mean_dropping_first([42.0]) == 42.0  # a single value is all there is
    assert mean_dropping_first([]) is None


def _write_spec(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text))
    return path


def test_spec_loading_applies_defaults_and_selection_rejects_unknown_names(tmp_path):
    spec = _write_spec(tmp_path / "b.yml", """\
        defaults:
          timeout: 60
        benchmarks:
          - name: one
            command: train.py --iterations 2
          - name: two
            command: validation.py --synthetic-data
            baseline: false
        """)
    entries, _ = load_spec(spec)
    assert [(e.name, e.timeout, e.baseline) for e in entries] == [("one", 60, True), ("two", 60, False)]
    assert [e.name for e in select(entries, ["two"])] == ["two"]
    with pytest.raises(ConfigError, match="unknown benchmark nope; valid names: one, two"):
        select(entries, ["nope"])
    duplicate = _write_spec(tmp_path / "d.yml", "benchmarks:\n  - {name: a, command: x}\n  - {name: a, command: y}\n")
    with pytest.raises(ConfigError, match="duplicate"):
        load_spec(duplicate)
    with pytest.raises(ConfigError, match="not found"):
        load_spec(tmp_path / "missing.yml")


def _result(name: str, cnns: list[float], plain: list[float], pairs: list[float], **fields) -> Result:
    return Result(name, "train.py", sides={"cnns": Side(cnns), "plain": Side(plain, pairs)}, **fields)


def test_table_csv_and_json_hold_the_ratio_and_the_fraction_of_peak(tmp_path):
    result = _result("rn", [290.0, 300.0], [200.0], [1.45], model="resnet-8 32px", mode="train", data="synthetic",
                     batch_size=16, flops_per_image=3 * 1e8)
    failed = Result("broken", "train.py", error="cnns: exit 2: error: bad option")
    set_peak_fractions(result, 600.0)  # GFLOP/s
    assert result.sides["cnns"].images_per_sec == 300.0 and result.sides["plain"].ratio == 1.45
    assert result.sides["cnns"].peak_fraction == pytest.approx(300 * 3e8 / 600e9)
    assert result.sides["plain"].peak_fraction == pytest.approx(200 * 3e8 / 600e9)

    table = format_table([result, failed], {"cpu": 600.0})
    assert "1.45x" in table and "15.0%" in table and "10.0%" in table
    assert "broken: cnns: exit 2" in table
    assert "per repeat" not in table  # one pair: nothing to compare

    repeated = _result("rn2", [300.0, 330.0], [250.0, 220.0], [1.2, 1.5])
    assert repeated.sides["plain"].ratio == pytest.approx(1.35)  # the median of the pairs, not best over best
    assert "vs plain per repeat" in format_table([repeated, failed], {"cpu": 600.0})
    assert "1.20 1.50" in format_table([repeated, failed], {"cpu": 600.0})

    csv_path, json_path = write_results([result, failed], {"peak_bf16_matmul_gflops": 600.0}, tmp_path, "results")
    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["name"] for r in rows] == ["rn", "broken"]
    assert float(rows[0]["plain_ratio"]) == 1.45 and rows[0]["cnns_runs"] == "290.000 300.000"
    assert rows[0]["plain_pair_ratios"] == "1.450" and rows[0]["baseline_modes"] == "eager"
    document = json.loads(json_path.read_text())
    assert document["peak_bf16_matmul_gflops"] == 600.0
    assert document["results"][0]["plain_images_per_sec"] == 200.0
    assert document["results"][0]["plain_pair_ratios"] == [1.45]
    assert document["results"][1]["error"].startswith("cnns: exit 2")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with a GPU runs the GPU entry")
def test_a_tiny_cifar_benchmark_runs_both_loops_end_to_end_and_skips_a_gpu_entry_with_one_line(tmp_path, capsys):
    spec = _write_spec(tmp_path / "tiny.yml", GPU_AND_CPU)
    out_dir = tmp_path / "results"
    code = benchmark_command(["--spec", str(spec), "--output-dir", str(out_dir)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "tiny-cpu" in printed and "ratio" in printed
    assert "tiny-gpu: skipped, needs cuda; this machine has 0 CUDA GPUs" in printed
    [json_path] = out_dir.glob("tiny-*/results.json")
    document = json.loads(json_path.read_text())
    assert document["skipped"] == {"tiny-gpu": "needs cuda; this machine has 0 CUDA GPUs"}
    [row] = document["results"]
    assert row["name"] == "tiny-cpu"
    assert row["error"] is None
    assert row["cnns_images_per_sec"] > 0 and row["plain_images_per_sec"] > 0
    assert row["plain_ratio"] == pytest.approx(row["cnns_images_per_sec"] / row["plain_images_per_sec"])
    assert 0 < row["cnns_peak_fraction"] and row["flops_per_image"] > 0
    # The roofline's images/s bounds what either loop can reach (no fused operators in a ResNet-8 run).
    assert 0 < row["cnns_roofline_fraction"] < 1 and 0 < row["plain_roofline_fraction"] < 1
    assert row["cnns_roofline_fraction"] == pytest.approx(row["cnns_images_per_sec"] / row["roofline_images_per_sec"])
    assert (json_path.parent / "results.csv").is_file()
    # The generated CIFAR-10 folder, and each run's folder and output, are kept beside the results; the rate is
    # the mean of the recorded intervals after the first, in both loops' files.
    assert (out_dir / "data" / "cifar10-256" / "data_batch_1.bin").is_file()
    runs = json_path.parent / "runs"
    assert sorted(p.name for p in runs.iterdir()) == [
        "tiny-cpu-cnns-1", "tiny-cpu-cnns-1.log", "tiny-cpu-plain-1", "tiny-cpu-plain-1.log"]
    for side in ("cnns", "plain"):
        rates = recorded_rates(runs / f"tiny-cpu-{side}-1" / "training.csv")
        assert len(rates) == 4 and row[f"{side}_images_per_sec"] == pytest.approx(sum(rates[1:]) / 3)
    assert not list(runs.rglob("*.pt"))  # the checkpoints go unless --keep-runs


def test_the_repository_spec_lists_graphcores_benchmarks_and_parses():
    entries, document = load_spec(ROOT / "benchmarks.yml")
    names = {e.name for e in entries}
    for wanted in ("resnet50-train-synthetic", "resnext101-train-synthetic", "efficientnet-b0-train-synthetic",
                   "efficientnet-b4-train-synthetic", "resnet20-cifar10-train", "resnet50-infer-synthetic",
                   "resnet50-infer-generated"):
        assert wanted in names
    for entry in entries:  # every command line is accepted and resolves to a plain-loop twin
        if entry.kind == BACKENDS_KIND:
            continue
        with _cuda_present(bfloat16=True) if entry.device != "cpu" else contextlib.nullcontext():
            plan = _plan(entry)
        assert plan.baseline["batch_size"] == plan.batch_size > 0
        assert plan.baseline["device"] == plan.device == entry.device and plan.argv[-2:] == ["--device", entry.device]
    gpu = {e.name: e for e in entries if e.device == "cuda"}
    assert set(gpu) == {
        "resnet50-train-synthetic-gpu", "resnet50-train-synthetic-gn-gpu", "resnet50-train-synthetic-gn-gpu-eager",
        "efficientnet-b0-train-synthetic-gpu", "efficientnet-b0-train-synthetic-gn-gpu", "resnet20-cifar10-train-gpu",
        "resnet50-infer-synthetic-gpu"}
    # The GPU entries benchmarks.yml promises: batch 256 for ImageNet, 512 for ResNet-20, each beside
    # the plain loop eager and compiled; ResNet-50 group norm also with cnns eager.
    with _cuda_present(bfloat16=True):
        gpu_plans = {name: _plan(entry) for name, entry in gpu.items()}
    assert {(p.model_spec.arch, p.model_spec.size, p.model_spec.norm, p.mode, p.batch_size)
            for p in gpu_plans.values()} == {
        ("resnet", "50", "batch", "train", 256), ("resnet", "50", "group", "train", 256),
        ("efficientnet", "B0", "batch", "train", 256), ("efficientnet", "B0", "group", "train", 256),
        ("resnet", "20", "batch", "train", 512), ("resnet", "50", "batch", "infer", 256)}
    assert all(p.baseline_modes == ("eager", "compiled") for p in gpu_plans.values())
    assert gpu_plans["resnet20-cifar10-train-gpu"].data == "cifar"
    assert [n for n, p in gpu_plans.items() if "--no-compile" in p.argv] == ["resnet50-train-synthetic-gn-gpu-eager"]
    assert all(e.baseline_modes == ("eager",) for e in entries if e.device == "cpu" and e.kind != BACKENDS_KIND)
    # The backend comparison benchmarks.yml promises: ResNet-50 and EfficientNet-B0 at batch 1 and 32, 224 px, all backends.
    backends = {e.name: _plan(e) for e in entries if e.kind == BACKENDS_KIND}
    assert {(p.model_label, p.batch_size) for p in backends.values()} == {
        ("resnet-50 224px", 1), ("resnet-50 224px", 32), ("efficientnet-B0 224px", 1), ("efficientnet-B0 224px", 32)}
    for plan in backends.values():
        assert {"eager", "aoti", "onnxruntime", "eager-bf16"} <= set(plan.spec["backends"])
        assert RunConfig.from_options(plan.spec["options"]).model.norm == "batch"  # the tables' models


def test_the_ratio_is_the_median_of_adjacent_pairs_not_best_over_best(tmp_path, monkeypatch):
    from cnns.bench import runner

    entries, _ = load_spec(ROOT / "benchmarks.yml")
    [entry] = select(entries, ["resnet20-cifar10-train"])
    plan = _plan(entry)
    # The host sped up during the last repeat (best over best, 468/367 = 1.27, would pair two moments),
    # and in the first repeat our side failed: its plain run must not pair with a later cnns run.
    # Repeats alternate the order: cnns, plain | plain, cnns | cnns, plain | plain, cnns.
    scripted = iter([(None, "exit 1: boom"), (300.0, ""), (337.0, ""), (468.0, ""),
                     (405.0, ""), (357.0, ""), (367.0, ""), (328.0, "")])
    monkeypatch.setattr(runner, "run_and_read", lambda argv, timeout, log_path, measurements: next(scripted))
    result = runner.run_entry(entry, plan, ROOT, repeats=4, with_baseline=True, folder=tmp_path)
    assert result.sides["plain"].pair_ratios == pytest.approx([468 / 337, 405 / 357, 328 / 367])
    assert result.sides["plain"].ratio == pytest.approx(405 / 357)
    assert result.images_per_sec("cnns") == 468.0 and result.images_per_sec("plain") == 367.0
    assert result.error == "cnns: exit 1: boom"


# ------------------------------------------------------------------------------------------------
# where an entry runs: `device:` (cpu by default, cuda for the GPU entries)

GPU_AND_CPU = """\
    cifar10_images: 256
    benchmarks:
      - name: tiny-cpu
        command: >-
          train.py --model resnet --model-size 8 --dataset cifar-10 --data-dir {cifar10}
          --micro-batch-size 16 --iterations 4 --log-freq 1 --no-validation --ckpts-per-epoch 0
      - name: tiny-gpu
        device: cuda
        command: >-
          train.py --model resnet --model-size 8 --dataset cifar-10 --data-dir {cifar10}
          --micro-batch-size 16 --iterations 4 --log-freq 1 --no-validation --ckpts-per-epoch 0
    """


def test_cpu_entries_stay_on_the_cpu_and_gpu_entries_compute_in_the_gpus_half_type(tmp_path):
    entries, _ = load_spec(_write_spec(tmp_path / "spec.yml", GPU_AND_CPU))
    cpu, gpu = entries
    assert (cpu.device, gpu.device) == ("cpu", "cuda")
    with _cuda_present(bfloat16=True):  # on a machine with a GPU, the CPU entry still runs on the CPU
        plan = _plan(cpu)
    assert plan.argv[-2:] == ["--device", "cpu"] and plan.baseline["device"] == "cpu"
    for bfloat16, half in ((True, torch.bfloat16), (False, torch.float16)):
        with _cuda_present(bfloat16=bfloat16):
            plan = _plan(gpu)
        assert plan.argv[-2:] == ["--device", "cuda"] and plan.baseline["device"] == plan.device == "cuda"
        assert plan.activation_dtype == half and plan.model_label.endswith("on cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with a GPU runs the GPU entry")
def test_naming_only_gpu_entries_where_there_is_none_is_one_line(tmp_path):
    # (A GPU entry skipped beside a CPU entry that runs: test_a_tiny_cifar_benchmark_runs_both_loops_end_to_end_...)
    spec = _write_spec(tmp_path / "spec.yml", GPU_AND_CPU)
    out_dir = tmp_path / "results"
    with pytest.raises(ConfigError, match="nothing to run here: benchmark tiny-gpu needs cuda"):
        benchmark_command(["--spec", str(spec), "--benchmark", "tiny-gpu", "--output-dir", str(out_dir)])
    # A GPU that is not there is the same.
    with _cuda_present(bfloat16=True, count=1), pytest.raises(ConfigError, match="needs cuda:1; this machine has 1"):
        benchmark_command(["--spec", str(_write_spec(tmp_path / "second.yml", GPU_AND_CPU.replace(
            "device: cuda", "device: cuda:1"))), "--benchmark", "tiny-gpu", "--output-dir", str(out_dir)])


def test_where_an_entry_runs_is_its_device_key_and_nothing_else(tmp_path):
    with pytest.raises(ConfigError, match="benchmark tiny-gpu has device 'tpu'; use cpu, cuda or cuda:N"):
        load_spec(_write_spec(tmp_path / "bad.yml", GPU_AND_CPU.replace("device: cuda", "device: tpu")))
    entries, _ = load_spec(_write_spec(tmp_path / "cli.yml", GPU_AND_CPU.replace(
        "--ckpts-per-epoch 0", "--ckpts-per-epoch 0 --device cuda")))
    with pytest.raises(ConfigError, match="benchmark tiny-cpu: say where it runs with the entry's device: key"):
        _plan(entries[0])


# ------------------------------------------------------------------------------------------------
# the plain loop eager and compiled: `baseline_modes` (eager on the CPU, eager and compiled on a GPU)


def test_baseline_modes_default_by_device_and_a_wrong_mode_is_one_line(tmp_path):
    entries, _ = load_spec(_write_spec(tmp_path / "spec.yml", GPU_AND_CPU))
    assert [e.baseline_modes for e in entries] == [("eager",), ("eager", "compiled")]
    chosen = GPU_AND_CPU.replace("- name: tiny-gpu", "- name: tiny-gpu\n        baseline_modes: [compiled]")
    chosen = chosen.replace("- name: tiny-cpu", "- name: tiny-cpu\n        baseline_modes: [eager, compiled]")
    entries, _ = load_spec(_write_spec(tmp_path / "chosen.yml", chosen))
    assert [e.baseline_modes for e in entries] == [("eager", "compiled"), ("compiled",)]
    with pytest.raises(ConfigError, match=r"benchmark tiny-gpu has baseline mode 'jit'; valid modes: eager, compiled$"):
        load_spec(_write_spec(tmp_path / "bad.yml", chosen.replace("[compiled]", "[eager, jit]")))
    with pytest.raises(ConfigError, match="baseline_modes must be a list of eager, compiled"):
        load_spec(_write_spec(tmp_path / "empty.yml", chosen.replace("[compiled]", "[]")))


def _scripted_runs(monkeypatch, values):
    """run_and_read answering `values` in turn, recording which plain-loop mode each run was (None: cnns)."""
    from cnns.bench import runner

    calls, answers = [], iter(values)

    def run_and_read(argv, timeout, log_path, measurements):
        plain = argv[1:3] == ["-m", "cnns.bench.baseline"]
        calls.append(("compiled" if json.loads(argv[3])["compile"] else "eager") if plain else None)
        return next(answers), ""

    monkeypatch.setattr(runner, "run_and_read", run_and_read)
    return calls


def test_a_gpu_entry_runs_the_plain_loop_eager_and_compiled_beside_cnns(tmp_path, monkeypatch):
    from cnns.bench import runner

    cpu, gpu = load_spec(_write_spec(tmp_path / "spec.yml", GPU_AND_CPU))[0]
    with _cuda_present(bfloat16=True):
        plan = _plan(gpu)
    assert plan.baseline_modes == ("eager", "compiled")
    assert plan.baseline_for("eager")["compile"] is False and plan.baseline_for("compiled")["compile"] is True
    assert plan.baseline_for("compiled") == {**plan.baseline, "compile": True, "log_dir": None}  # the same loop
    assert 2 <= plan.baseline["workers"] <= 8
    # Two repeats, alternating: cnns, eager, compiled | compiled, eager, cnns.
    calls = _scripted_runs(monkeypatch, [1000.0, 500.0, 800.0, 850.0, 520.0, 1040.0])
    result = runner.run_entry(gpu, plan, ROOT, repeats=2, with_baseline=True, folder=tmp_path)
    assert calls == [None, "eager", "compiled", "compiled", "eager", None]
    assert list(result.sides) == ["cnns", "plain", "plain_compiled"] and result.error is None
    plain, compiled = result.sides["plain"], result.sides["plain_compiled"]
    assert plain.runs == [500.0, 520.0] and compiled.runs == [800.0, 850.0]
    assert plain.images_per_sec == 520.0 and compiled.images_per_sec == 850.0
    assert plain.pair_ratios == pytest.approx([2.0, 2.0]) and plain.ratio == pytest.approx(2.0)
    assert compiled.pair_ratios == pytest.approx([1.25, 1040 / 850])
    assert compiled.ratio == pytest.approx((1.25 + 1040 / 850) / 2)
    assert '"compile": true' in result.baseline_command and '"compile": false' in result.baseline_command
    # A CPU entry runs the plain loop once, eagerly, as before; --no-baseline runs neither.
    calls = _scripted_runs(monkeypatch, [300.0, 200.0])
    result = runner.run_entry(cpu, _plan(cpu), ROOT, repeats=1, with_baseline=True, folder=tmp_path)
    assert calls == [None, "eager"] and result.sides["plain"].ratio == 1.5 and "plain_compiled" not in result.sides
    assert _plan(cpu).baseline["workers"] == 2
    calls = _scripted_runs(monkeypatch, [1000.0])
    result = runner.run_entry(gpu, plan, ROOT, repeats=1, with_baseline=False, folder=tmp_path)
    assert calls == [None] and list(result.sides) == ["cnns"]


def _tiny_baseline(**fields) -> str:
    model = {"arch": "resnet", "size": "8", "num_classes": 10, "image_size": 32, "norm": "batch", "groups": 1,
             "group_dim": 1, "expand_ratio": 1, "convolution_groups": 1}
    spec = {"mode": "train", "model": model, "batch_size": 4,
            "data": "synthetic", "iterations": 2, "log_freq": 1, "workers": 0, **fields}
    return json.dumps(spec)


@pytest.mark.parametrize("mode", ["train", "infer"])
def test_the_baseline_compiles_the_plain_model_when_its_spec_says_so(monkeypatch, capsys, tmp_path, mode):
    # A real torch.compile of even a CIFAR ResNet-8 takes far longer than the loop: the model handed to torch.compile
    # is recorded instead, and the loop runs what it returns.
    from cnns.bench import baseline

    compiled = []

    def fake_compile(model, **kwargs):
        compiled.append((model, kwargs))
        return model

    monkeypatch.setattr(torch, "compile", fake_compile)
    assert baseline.main([_tiny_baseline(mode=mode)]) == 0
    assert compiled == []  # eager: as written
    capsys.readouterr()
    assert baseline.main([_tiny_baseline(mode=mode, compile=True, log_dir=str(tmp_path))]) == 0
    [(model, kwargs)] = compiled
    assert kwargs == {}  # the default mode, as a user writes it
    assert model.training == (mode == "train")  # compiled in the mode it runs in
    assert next(model.parameters()).dtype == torch.float32
    assert any(p.dim() == 4 and p.is_contiguous(memory_format=torch.channels_last) and not p.is_contiguous()
               for p in model.parameters())
    printed = capsys.readouterr().out
    assert "plain loop: torch.compile(model), default mode" in printed
    # one row per interval (2 iterations at log_freq 1; 1 inference pass), in the file a cnns run folder has
    rates = recorded_rates(tmp_path / ("training.csv" if mode == "train" else "validation.csv"))
    assert len(rates) == (2 if mode == "train" else 1) and all(rate > 0 for rate in rates)


def test_the_plain_loop_on_a_gpu_autocasts_to_bfloat16_where_it_computes_it():
    from cnns.bench.baseline import autocast_dtype

    for bfloat16, half in ((True, torch.bfloat16), (False, torch.float16)):
        with _cuda_present(bfloat16=bfloat16):
            assert autocast_dtype(torch.device("cuda")) == half


def test_table_csv_and_json_hold_both_plain_loops_and_their_ratios(tmp_path):
    gpu = Result("g", "train.py", model="resnet-50 224px on cuda", mode="train", data="synthetic", batch_size=256,
                 device="cuda", flops_per_image=3 * 4.1e9,
                 sides={"cnns": Side([5500.0]), "plain": Side([3900.0], [5500 / 3900]),
                        "plain_compiled": Side([5000.0], [1.1])})
    cpu = _result("c", [300.0], [200.0], [1.5], model="resnet-20 32px", mode="train")
    set_peak_fractions(gpu, 500_000.0)
    assert gpu.sides["plain_compiled"].peak_fraction == pytest.approx(5000 * 3 * 4.1e9 / 500e12)

    assert "compiled" not in format_table([cpu], {"cpu": 600.0})  # CPU entries: no compiled columns
    table = format_table([gpu, cpu], {"cpu": 600.0, "cuda": 500_000.0}, {"cpu": 40.0, "cuda": 3000.0})
    header, _, gpu_row, cpu_row = table.splitlines()[:4]
    columns = [c.strip() for c in header.split(" | ")]
    assert columns[5:10] == ["cnns img/s", "plain img/s", "vs plain", "compiled img/s", "vs compiled"]
    assert [c.strip() for c in gpu_row.split(" | ")][5:10] == ["5500.00", "3900.00", "1.41x", "5000.00", "1.10x"]
    assert [c.strip() for c in cpu_row.split(" | ")][5:10] == ["300.00", "200.00", "1.50x", "-", "-"]
    assert "torch.compile(model)" in table
    # The footer names each device's own peak and bandwidth, the ones its entries' fractions use.
    assert "(bfloat16 or float32): cpu 600.0 GFLOP/s, cuda 500000.0 GFLOP/s;" in table
    assert "stream triad bandwidth: cpu 40.0 GB/s, cuda 3000.0 GB/s)" in table
    assert "cuda" not in format_table([cpu], {"cpu": 600.0, "cuda": 500_000.0})

    csv_path, json_path = write_results([gpu, cpu], {}, tmp_path, "results")
    with open(csv_path, newline="") as f:
        rows = {r["name"]: r for r in csv.DictReader(f)}
    assert float(rows["g"]["plain_images_per_sec"]) == 3900.0
    assert float(rows["g"]["plain_ratio"]) == pytest.approx(5500 / 3900)
    assert float(rows["g"]["plain_compiled_images_per_sec"]) == 5000.0 and float(rows["g"]["plain_compiled_ratio"]) == 1.1
    assert rows["g"]["baseline_modes"] == "eager compiled" and rows["g"]["plain_compiled_runs"] == "5000.000"
    assert rows["c"]["baseline_modes"] == "eager" and rows["c"]["plain_compiled_images_per_sec"] == ""
    [g, c] = json.loads(json_path.read_text())["results"]
    assert (g["plain_images_per_sec"], g["plain_compiled_images_per_sec"], g["plain_compiled_ratio"]) == (
        3900.0, 5000.0, 1.1)
    assert g["plain_compiled_pair_ratios"] == [1.1] and "plain_compiled_ratio" not in c


# ------------------------------------------------------------------------------------------------
# inference backends: eager vs AOTInductor vs onnxruntime (cnns.bench.backends, kind: inference-backends)

TINY_BACKENDS = ("eager", "eager-bf16", "aoti", "onnxruntime")


# The tests sharing backend_folder go to one test worker, which compiles the tiny model's artefacts once.
SHARED_BACKEND_CACHE = pytest.mark.xdist_group("test_benchmark-backend-cache")


@pytest.fixture(scope="module")
def backend_folder(tmp_path_factory):
    """One folder for the module: the runner test below finds the tiny model's compiled artefacts in its
    backend-cache, made by the measurement test."""
    return tmp_path_factory.mktemp("backends")


TINY_COMMAND = "inference_embedded.py --model resnet --model-size 8 --dataset cifar-10 --micro-batch-size 2"


def _tiny_config(iterations: int):
    """ResNet-8 on 32 px images at batch 2, as inference_embedded.py resolves it."""
    from cnns.cli.parsing import resolve_command_line

    return resolve_command_line("infer", [*TINY_COMMAND.split()[1:], "--iterations", str(iterations)]).config


@SHARED_BACKEND_CACHE
def test_every_backend_measures_the_same_model_and_their_logits_agree(backend_folder):
    from cnns.bench.backends import cache_key, inference_module, measure_backends
    from cnns.deploy.graphs import load_compiled
    from cnns.precision import cpu_half_is_emulated

    lines = []
    cfg = _tiny_config(iterations=4)
    results = measure_backends(cfg, backends=TINY_BACKENDS, warmup=1, threads=2,
                               cache_dir=backend_folder / "backend-cache", rounds=2, log=lines.append)
    assert [r.backend for r in results] == list(TINY_BACKENDS)
    emulated = cpu_half_is_emulated(torch.device("cpu"), torch.bfloat16)
    for r in results:
        assert r.error is None, r.error
        if r.backend == "eager-bf16" and emulated:
            assert r.skipped and r.images_per_sec is None
            continue
        assert r.iterations == 4 and r.threads == 2 and r.batch_size == 2
        assert r.images_per_sec > 0 and 0 < r.latency_avg_ms <= r.latency_max_ms and r.latency_p99_ms > 0
        assert r.ratio_vs_eager > 0
    by_name = {r.backend: r for r in results}
    assert by_name["eager"].ratio_vs_eager == 1.0 and by_name["eager"].compile_s is None
    for name in ("aoti", "onnxruntime"):
        assert by_name[name].compile_s > 0 and not by_name[name].cached and by_name[name].max_abs_diff <= 1e-4
        assert by_name[name].max_rel_diff <= 1e-3
    # The comparison is fair only if the three float32 backends compute the same function: check the
    # cached files again, independently, on a fresh batch, against the model inference_embedded.py compiles.
    folder = backend_folder / "backend-cache" / cache_key(cfg)
    images = torch.randint(0, 256, (2, 32, 32, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        eager = inference_module(cfg, "eager")(images)
    for backend, file in (("aoti", "aoti.pt2"), ("onnxruntime", "model.onnx")):
        logits = load_compiled(folder / file, threads=2)(images)
        assert logits.shape == eager.shape == (2, 10)
        assert torch.allclose(logits, eager, atol=1e-4, rtol=0), backend
    assert any("images/s" in line for line in lines)


def test_every_backend_runs_the_model_inference_embedded_compiles():
    """The one assembly: a backend's module is `build_inference_model`'s at the backend's precision, the same
    random weights for every backend."""
    from cnns.bench.backends import inference_module
    from cnns.deploy.restored_model import build_inference_model

    cfg = _tiny_config(iterations=1)
    torch.manual_seed(0)  # inference_embedded.py's --seed 0 of random weights
    at_32 = dataclasses.replace(cfg, precision=dataclasses.replace(cfg.precision, precision="32.32"))
    embedded = build_inference_model(at_32, None, torch.device("cpu"))
    float32, bfloat16 = inference_module(cfg, "eager"), inference_module(cfg, "aoti-bf16")
    assert [type(m) for m in float32.modules()] == [type(m) for m in embedded.modules()]
    assert float32.dtype == torch.float32 and bfloat16.dtype == torch.bfloat16
    for name, weight in embedded.state_dict().items():
        assert torch.equal(float32.state_dict()[name], weight), name
        assert torch.equal(bfloat16.state_dict()[name], weight.to(bfloat16.state_dict()[name].dtype)), name


@SHARED_BACKEND_CACHE
def test_a_backend_that_computes_something_else_is_an_error_and_the_others_still_count(backend_folder, monkeypatch):
    from cnns.bench import backends

    real = backends.load_compiled
    monkeypatch.setattr(backends, "load_compiled",
                        lambda path, threads: (lambda images: real(path, threads=threads)(images) + 0.5))
    eager, onnx = backends.measure_backends(_tiny_config(iterations=2), backends=("eager", "onnxruntime"), warmup=0,
                                            cache_dir=backend_folder / "backend-cache")
    assert eager.error is None and eager.images_per_sec > 0 and eager.max_rel_diff == 0.0
    assert onnx.images_per_sec is None and "not the same computation" in onnx.error
    assert onnx.max_abs_diff == pytest.approx(0.5) and not onnx.cached  # a cached file that disagrees is made again
    assert torch.get_num_threads() > 0


def test_an_unknown_backend_is_refused():
    from cnns.bench.backends import measure_backends

    with pytest.raises(ValueError, match="unknown backend tensorrt"):
        measure_backends(_tiny_config(iterations=1), backends=("eager", "tensorrt"))


@SHARED_BACKEND_CACHE
def test_an_inference_backends_entry_runs_in_the_benchmark_and_prints_its_table(backend_folder, capsys, monkeypatch):
    from cnns.bench import rates

    monkeypatch.setattr(rates, "peak_rate", lambda device: (100.0, {"bfloat16": 50.0, "float32": 100.0}))
    spec = _write_spec(backend_folder / "tiny-backends.yml", f"""\
        benchmarks:
          - name: tiny-resnet8-backends
            kind: inference-backends
            command: {TINY_COMMAND} --iterations 3
            warmup: 1
            threads: 2
            backends: [eager, aoti, onnxruntime]
        """)
    assert benchmark_command(["--spec", str(spec), "--list"]) == 0
    assert capsys.readouterr().out == (f"tiny-resnet8-backends: {TINY_COMMAND} --iterations 3 "
                                       "[backends: eager, aoti, onnxruntime]\n")
    code = benchmark_command(["--spec", str(spec), "--output-dir", str(backend_folder)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "cnns img/s" not in printed  # no command entries: only the backends table
    for words in ("backend", "latency avg ms", "p99 ms", "vs eager", "compile s", "eager float32",
                  "AOTInductor float32", "onnxruntime float32", "tiny-resnet8-backends: fastest"):
        assert words in printed, words
    [json_path] = backend_folder.glob("tiny-backends-*/results.json")
    [row] = json.loads(json_path.read_text())["results"]
    assert row["kind"] == "inference-backends" and row["error"] is None and row["batch_size"] == 2
    assert row["command"].startswith(TINY_COMMAND + " --iterations 3 --device cpu (backends: eager, aoti")
    assert [b["backend"] for b in row["backends"]] == ["eager", "aoti", "onnxruntime"]
    for b in row["backends"]:
        assert b["images_per_sec"] > 0 and b["latency_p99_ms"] > 0 and b["runs"] == [b["images_per_sec"]]
        assert b["iterations"] == 3 and (b["backend"] == "eager" or b["max_abs_diff"] <= 1e-4)
    with open(json_path.parent / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["name"], r["backend"]) for r in rows] == [("tiny-resnet8-backends", b)
                                                         for b in ("eager", "aoti", "onnxruntime")]
    assert all(float(r["images_per_sec"]) > 0 and r["kind"] == "inference-backends" for r in rows)
    assert (json_path.parent / "runs" / "tiny-resnet8-backends-backends-1.log").is_file()
    # The compiled artefacts are kept in <output-dir>/backend-cache and a second run loads them.
    assert list((backend_folder / "backend-cache").glob("resnet8-32px-bs2-*/aoti.pt2"))


def test_inference_backends_entries_are_checked_before_anything_runs(tmp_path):
    spec = _write_spec(tmp_path / "b.yml", f"""\
        defaults:
          timeout: 99
        benchmarks:
          - {{name: ok, kind: inference-backends, command: {TINY_COMMAND}}}
          - {{name: typo, kind: inference-backends, command: {TINY_COMMAND}, iteration: 3}}
        """)
    with pytest.raises(ConfigError, match="typo: iteration not understood"):
        load_spec(spec)
    spec.write_text(spec.read_text().replace("iteration: 3", "backends: [eager, tensorrt]"))
    entries, _ = load_spec(spec)
    assert entries[0].timeout == 99 and entries[0].kind == "inference-backends" and not entries[0].baseline
    plan = _plan(entries[0], tmp_path)
    assert plan.spec["backends"] == ["eager", "aoti", "onnxruntime"] and plan.model_label == "resnet-8 32px"
    with pytest.raises(ConfigError, match="unknown backend tensorrt"):
        _plan(entries[1], tmp_path)
    for bad, message in ((f"{{name: p, kind: inference-backends, command: {TINY_COMMAND} --precision 32.32}}",
                          "says its precision"),
                         ("{name: t, kind: inference-backends, command: train.py --model resnet}",
                          "must start with inference_embedded.py"),
                         (f"{{name: d, kind: inference-backends, command: {TINY_COMMAND}, device: cuda}}",
                          "run on the CPU"),
                         (f"{{name: w, kind: inference-backends, command: {TINY_COMMAND}, warmup: -1}}",
                          "warmup must be an integer of at least 0"),
                         ("{name: k, kind: nonsense, command: x}", "valid kinds")):
        spec.write_text(f"benchmarks:\n  - {bad}\n")
        with pytest.raises(ConfigError, match=message):
            entries, _ = load_spec(spec)
            _plan(entries[0], tmp_path)


def test_backend_repeats_keep_the_best_run_and_the_median_ratio():
    from cnns.bench.results import entry_failed, format_backends_table
    from cnns.bench.runner import combine_backend_runs

    def row(backend, ips, ratio, compile_s=None, cached=False, **extra):
        return {"backend": backend, "label": backend, "images_per_sec": ips,
                "latency_avg_ms": 1000 / ips if ips else None, "latency_p99_ms": 2000 / ips if ips else None, "ratio_vs_eager": ratio, "compile_s": compile_s,
                "cached": cached, "max_abs_diff": 0.0, "error": None, "skipped": None, **extra}

    runs = [{"eager": row("eager", 10.0, 1.0), "aoti": row("aoti", 12.0, 1.2, 30.0, False),
             "eager-bf16": row("eager-bf16", None, None, skipped="emulated")},
            {"eager": row("eager", 8.0, 1.0), "aoti": row("aoti", 11.0, 1.375, 30.0, True),
             "eager-bf16": row("eager-bf16", None, None, skipped="emulated")},
            {"eager": row("eager", 9.0, 1.0), "aoti": row("aoti", 9.9, 1.1, 30.0, True),
             "eager-bf16": row("eager-bf16", None, None, skipped="emulated")}]
    eager, aoti, bf16 = combine_backend_runs(["eager", "aoti", "eager-bf16"], runs)
    assert eager["images_per_sec"] == 10.0 and eager["runs"] == [10.0, 8.0, 9.0]
    assert aoti["images_per_sec"] == 12.0 and aoti["ratio_vs_eager"] == 1.2 and aoti["ratios"] == [1.2, 1.375, 1.1]
    assert aoti["compile_s"] == 30.0 and aoti["cached"] is False
    assert bf16["images_per_sec"] is None and bf16["skipped"] == "emulated"
    result = Result("rb", "python -m cnns.bench.backends {}", model="resnet-8 32px", mode="infer", batch_size=2,
                    kind="inference-backends", backends=[eager, aoti, bf16])
    table = format_backends_table([result])
    assert "vs eager per repeat" in table and "1.20 1.38 1.10" in table and "skipped" in table
    assert "rb: fastest aoti (12.00 img/s, 1.20x eager float32)" in table
    assert not entry_failed(result)  # skipped is not failed
    result.backends[1] = {**aoti, "error": "RuntimeError: boom"}
    assert entry_failed(result) and "rb: aoti: RuntimeError: boom" in format_backends_table([result])


# ------------------------------------------------------------------------------------------------
# python -m cnns.bench.passes: each fused pass alone, against a copy and ATen's layer


def test_the_pass_benchmark_times_every_pass_and_both_layers(capsys):
    from cnns.bench import passes
    from cnns.kernels import norm_act

    if not norm_act.available():
        pytest.skip("the fused kernels were not built")
    assert passes.main(["--shape", "4", "32", "15", "9", "--calls", "1"]) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.startswith("(4, 32, 15, 9)")
    for name in ("moments", "apply", "backward reduce", "input gradient", "copy", "ATen BN+ReLU fwd+bwd",
                 "fused BN+ReLU fwd+bwd"):
        milliseconds = float(line.split(f"{name} ")[1].split(" ms")[0])
        assert milliseconds > 0
