"""cnns benchmark: reading throughput the seed's way, the result files, and one tiny entry end to end.

No test asserts a speed: only that numbers are read, compared and written.
"""

from __future__ import annotations

import csv
import json
import textwrap
from pathlib import Path

import pytest

from cnns.bench.runner import (Result, benchmark_command, format_table, load_spec, mean_dropping_first,
                               parse_throughputs, select, set_peak_fractions, write_results)
from cnns.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]

TRAIN_OUTPUT = """\
Total Parameters:78042
step:      2, iteration:      2, epoch:   0.01, lr: 0.01562, loss:  2.303, top-1 accuracy: 12.500%, throughput:  10.50 samples/sec, time: 3.047619, total_time:      6.1
step:      4, iteration:      4, epoch:   0.02, lr: 0.01562, loss:  2.250, top-1 accuracy: 15.625%, throughput: 1200.00 samples/sec, time: 0.026667, total_time:      6.2
step:      6, iteration:      6, epoch:   0.03, lr: 0.01562, loss:  2.101, top-1 accuracy: 20.000%, throughput: 1400.00 samples/sec, time: 0.022857, total_time:      6.2
Validation top-1 accuracy: 21.000% [ckpt-6] (iteration:      6, epoch:   0.03, throughput: 3000.00 samples/sec, time: 0.066667, latency avg:   2.0000 ms)
"""


def test_throughputs_are_read_from_step_and_validation_lines_in_order():
    assert parse_throughputs(TRAIN_OUTPUT) == [10.5, 1200.0, 1400.0, 3000.0]
    assert parse_throughputs("throughput: 1e3 samples/sec, throughput:7 samples/sec") == [1000.0, 7.0]
    assert parse_throughputs("no numbers here") == []


def test_the_mean_drops_the_first_value_as_the_seed_says():
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


def test_table_csv_and_json_hold_the_ratio_and_the_fraction_of_peak(tmp_path):
    result = Result("rn", "train.py --model resnet", model="resnet-8 32px", mode="train", data="synthetic",
                    batch_size=16, cnns_images_per_sec=300.0, plain_images_per_sec=200.0, ratio=1.5,
                    flops_per_image=3 * 1e8, cnns_runs=[290.0, 300.0], plain_runs=[200.0], pair_ratios=[1.45])
    failed = Result("broken", "train.py", error="cnns: exit 2: error: bad option")
    set_peak_fractions(result, 600.0)  # GFLOP/s
    assert result.cnns_peak_fraction == pytest.approx(300 * 3e8 / 600e9)
    assert result.plain_peak_fraction == pytest.approx(200 * 3e8 / 600e9)

    table = format_table([result, failed], 600.0)
    assert "1.50x" in table and "15.0%" in table and "10.0%" in table
    assert "broken: cnns: exit 2" in table
    assert "ratio per repeat" not in table  # one pair: nothing to compare

    repeated = Result("rn2", "train.py", cnns_runs=[300.0, 330.0], plain_runs=[250.0, 220.0], pair_ratios=[1.2, 1.5])
    assert "ratio per repeat" in format_table([repeated, failed], 600.0)
    assert "1.20 1.50" in format_table([repeated, failed], 600.0)

    csv_path, json_path = write_results([result, failed], {"peak_bf16_matmul_gflops": 600.0}, tmp_path, "results")
    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["name"] for r in rows] == ["rn", "broken"]
    assert float(rows[0]["ratio"]) == 1.5 and rows[0]["cnns_runs"] == "290.000 300.000"
    assert rows[0]["pair_ratios"] == "1.450"  # 290 / 200: the runs of the first repeat
    document = json.loads(json_path.read_text())
    assert document["peak_bf16_matmul_gflops"] == 600.0
    assert document["results"][0]["plain_images_per_sec"] == 200.0
    assert document["results"][0]["pair_ratios"] == [1.45]
    assert document["results"][1]["error"].startswith("cnns: exit 2")


