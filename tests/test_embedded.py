"""inference_embedded.py: compile once ahead of time, reload later, same logits as the eager model."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import processes

from cnns.cli import parse_options
from cnns.config import RunConfig, resolve
from cnns.engine.embedded import build_inference_model, compile_artefact

ROOT = Path(__file__).resolve().parents[1]


def test_first_run_compiles_and_saves_later_runs_load(tmp_path):
    argv = [sys.executable, str(ROOT / "inference_embedded.py"), "--model", "resnet", "--model-size", "8",
            "--dataset", "cifar-10", "--micro-batch-size", "2", "--iterations", "5", "--generated-data",
            "--precision", "32.32"]
    first = processes.run(argv, capture_output=True, text=True, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "Compilation time:" in first.stdout
    artefacts = list(tmp_path.glob("*.pt2"))
    assert len(artefacts) == 1
    second = processes.run(argv, capture_output=True, text=True, cwd=tmp_path)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "Loading the compiled model" in second.stdout and "Compilation time:" not in second.stdout
    assert "latency 99p9:" in second.stdout
    artefacts[0].write_bytes(b"not a package")
    broken = processes.run(argv, capture_output=True, text=True, cwd=tmp_path)
    assert broken.returncode == 2 and "Traceback" not in broken.stderr
    assert "--force-recompile" in broken.stderr


def test_a_package_compiled_for_other_options_is_compiled_again_not_loaded(tmp_path):
    """The seed's file name says model, batch, precision and weights; a CIFAR-100 run of the same model
    must not time (and answer with) the 10-class package a CIFAR-10 run left under that name."""
    def run(dataset: str, *extra: str):
        argv = [sys.executable, str(ROOT / "inference_embedded.py"), "--model", "resnet", "--model-size", "8",
                "--dataset", dataset, "--micro-batch-size", "2", "--iterations", "3", "--generated-data",
                "--precision", "32.32", *extra]
        out = processes.run(argv, capture_output=True, text=True, cwd=tmp_path)
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout

    assert "Compilation time:" in run("cifar-10")
    (package,) = tmp_path.glob("*.pt2")
    ten_classes = package.read_bytes()
    again = run("cifar-100")
    assert f"The compiled model at {package.name} was built for another model: compiling it again" in again
    assert "Compilation time:" in again and package.read_bytes() != ten_classes
    compiled = torch._inductor.aoti_load_package(str(package))
    assert compiled(torch.zeros(2, 32, 32, 3, dtype=torch.uint8)).shape == (2, 100)
    assert "Loading the compiled model" in run("cifar-100")
    # A package with no description (copied here by hand) is trusted, whatever was asked.
    package.with_name(package.name + ".json").unlink()
    assert "Loading the compiled model" in run("cifar-10")


def test_compiled_artefact_computes_the_eager_logits(tmp_path):
    values, _ = parse_options("infer", ["--model", "resnet", "--model-size", "8", "--dataset", "cifar-10",
                                        "--generated-data", "--precision", "32.32", "--normalise-input"])
    cfg = RunConfig.from_options(resolve(values))
    torch.manual_seed(0)
    model = build_inference_model(cfg, None, torch.device("cpu"))
    images = torch.randint(0, 256, (3, 32, 32, 3), dtype=torch.uint8)
    with torch.no_grad():
        eager = model(images)
    compile_artefact(model, images, tmp_path / "m.pt2")
    compiled = torch._inductor.aoti_load_package(str(tmp_path / "m.pt2"))
    # float32 both ways, but Inductor's fused kernels sum in another order: one reordered sum of K
    # terms differs by at most about K x 2^-24 of its magnitude, 5e-5 for ResNet-8's largest fan-in
    # (3 x 3 x 64 = 576); typical errors are sqrt(K) times smaller. Measured 2.4e-7 on logits of 0.7.
    assert torch.allclose(compiled(images), eager, rtol=1e-4, atol=1e-4)
