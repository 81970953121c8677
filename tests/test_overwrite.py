"""Outputs never replace inputs: `cnns export` refuses to write over the checkpoint or the arguments.json it reads
(even with --overwrite), and over any other existing file (a checkpoint above all) unless --overwrite is given;
`cnns plot --out` likewise with the CSV files it reads. One line, exit 2, every file as it was."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import onnx
import pytest

import scripts
from faults import DiskFault

from cnns.runfolder.checkpoint import load_checkpoint


@pytest.fixture(scope="module")
def run(shapes_cifar10, tmp_path_factory) -> Path:
    """A ResNet-8 run of 4 updates: checkpoints at 0 and 4."""
    data = shapes_cifar10("export-overwrite", train=64, test=16, seed=3)
    folder = tmp_path_factory.mktemp("export-overwrite") / "run"
    scripts.train_here("--dataset", "cifar-10", "--data-dir", str(data), "--model-size", "8", "--micro-batch-size", "16",
                       "--iterations", "4", "--ckpts-per-epoch", "1", "--no-validation", "--logs-path", str(folder))
    return folder


def contents(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir()) if path.is_file()}


def export(capfd, *argv: str, expect: int | None = 0):
    return scripts.run_here(capfd, "export", *argv, expect=expect)


def assert_refused(out, *words: str) -> None:
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("error: --out ") and all(word in line for word in words), line


@pytest.mark.parametrize("restore, out, overwrite, words", [
    # The case: the run's only newest checkpoint would have become ONNX bytes.
    ("run", "ckpt-4.pt", False, ("which this command reads",)),
    ("run", "ckpt-4.pt", True, ("which this command reads",)),
    ("ckpt-0.pt", "ckpt-0.pt", True, ("which this command reads",)),
    ("run", "arguments.json", True, ("which this command reads",)),
    ("run", "ckpt-0.pt", False, ("exists", "--overwrite")),  # another checkpoint of the run
    ("run", "log.txt", False, ("exists", "--overwrite")),
])
def test_export_never_writes_over_what_it_reads_nor_an_existing_file_unasked(run, capfd, restore, out, overwrite,
                                                                             words):
    before = contents(run)
    restore_path = run if restore == "run" else run / restore
    out = export(capfd, "--restore-path", str(restore_path), "--format", "onnx", "--out", str(run / out),
                 *(["--overwrite"] if overwrite else []), expect=None)
    assert_refused(out, *words)
    assert contents(run) == before
    load_checkpoint(run / "ckpt-4.pt")


def test_a_symlink_to_the_checkpoint_read_is_refused_too(run, tmp_path, capfd):
    link = tmp_path / "model.onnx"
    link.symlink_to(run / "ckpt-4.pt")
    before = contents(run)
    assert_refused(export(capfd, "--restore-path", str(run), "--format", "onnx", "--out", str(link), "--overwrite",
                          expect=None), "which this command reads")
    assert contents(run) == before and link.is_symlink()


def test_safetensors_refuses_a_folder_that_already_holds_its_files(run, tmp_path, capfd):
    out = tmp_path / "for-timm"
    out.mkdir()
    (out / "config.json").write_text("{}\n")
    assert_refused(export(capfd, "--restore-path", str(run), "--format", "safetensors", "--out", str(out), expect=None),
                   "config.json", "exists", "--overwrite")
    assert (out / "config.json").read_text() == "{}\n" and not (out / "model.safetensors").exists()


def test_overwrite_replaces_an_existing_file_whole_or_not_at_all(run, tmp_path, capfd, monkeypatch):
    """With --overwrite an existing file is replaced; a full disk at the rename leaves it as it was."""
    target = tmp_path / "model.onnx"
    target.write_bytes(b"an older export")
    assert_refused(export(capfd, "--restore-path", str(run), "--format", "onnx", "--out", str(target), expect=None),
                   "exists", "--overwrite")
    with monkeypatch.context() as patched:
        fault = DiskFault("model.onnx", "replace", error=errno.ENOSPC).install(patched)
        failed = export(capfd, "--restore-path", str(run), "--format", "onnx", "--out", str(target), "--overwrite",
                        expect=2)
    assert fault.fired_on is not None and "Traceback" not in failed.stderr
    assert failed.stderr.strip().splitlines()[-1] == f"error: cannot write {target}: No space left on device"
    assert target.read_bytes() == b"an older export" and os.listdir(tmp_path) == ["model.onnx"]

    export(capfd, "--restore-path", str(run), "--format", "onnx", "--out", str(target), "--overwrite")
    onnx.checker.check_model(onnx.load(str(target)))


@pytest.mark.parametrize("out, overwrite, words", [
    ("training.csv", True, ("which this command reads",)),
    ("log.txt", False, ("exists", "--overwrite")),
])
def test_plot_never_writes_over_a_csv_it_reads_nor_an_existing_file_unasked(run, capfd, out, overwrite, words):
    before = contents(run)
    assert_refused(scripts.run_here(capfd, "plot", str(run), "--out", str(run / out),
                                    *(["--overwrite"] if overwrite else []), expect=None), *words)
    assert contents(run) == before


def test_plot_replaces_an_existing_out_file_when_asked(run, tmp_path, capfd):
    out = tmp_path / "curves.png"
    out.write_bytes(b"an older plot")
    scripts.run_here(capfd, "plot", str(run), "--out", str(out), "--overwrite")
    assert out.read_bytes().startswith(b"\x89PNG")