def test_a_tiny_cifar_benchmark_runs_both_loops_end_to_end(tmp_path, capsys):
    spec = _write_spec(tmp_path / "tiny.yml", """\
        cifar10_images: 256
        benchmarks:
          - name: tiny-resnet8-cifar
            command: >-
              train.py --model resnet --model-size 8 --dataset cifar-10 --data-dir {cifar10}
              --micro-batch-size 16 --iterations 4 --log-freq 1 --no-validation --ckpts-per-epoch 0
        """)
    out_dir = tmp_path / "results"
    code = benchmark_command(["--spec", str(spec), "--benchmark", "tiny-resnet8-cifar", "--output-dir", str(out_dir)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "tiny-resnet8-cifar" in printed and "ratio" in printed
    [json_path] = out_dir.glob("tiny-*/results.json")
    [row] = json.loads(json_path.read_text())["results"]
    assert row["error"] is None
    assert row["cnns_images_per_sec"] > 0 and row["plain_images_per_sec"] > 0
    assert row["ratio"] == pytest.approx(row["cnns_images_per_sec"] / row["plain_images_per_sec"])
    assert 0 < row["cnns_peak_fraction"] and row["flops_per_image"] > 0
    assert (json_path.parent / "results.csv").is_file()
    # The generated CIFAR-10 folder and both processes' logs are kept beside the results.
    assert (out_dir / "data" / "cifar10-256" / "data_batch_1.bin").is_file()
    assert sorted(p.name for p in (json_path.parent / "logs").iterdir()) == [
        "tiny-resnet8-cifar-cnns-1.log", "tiny-resnet8-cifar-plain-1.log"]


def test_the_repository_spec_lists_the_seed_benchmarks_and_parses():
    entries, document = load_spec(ROOT / "benchmarks.yml")
    names = {e.name for e in entries}
    for wanted in ("resnet50-train-synthetic", "resnext101-train-synthetic", "efficientnet-b0-train-synthetic",
                   "efficientnet-b4-train-synthetic", "resnet20-cifar10-train", "resnet50-infer-synthetic",
                   "resnet50-infer-generated"):
        assert wanted in names
    from cnns.bench.runner import plan_entry

    for entry in entries:  # every command line is accepted and resolves to a plain-loop twin
        plan = plan_entry(entry, {"cifar10": "/nonexistent"}, Path("/tmp/unused"))
        assert plan.baseline["batch_size"] == plan.batch_size > 0


def test_the_ratio_is_the_median_of_adjacent_pairs_not_best_over_best(tmp_path, monkeypatch):
    from cnns.bench import runner

    entries, _ = load_spec(ROOT / "benchmarks.yml")
    [entry] = select(entries, ["resnet20-cifar10-train"])
    plan = runner.plan_entry(entry, {"cifar10": "/nonexistent"}, tmp_path)
    # The host sped up during the last repeat (best over best, 468/367 = 1.27, would pair two moments),
    # and in the first repeat our side failed: its plain run must not pair with a later cnns run.
    # Repeats alternate the order: cnns, plain | plain, cnns | cnns, plain | plain, cnns.
    scripted = iter([(None, "exit 1: boom"), (300.0, ""), (337.0, ""), (468.0, ""),
                     (405.0, ""), (357.0, ""), (367.0, ""), (328.0, "")])
    monkeypatch.setattr(runner, "run_and_read", lambda argv, timeout, log_path: next(scripted))
    result = runner.run_entry(entry, plan, ROOT, repeats=4, with_baseline=True, logs=None)
    assert result.pair_ratios == pytest.approx([468 / 337, 405 / 357, 328 / 367])
    assert result.ratio == pytest.approx(405 / 357)
    assert result.cnns_images_per_sec == 468.0 and result.plain_images_per_sec == 367.0
    assert result.error == "cnns: exit 1: boom"
