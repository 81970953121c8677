"""--restore-path read one way by every command that starts from a trained run (`cnns.runfolder.run_folder.open_restore_path`):
the same one line for a path with nothing there, a folder that is not a run and a run without checkpoints; and
the run's arguments.json gives the model and the dataset, inference_embedded.py's too. And the run name, which
--name-suffix is part of, cannot place a run folder outside --log-dir."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import scripts

from cnns.cli.parsing import resolve_command_line
from cnns.deploy.restored_model import build_inference_model
from cnns.errors import CheckpointError
from cnns.models import build_model
from cnns.models.model_spec import ModelSpec

SCRIPTS = ["restore.py", "validation.py", "weight_avg.py", "inference_embedded.py"]


@pytest.fixture(scope="module")
def resnet8_run(tmp_path_factory) -> Path:
    """Four updates of a ResNet-8 on the built-in shapes (the default model is ResNet-20), trained in this process."""
    folder = tmp_path_factory.mktemp("restore-path") / "run"
    scripts.train_here("--dataset", "builtin", "--model-size", "8", "--micro-batch-size", "4", "--iterations", "4",
                       "--no-validation", "--seed", "1", "--logs-path", str(folder))
    assert (folder / "ckpt-4.pt").is_file()
    return folder


def bad_path(kind: str, run: Path, tmp_path: Path) -> tuple[Path, str]:
    """(--restore-path, the line every command ends with)."""
    if kind == "missing":
        path = tmp_path / "missing" / "folder"
        return path, f"error: --restore-path {path} is not a run folder: nothing is there"
    if kind == "not-a-run":
        path = tmp_path / "empty"
        path.mkdir()
        return path, f"error: {path} has no arguments.json: not a cnns run folder"
    path = tmp_path / "no-checkpoints"  # a run stopped before its first checkpoint
    path.mkdir()
    shutil.copy(run / "arguments.json", path)
    return path, f"error: no checkpoints (ckpt-<iteration>.pt) found in {path}"


@pytest.mark.parametrize("kind", ["missing", "not-a-run", "no-checkpoints"])
@pytest.mark.parametrize("script", SCRIPTS)
def test_every_command_says_the_same_line_for_a_path_that_is_not_a_run_with_checkpoints(resnet8_run, tmp_path, capfd,
                                                                                        script, kind):
    path, line = bad_path(kind, resnet8_run, tmp_path)
    before = sorted(tmp_path.rglob("*"))
    out = scripts.run_here(capfd, script, "--restore-path", str(path), cwd=tmp_path, expect=2)
    assert out.stderr.splitlines() == [line]
    assert sorted(tmp_path.rglob("*")) == before  # nothing written, in the folder or beside it


def test_a_checkpoint_file_outside_a_run_is_the_same_line(tmp_path, capfd):
    (tmp_path / "ckpt-3.pt").write_bytes(b"")
    for script in SCRIPTS[1:]:
        out = scripts.run_here(capfd, script, "--restore-path", str(tmp_path / "ckpt-3.pt"), cwd=tmp_path, expect=2)
        assert out.stderr.splitlines() == [f"error: {tmp_path} has no arguments.json: not a cnns run folder"]


@pytest.mark.parametrize("script", ["restore.py", "weight_avg.py"])
def test_commands_that_take_the_whole_run_name_its_folder_for_a_checkpoint_file(resnet8_run, tmp_path, capfd, script):
    out = scripts.run_here(capfd, script, "--restore-path", str(resnet8_run / "ckpt-4.pt"), cwd=tmp_path, expect=2)
    assert out.stderr.splitlines() == [f"error: --restore-path {resnet8_run / 'ckpt-4.pt'} is a checkpoint file: "
                                       f"give its run folder {resnet8_run}"]


@pytest.mark.parametrize("given", ["checkpoint", "folder"])
def test_inference_embedded_builds_the_model_of_the_run_it_restores(resnet8_run, given):
    """A ResNet-8 run's checkpoint (or its folder: the newest) without --dataset or --model-size: ResNet-8 on the
    built-in dataset, and the checkpoint's weights load into it."""
    path = resnet8_run / "ckpt-4.pt" if given == "checkpoint" else resnet8_run
    resolved = resolve_command_line("infer", ["--restore-path", str(path)])
    cfg = resolved.config
    assert (cfg.model.arch, cfg.model.size, cfg.data.dataset, cfg.model.num_classes) == ("resnet", "8", "builtin", 10)
    assert cfg.data.source == "generated"  # it times generated images, not the run's data
    run = json.loads((resnet8_run / "arguments.json").read_text())
    assert (cfg.train.micro_batch_size, cfg.precision.precision) == (run["micro_batch_size"], run["precision"])
    model = build_inference_model(cfg, resnet8_run / "ckpt-4.pt", torch.device("cpu"))
    resnet8 = build_model(ModelSpec(arch="resnet", size="8", num_classes=10, image_size=32))
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in resnet8.parameters()) == 75290
    saved = torch.load(resnet8_run / "ckpt-4.pt", weights_only=True)["model"]["fc.weight"]
    torch.testing.assert_close(dict(model.named_parameters())["model.fc.weight"].float(), saved.float())


def test_inference_embedded_with_another_model_than_the_run_is_one_line(resnet8_run, capfd, tmp_path):
    out = scripts.run_here(capfd, "inference_embedded.py", "--restore-path", str(resnet8_run), "--model-size", "20",
                           cwd=tmp_path, expect=2)
    assert len(out.stderr.splitlines()) == 1
    assert out.stderr.startswith(f"error: {resnet8_run / 'ckpt-4.pt'} does not match the model resnet-20: missing")


def test_the_run_name_cannot_leave_the_log_dir(tmp_path, capfd):
    """--name-suffix is part of the run folder's name: a '/' in it would make the folder a path of its own."""
    work = tmp_path / "work"
    work.mkdir()
    log_dir = work / "logs"
    out = scripts.run_here(capfd, "train.py", "--dataset", "builtin", "--model-size", "8", "--iterations", "1",
                           "--log-dir", str(log_dir), "--name-suffix", "/../../escaped", cwd=work, expect=2)
    assert out.stderr.splitlines() == [f"error: --name-suffix '/../../escaped' holds '/': a run name is one folder "
                                       f"name inside --log-dir {log_dir}, not a path"]
    assert out.stdout == ""
    assert sorted(tmp_path.rglob("*")) == [work]  # no --log-dir, no escaped folder anywhere


def test_a_plain_name_suffix_names_the_run_folder(tmp_path, capfd):
    out = scripts.run_here(capfd, "train.py", "--dataset", "builtin", "--model-size", "8", "--micro-batch-size", "4",
                           "--iterations", "1", "--no-validation", "--log-dir", str(tmp_path / "logs"),
                           "--name-suffix", "first..try", cwd=tmp_path)
    [folder] = (tmp_path / "logs").iterdir()
    assert folder.name.startswith("RN8_bs4_") and "_first..try_" in folder.name and f" Saving to {folder}" in out.stdout


def test_open_restore_path_is_one_line_for_a_fifo(tmp_path):
    import os

    from cnns.runfolder.run_folder import open_restore_path

    fifo = tmp_path / "ckpt-1.pt"
    os.mkfifo(fifo)
    with pytest.raises(CheckpointError, match=f"^--restore-path {fifo} is neither a run folder nor a checkpoint file$"):
        open_restore_path(fifo)
