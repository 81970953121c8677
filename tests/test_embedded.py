"""inference_embedded.py: compile once ahead of time, reload later, same logits as the eager model."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import processes
import scripts

import cnns.commands.infer as infer_command
from cnns.cli import parse_options, run_script
from cnns.config import RunConfig, resolve
from cnns.commands.infer import probe_package
from cnns.deploy.restored_model import build_inference_model
from cnns.deploy.graphs import export_pt2
from cnns.errors import CnnsError

ROOT = Path(__file__).resolve().parents[1]
RN8 = ["--model", "resnet", "--model-size", "8", "--dataset", "cifar-10", "--micro-batch-size", "2", "--iterations",
       "5", "--generated-data", "--precision", "32.32"]
# The same model for another dataset: 100 classes, so not the package a CIFAR-10 run leaves.
RN8_CIFAR100 = [a if a != "cifar-10" else "cifar-100" for a in RN8]
PROBED = f"torch {torch.__version__} loaded and ran the compiled model in a child process first"


EMBEDDED = [sys.executable, str(ROOT / "inference_embedded.py")]
# The tests share one compilation per fixture: one test worker makes it.
pytestmark = pytest.mark.xdist_group("test_embedded-packages")


def embedded(folder: Path, *argv: str):
    """inference_embedded.py as a new process: the script itself, as a user starts it."""
    return processes.run([*EMBEDDED, *argv], capture_output=True, text=True, cwd=folder)


def embedded_here(capfd, folder: Path, *argv: str) -> subprocess.CompletedProcess:
    """inference_embedded.py's command in this process (tests/scripts.py), without a new interpreter's seconds of
    start-up: its exit code and what reached fds 1 and 2."""
    return scripts.run_here(capfd, "inference_embedded.py", *argv, cwd=folder, expect=None)


@pytest.fixture(scope="module")
def first_run(tmp_path_factory) -> tuple[Path, str]:
    """inference_embedded.py's first run in an empty folder (the folder, what it printed): it compiles and saves
    the package the tests below start from, each in a copy of the folder (one compilation for both)."""
    folder = tmp_path_factory.mktemp("first-run")
    first = embedded(folder, *RN8)
    assert first.returncode == 0, first.stderr[-2000:]
    return folder, first.stdout


def copy_of(folder: Path, into: Path) -> Path:
    shutil.copytree(folder, into, dirs_exist_ok=True)
    return into


def test_first_run_compiles_and_saves_later_runs_load(first_run, tmp_path, capfd):
    folder, printed = first_run
    assert "Compilation time:" in printed
    assert PROBED not in printed  # a CPU package loads in this process directly
    folder = copy_of(folder, tmp_path)
    artefacts = list(folder.glob("*.pt2"))
    assert len(artefacts) == 1
    second = embedded_here(capfd, folder, *RN8)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "Loading the compiled model" in second.stdout and "Compilation time:" not in second.stdout
    assert "latency 99p9:" in second.stdout
    artefacts[0].write_bytes(b"not a package")
    broken = embedded_here(capfd, folder, *RN8)
    assert broken.returncode == 2 and "Traceback" not in broken.stderr
    assert "--force-recompile" in broken.stderr


@pytest.fixture(scope="module")
def recompiled(first_run, tmp_path_factory) -> tuple[Path, str]:
    """One more compilation, in this process, on the CPU with the probe CUDA gets: a CIFAR-100 run asked for the
    package the first (CIFAR-10) run left under the same name compiles it again, then a child process loads the
    new package and runs one batch before this process loads it. (The package, what the run printed.)"""
    folder = copy_of(first_run[0], tmp_path_factory.mktemp("recompiled"))
    (package,) = folder.glob("*.pt2")
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(printed):
        patch.setattr(infer_command, "PROBED_DEVICE_TYPES", ("cpu",))
        assert run_script("infer", [*RN8_CIFAR100, "--artefact-path", str(package)]) == 0
    return package, printed.getvalue()


def test_a_package_compiled_for_other_options_is_compiled_again_not_loaded(first_run, recompiled, tmp_path, capfd):
    """The file name of Graphcore's application says model, batch, precision and weights; a CIFAR-100 run of
    the same model must not time (and answer with) the 10-class package a CIFAR-10 run left under that name."""
    package, again = recompiled
    assert f"The compiled model at {package} was built for another model: compiling it again" in again
    assert "Compilation time:" in again
    assert package.read_bytes() != (first_run[0] / package.name).read_bytes()  # the CIFAR-10 run's
    compiled = torch._inductor.aoti_load_package(str(package))
    assert compiled(torch.zeros(2, 32, 32, 3, dtype=torch.uint8)).shape == (2, 100)
    folder = copy_of(package.parent, tmp_path)
    package = folder / package.name

    def run(*argv: str):
        out = embedded_here(capfd, folder, *argv)
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout

    assert "Loading the compiled model" in run(*RN8_CIFAR100)
    # A package with no description (copied here by hand) is trusted, whatever was asked.
    package.with_name(package.name + ".json").unlink()
    assert "Loading the compiled model" in run(*RN8)


def test_compiled_artefact_computes_the_eager_logits(tmp_path):
    values, _ = parse_options("infer", ["--model", "resnet", "--model-size", "8", "--dataset", "cifar-10",
                                        "--generated-data", "--precision", "32.32", "--normalise-input"])
    cfg = RunConfig.from_options(resolve(values))
    torch.manual_seed(0)
    model = build_inference_model(cfg, None, torch.device("cpu"))
    images = torch.randint(0, 256, (3, 32, 32, 3), dtype=torch.uint8)
    with torch.no_grad():
        eager = model(images)
    export_pt2(model, images, dynamic=False, out=tmp_path / "m.pt2")
    compiled = torch._inductor.aoti_load_package(str(tmp_path / "m.pt2"))
    # float32 both ways, but Inductor's fused kernels sum in another order: one reordered sum of K
    # terms differs by at most about K x 2^-24 of its magnitude, 5e-5 for ResNet-8's largest fan-in
    # (3 x 3 x 64 = 576); typical errors are sqrt(K) times smaller. Measured 2.4e-7 on logits of 0.7.
    assert torch.allclose(compiled(images), eager, rtol=1e-4, atol=1e-4)


def test_cuda_packages_load_first_in_a_child_process_then_are_measured(recompiled, monkeypatch, capsys):
    assert infer_command.PROBED_DEVICE_TYPES == ("cuda",)  # the decision the tests below turn on for the CPU
    path, first = recompiled
    # compiled, then probed, then timed: the probe's seconds are in none of the measured numbers
    assert first.index("Compilation time:") < first.index(PROBED) < first.index("Inference: 5 batches of 2")
    assert "latency 99p9:" in first
    monkeypatch.setattr(infer_command, "PROBED_DEVICE_TYPES", ("cpu",))
    assert run_script("infer", [*RN8_CIFAR100, "--artefact-path", str(path)]) == 0
    again = capsys.readouterr().out
    assert again.index("Loading the compiled model") < again.index(PROBED) < again.index("Inference: 5 batches")
    assert "Compilation time:" not in again


def test_a_probe_child_that_crashes_stops_the_command_with_one_line(recompiled, monkeypatch, capsys):
    """The child loads the real package as the probe does, then dies of SIGSEGV, as torch 2.11.0+cu130 did
    loading CUDA packages on an H100: the command ends with exit code 2 and one line, nothing timed."""
    path, _ = recompiled
    crashing = infer_command.PROBE_CODE.replace(
        "logits = runner(", "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\nlogits = runner(")
    assert crashing != infer_command.PROBE_CODE
    monkeypatch.setattr(infer_command, "PROBED_DEVICE_TYPES", ("cpu",))
    monkeypatch.setattr(infer_command, "PROBE_CODE", crashing)
    assert run_script("infer", [*RN8_CIFAR100, "--artefact-path", str(path)]) == 2
    captured = capsys.readouterr()
    [line] = captured.err.splitlines()
    assert line.startswith(f"error: torch {torch.__version__} crashed (SIGSEGV) loading the AOTInductor package "
                           f"{path} on cpu (tried in a child process; nothing was timed)"), line
    assert "validation.py --generated-data" in line and "Traceback" not in captured.err
    assert "Loading the compiled model" in captured.out and "Inference:" not in captured.out


def test_a_probe_child_that_fails_or_hangs_is_one_line(tmp_path, monkeypatch):
    foreign = tmp_path / "foreign.pt2"
    foreign.write_bytes(b"not a package")
    with pytest.raises(CnnsError, match=r"cannot load the compiled model .*foreign\.pt2 with torch .*--force-recompile"):
        probe_package(foreign, (2, 32, 32, 3), torch.device("cpu"))
    # A child that never finishes is killed at the time limit, its whole process group with it.
    monkeypatch.setattr(infer_command, "PROBE_TIMEOUT_S", 2)
    monkeypatch.setattr(infer_command, "PROBE_CODE",
                        "import os, sys, time\nopen(sys.argv[1] + '.pid', 'w').write(str(os.getpid()))\ntime.sleep(120)")
    with pytest.raises(CnnsError, match=r"did not load and run the AOTInductor package .* within 2 s") as raised:
        probe_package(foreign, (2, 32, 32, 3), torch.device("cpu"))
    assert "\n" not in str(raised.value)
    pid = int(Path(str(foreign) + ".pid").read_text())
    assert not os.path.exists(f"/proc/{pid}")  # killed and reaped
