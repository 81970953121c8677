"""The CUDA tier (`make test-gpu`): what only a GPU can show. Every test here is marked `cuda` and
skipped without one (conftest.py counts them in `make test`'s summary). Written before any GPU was
available to the project: docs/gpus.md says which of them have run, on which GPU.

One process per GPU is cnns' rule (a worker uses cuda:LOCAL_RANK), so the multi-process tests need
as many GPUs as processes."""

from __future__ import annotations

import csv
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import processes


pytestmark = pytest.mark.cuda

ROOT = Path(__file__).resolve().parents[1]
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
# Emulated bfloat16 (Volta, Turing) does not count: cnns computes 16.x in float16 there.
HALF = "bfloat16" if GPUS and torch.cuda.is_bf16_supported(including_emulation=False) else "float16"


@pytest.fixture(scope="module")
def data_dir(shapes_cifar10) -> Path:
    return shapes_cifar10("cuda", train=2000, test=200, seed=4)


def train(tmp_path: Path, name: str, *args: str, script: str = "train.py") -> tuple[Path, str]:
    folder = tmp_path / name
    out = processes.run([sys.executable, str(ROOT / script), *args, "--logs-path", str(folder)],
                        capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return folder, out.stdout


def rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


SHORT = ("--dataset", "cifar-10", "--model-size", "8", "--micro-batch-size", "32", "--optimiser", "momentum",
         "--base-learning-rate-exponent", "-9", "--seed", "11", "--device", "cuda")


@pytest.mark.parametrize("precision", ["16.16", "16.32"])
def test_half_precision_learns_on_the_gpu_in_its_half_type(data_dir, tmp_path, precision):
    folder, out = train(tmp_path, precision, *SHORT, "--data-dir", str(data_dir), "--precision", precision,
                        "--epochs", "6", "--warmup-epochs", "1", "--lr-schedule", "cosine", "--logs-per-epoch", "1",
                        "--ckpts-per-epoch", "0", *(["--auto-loss-scaling"] if HALF == "float16" else []))
    options = json.loads((folder / "arguments.json").read_text())
    assert options["half_dtype"] == HALF and options["loss_scaling"] == (128.0 if HALF == "float16" else 1.0)
    losses = [float(r["loss_avg"]) for r in rows(folder / "training.csv")][:-1]
    assert losses[-1] < 0.7 * losses[0], losses
    assert float(rows(folder / "validation.csv")[-1]["val_acc"]) > 40.0


@pytest.mark.parametrize("precision", ["16.16", "16.32"])  # 16.32 sums its micro-batches in .grad itself
def test_compile_with_cuda_graphs_under_accumulation_device_iterations_and_ema(data_dir, tmp_path, precision):
    folder, _ = train(tmp_path, "compiled", *SHORT, "--data-dir", str(data_dir), "--compile", "--precision", precision,
                      "--gradient-accumulation-count", "2", "--device-iterations", "4", "--ema-decay", "0.9",
                      "--iterations", "16", "--log-freq", "8", "--no-validation")
    state = torch.load(folder / "ckpt-16.pt", weights_only=True)
    assert "ema" in state and all(torch.isfinite(t).all() for t in state["model"].values() if t.is_floating_point())
    assert [int(r["iteration"]) for r in rows(folder / "training.csv")] == [8, 16]


def test_sigterm_then_restore_ends_a_gpu_run_bitwise_like_an_uninterrupted_one(data_dir, tmp_path):
    """--seed on a GPU computes reproducibly (`cnns.engine.kernel_choice.compute_reproducibly`), so a run stopped by
    SIGTERM mid-epoch and continued by restore.py ends with the uninterrupted run's weights, bit for bit."""
    common = (*SHORT, "--data-dir", str(data_dir), "--iterations", "40", "--log-freq", "1", "--device-iterations", "1",
              "--ckpts-per-epoch", "1", "--no-validation")
    whole, _ = train(tmp_path, "whole", *common)
    cut = tmp_path / "cut"
    process = processes.start([sys.executable, str(ROOT / "train.py"), *common, "--logs-path", str(cut)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    deadline = time.monotonic() + 300
    while process.poll() is None and time.monotonic() < deadline:
        if (cut / "training.csv").exists() and len(rows(cut / "training.csv")) >= 5:
            process.send_signal(signal.SIGTERM)
            break
        time.sleep(0.01)
    stdout, stderr = processes.communicate(process, timeout=300)
    assert process.returncode == 128 + signal.SIGTERM, stdout[-3000:] + stderr[-3000:]
    stopped = int(re.search(r"Training interrupted by SIGTERM at iteration (\d+); checkpoint saved", stdout).group(1))
    assert 5 <= stopped < 40 and (cut / f"ckpt-{stopped}.pt").is_file()
    processes.run([sys.executable, str(ROOT / "restore.py"), "--restore-path", str(cut)], check=True,
                  capture_output=True, text=True, cwd=tmp_path, timeout=600)
    a, b = (torch.load(f / "ckpt-40.pt", weights_only=True)["model"] for f in (whole, cut))
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_validation_and_export_on_the_gpu(data_dir, tmp_path):
    folder, _ = train(tmp_path, "run", *SHORT, "--data-dir", str(data_dir), "--iterations", "4", "--no-validation")
    out = processes.run([sys.executable, str(ROOT / "validation.py"), "--restore-path", str(folder)],
                        capture_output=True, text=True, cwd=tmp_path, timeout=600, check=True).stdout
    assert all(int(r["val_size"]) == 200 for r in rows(folder / "validation.csv"))
    assert "Validation top-1 accuracy" in out
    package = tmp_path / "rn8.pt2"
    out = processes.run([sys.executable, "-m", "cnns", "export", "--restore-path", str(folder), "--format", "pt2",
                         "--device", "cuda", "--eight-bit-io", "--out", str(package)], capture_output=True, text=True,
                        cwd=tmp_path, timeout=900, env={**__import__("os").environ, "PYTHONPATH": str(ROOT / "src")})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "1 to 65535" in out.stdout  # the dynamic batch's range on a GPU (cuDNN batch norm's eval-mode limit)
    skip_where_this_torch_crashes_loading(package)
    compiled = torch._inductor.aoti_load_package(str(package))
    for batch in (1, 3):
        logits = compiled(torch.randint(0, 256, (batch, 32, 32, 3), dtype=torch.uint8, device="cuda"))
        assert logits.shape == (batch, 10) and logits.device.type == "cuda"


def skip_where_this_torch_crashes_loading(package: Path) -> None:
    """Load the package in a child first (as inference_embedded.py does): where this torch dies loading CUDA
    AOTInductor packages (SIGSEGV with 2.11.0+cu130 on an H100), the test skips with that line instead of
    taking pytest down with it."""
    from cnns.commands.infer import probe_package
    from cnns.errors import CnnsError

    try:
        probe_package(package, (2, 32, 32, 3), torch.device("cuda"))
    except CnnsError as exc:
        if "crashed (" in str(exc):
            pytest.skip(f"this torch cannot load CUDA AOTInductor packages: {exc}")
        raise


def test_inference_embedded_compiles_an_aotinductor_artefact_for_the_gpu(tmp_path):
    out = processes.run([sys.executable, str(ROOT / "inference_embedded.py"), "--model", "resnet", "--model-size", "8",
                         "--dataset", "cifar-10", "--micro-batch-size", "4", "--iterations", "20", "--device", "cuda",
                         "--artefact-path", str(tmp_path / "rn8.pt2")], capture_output=True, text=True, cwd=tmp_path,
                        timeout=900)
    if out.returncode == 2 and "crashed (" in out.stderr:  # the command's one line where this torch cannot load it
        pytest.skip(f"this torch cannot load CUDA AOTInductor packages: {out.stderr.strip()}")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert (tmp_path / "rn8.pt2").is_file()
    assert "latency avg:" in out.stdout


@pytest.mark.skipif(GPUS < 2, reason="cnns runs one process per GPU: two replicas or stages need two GPUs")
@pytest.mark.parametrize("layout", [("--replicas", "2"), ("--shards", "2", "--pipeline", "--pipeline-splits",
                                                           "layer2")], ids=["replicas", "stages"])
def test_two_processes_on_two_gpus_train_as_one_process(data_dir, tmp_path, layout):
    common = (*SHORT, "--data-dir", str(data_dir), "--precision", "32.32", "--group-norm", "--groups", "4",
              "--micro-batch-size", "16", "--iterations", "6", "--no-validation")
    # Two replicas of 16 against one process accumulating 2 x 16; two stages of 2 micro-batches against
    # one process accumulating the same 2.
    accumulate = ("--gradient-accumulation-count", "2")
    two, _ = train(tmp_path, "two", *common, *layout, *(accumulate if layout[0] == "--shards" else ()))
    one, _ = train(tmp_path, "one", *common, *accumulate)
    a, b = (torch.load(f / "ckpt-6.pt", weights_only=True)["model"] for f in (two, one))
    x = torch.cat([t.flatten().double() for t in a.values() if t.is_floating_point()])
    y = torch.cat([t.flatten().double() for t in b.values() if t.is_floating_point()])
    # NCCL sums in another order than one process: float32 rounding, as on the CPU (test_replicas.py).
    assert float((x - y).norm() / y.norm()) < 1e-4
