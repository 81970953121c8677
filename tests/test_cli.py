"""The command lines of Graphcore's application are accepted, and options resolve to its values."""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path

import pytest

import processes
import scripts

from cnns.cli import parse_options, resolved_training_options
from cnns.config import run_name

ROOT = Path(__file__).resolve().parents[1]
GRAPHCORE_COMMAND_LINES = ROOT / "tests" / "data" / "graphcore_command_lines.txt"


def graphcore_command_lines(script: str) -> list[list[str]]:
    """Every `<script> ...` command line of Graphcore's application's two READMEs, as argv lists (tests/data keeps them)."""
    commands = []
    for line in GRAPHCORE_COMMAND_LINES.read_text().splitlines():
        if line.startswith("#") or not line.strip():
            continue
        _readme, name, arguments = line.split(" ", 2)
        if name == script:
            commands.append(shlex.split(arguments))
    return commands


TRAIN_LINES = graphcore_command_lines("train.py")
VALIDATION_LINES = graphcore_command_lines("validation.py")
EMBEDDED_LINES = graphcore_command_lines("inference_embedded.py")
RESTORE_LINES = graphcore_command_lines("restore.py")


def test_graphcore_command_lines_are_all_collected():
    # Counted from the two READMEs: a parametrised test below that silently collected nothing would pass.
    assert (len(TRAIN_LINES), len(VALIDATION_LINES), len(EMBEDDED_LINES), len(RESTORE_LINES)) == (20, 12, 1, 1)


@pytest.mark.parametrize("argv", TRAIN_LINES, ids=lambda a: " ".join(a)[:80])
def test_every_graphcore_train_command_line_resolves(argv, monkeypatch):
    monkeypatch.setenv("DATA_DIR", "/nonexistent/imagenet")
    # What it says: each line resolves without error (config.py computes the batch and learning rate from
    # them by the rules the tests of those rules check; restating the product here would check nothing).
    options, _ = resolved_training_options("train", argv)
    assert options["learning_rate"] > 0 and options["model"] in ("resnet", "resnext", "efficientnet")


# The standard architectures' parameter counts (torchvision's and timm's ImageNet models, He et al.'s
# CIFAR ResNets), with 1,000 classes on ImageNet and 10 on CIFAR-10.
STANDARD_PARAMETERS = {("resnet", "18"): 11_689_512, ("resnet", "50"): 25_557_032, ("resnext", "101"): 44_177_704,
                       ("efficientnet", "B4"): 19_341_616, ("resnet", "8"): 75_290}


@pytest.mark.parametrize("argv", TRAIN_LINES, ids=lambda a: " ".join(a)[:80])
def test_every_graphcore_train_command_line_builds_its_model_on_as_many_devices_as_its_name_says(argv, monkeypatch):
    import re

    import torch

    from cnns.config import RunConfig
    from cnns.models import build_model

    monkeypatch.setenv("DATA_DIR", "/nonexistent/imagenet")
    options, _ = resolved_training_options("train", argv)
    spec = RunConfig.from_options(options).model
    with torch.device("meta"):  # the model the run would build, without its memory
        parameters = sum(p.numel() for p in build_model(spec).parameters())
    size = str(options["model_size"])
    architecture = (options["model"], "B" + size.lstrip("bB") if options["model"] == "efficientnet" else size)
    if options["model"] == "efficientnet" and options.get("group_dim", 1) > 1:
        # Graphcore's g16 variant: group convolutions of 16 channels with expansion ratio 4 instead of
        # depthwise ones with 6, "with a similar number of trainable parameters" (the application's README).
        assert abs(parameters / STANDARD_PARAMETERS[architecture] - 1) < 0.01, parameters
    else:
        assert parameters == STANDARD_PARAMETERS[architecture]
    # A configuration named for N IPUs (or a POD of N) runs on N devices: replicas x pipeline stages.
    named = re.search(r"(?:_(\d+)ipus|_pod(\d+)_)", options.get("config") or "")
    if named:
        assert options["replicas"] * options["shards"] == int(named.group(1) or named.group(2))


@pytest.mark.parametrize("argv", VALIDATION_LINES, ids=lambda a: " ".join(a)[:80])
def test_every_graphcore_validation_command_line_prints_its_config(argv, capsys):
    from cnns.cli.runs import validate_main

    assert validate_main(argv + ["--print-config"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["micro_batch_size"] >= 1


@pytest.mark.parametrize("argv", EMBEDDED_LINES, ids=lambda a: " ".join(a)[:80])
def test_every_graphcore_inference_embedded_command_line_prints_its_config(argv, capsys):
    from cnns.cli.inference import infer_main as infer_command

    assert infer_command(argv + ["--print-config"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["micro_batch_size"] == int(argv[argv.index("--micro-batch-size") + 1])


@pytest.mark.parametrize("argv", RESTORE_LINES, ids=lambda a: " ".join(a)[:80])
def test_every_graphcore_restore_command_line_parses(argv):
    values, _ = parse_options("restore", argv)
    assert values["restore_path"] == argv[argv.index("--restore-path") + 1]


@pytest.mark.parametrize("config, global_batch", [
    ("resnet50_mlperf_pod16_bs20", 1920),
    ("resnext101_16ipus", 768),
    ("resnet50_bn_16ipus", 16384),
    ("efficientnet_b4_g1_16ipus", 768),
    ("efficientnet_b4_g16_16ipus", 6144),
])
def test_named_configurations_give_graphcores_global_batch(config, global_batch):
    options, _ = resolved_training_options("train", ["--config", config, "--data-dir", "/x/imagenet"])
    assert options["global_batch_size"] == global_batch


def test_print_config_from_the_root_script_is_json_with_arguments_keys(tmp_path):
    out = processes.run([sys.executable, str(ROOT / "train.py"), "--config", "resnet8_test", "--data-dir",
                          str(tmp_path / "cifar-10"), "--print-config"], capture_output=True, text=True, check=True)
    printed = json.loads(out.stdout)
    for key in ("replicas", "shards", "micro_batch_size", "gradient_accumulation_count", "global_batch_size",
                "learning_rate"):
        assert key in printed
    assert printed["learning_rate"] == 0.5
    assert not (tmp_path / "cifar-10").exists()  # --print-config reads no data and writes nothing


def test_learning_rate_rule_of_graphcores_application():
    options, _ = resolved_training_options("train", ["--dataset", "cifar-10", "--data-dir", "/x", "--micro-batch-size", "16",
                                                     "--base-learning-rate-exponent", "-4"])
    assert options["learning_rate"] == 1.0
    options, _ = resolved_training_options("train", ["--dataset", "cifar-10", "--data-dir", "/x", "--abs-learning-rate", "0.3"])
    assert options["learning_rate"] == 0.3


def test_dataset_dependent_defaults_and_run_names():
    cifar, _ = resolved_training_options("train", ["--data-dir", "/data/cifar-10-batches-bin"])
    assert (cifar["dataset"], cifar["model_size"], cifar["micro_batch_size"], cifar["batch_norm"], cifar["epochs"]) == \
        ("cifar-10", "20", 32, True, 160.0)
    assert cifar["name"] == "RN20_bs32_BN_16.16"
    imagenet, _ = resolved_training_options("train", ["--data-dir", "/data/imagenet"])
    assert (imagenet["model_size"], imagenet["micro_batch_size"], imagenet["group_norm"], imagenet["groups"],
            imagenet["epochs"]) == ("18", 4, True, 32, 100.0)
    assert imagenet["name"] == "RN18_bs4_GN32_16.16"
    effnet, _ = resolved_training_options("train", ["--model", "efficientnet", "--data-dir", "/data/imagenet",
                                                    "--gradient-accumulation-count", "16"])
    assert effnet["name"] == "EfficientNet-B0_bs4x16a_GN4"
    # Graphcore's EfficientNet-B1 pipelining line: B1's own 240 px, which its run name carries.
    b1, _ = resolved_training_options("train", ["--model", "efficientnet", "--model-size", "B1", "--dataset", "imagenet",
                                                "--generated-data", "--shards", "4", "--pipeline", "--pipeline-splits",
                                                "block2a/c", "block4a", "block5c", "--micro-batch-size", "2",
                                                "--gradient-accumulation-count", "4"])
    assert (b1["image_size"], b1["name"]) == (240, "EfficientNet-B1_bs2x4p_GN4_240x240")
    resnext, _ = resolved_training_options("train", ["--model", "resnext", "--dataset", "cifar-10", "--data-dir", "/x",
                                                     "--no-stochastic-rounding", "--name-suffix", "try"])
    assert resnext["name"] == "RNX29_bs32_BN_16.16_noSR_try"


@pytest.mark.parametrize("argv, groups", [
    (["--dataset", "cifar-10"], {16}),  # Graphcore's CIFAR default: ResNet-20's 16, 32 and 64 channels in 16 groups
    (["--dataset", "imagenet", "--model-size", "18"], {32}),
    (["--dataset", "imagenet", "--model", "efficientnet"], {4}),
    (["--dataset", "cifar-10", "--groups", "8"], {8}),
])
def test_group_norm_groups_default_by_dataset_and_model_and_reach_every_norm(argv, groups):
    import torch
    from torch import nn

    from cnns.config import RunConfig
    from cnns.models import build_model

    options, _ = resolved_training_options("train", [*argv, "--synthetic-data", "--group-norm"])
    with torch.device("meta"):
        model = build_model(RunConfig.from_options(options).model)
    norms = [m for m in model.modules() if isinstance(m, nn.GroupNorm)]
    assert norms and not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    assert {m.num_groups for m in norms} == groups


def test_ipu_only_options_are_named_in_one_notice():
    _, notices = parse_options("train", ["--dataset", "cifar-10", "--available-memory-proportion", "0.1",
                                         "--enable-conv-dithering", "--internal-exchange-optimisation-target", "memory"])
    assert len(notices) == 1
    for flag in ("--available-memory-proportion", "--enable-conv-dithering", "--internal-exchange-optimisation-target"):
        assert flag in notices[0]


@pytest.mark.parametrize("argv, message", [
    (["--config", "no_such_config"], "unknown config 'no_such_config'"),
    (["--config", "resnet50_bn_16ipu"], "unknown config 'resnet50_bn_16ipu' in"),
    (["--config", "resnet50_bn_16ipu"], "; did you mean 'resnet50_bn_16ipus' or"),
    (["--dataset", "cifar-10", "--data-dir", "/x", "--micro-batch-size", "0"], "--micro-batch-size must be at least 1"),
    (["--dataset", "cifar-10", "--data-dir", "/x", "--shards", "2"], "--shards should be used in combination"),
    (["--dataset", "cifar-10", "--data-dir", "/nonexistent/folder", "--iterations", "1"], "data folder not found"),
    (["--dataset", "cifar-10", "--data-dir", "/x", "--shards", "2", "--pipeline", "--pipeline-splits", "stage9/unit1/relu"],
     "unknown pipeline split stage9/unit1/relu"),
    (["--dataset", "cifar-10", "--data-dir", "/x", "--shards", "3", "--pipeline", "--pipeline-splits", "stage2/unit1/relu"],
     "--shards 3 needs 2 --pipeline-splits, got 1 (stage2/unit1/relu); valid splits: stage1/unit1/relu (b1/0/relu"),
    (["--dataset", "cifar-10", "--data-dir", "/x", "--shards", "2", "--pipeline", "--pipeline-splits", "stage2/unit1/relu",
      "--compile"], "--compile with pipeline stages (--shards > 1) is not supported yet"),
    (["--dataset", "cifar-10", "--data-dir", "/x", "--BN-span", "2"], "--BN-span 2 spans replicas"),
    (["--dataset", "cifar-10", "--data-dir", "/x", "--group-norm", "--replicas", "2", "--BN-span", "2"],
     "--BN-span 2 spans the statistics of batch norms over replicas, and ResNet-20 has none (--group-norm replaced"),
])
def test_bad_input_is_one_clear_line_and_exit_2(capfd, argv, message):
    # train.py's command run in this process through cnns.cli.run_script, which the root script calls, with fds 1
    # and 2 captured (a C library's message would show): a new interpreter per case costs seconds and checks
    # nothing more. test_the_root_script_stops_with_the_same_one_line runs the script itself.
    err = scripts.run_here(capfd, "train.py", *argv, expect=2).stderr
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], err


def test_the_root_script_stops_with_the_same_one_line():
    out = processes.run([sys.executable, str(ROOT / "train.py"), "--dataset", "cifar-10", "--data-dir", "/x",
                         "--shards", "3", "--pipeline", "--pipeline-splits", "stage2/unit1/relu"],
                        capture_output=True, text=True)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.startswith("error: --shards 3 needs 2 --pipeline-splits") and len(out.stderr.splitlines()) == 1


def test_help_is_grouped_like_graphcores_application():
    out = processes.run([sys.executable, str(ROOT / "train.py"), "--help"], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("usage: train.py")
    for group in ("Model:", "Dataset:", "Training:", "Logging:"):
        assert group in out.stdout


@pytest.mark.parametrize("script", ["validation.py", "restore.py", "weight_avg.py"])
def test_every_root_script_starts_as_its_own_program(script):
    """The tests run most commands in their own process (tests/scripts.py); each root script is still started as a
    user starts it at least once here (train.py above; inference_embedded.py in test_embedded)."""
    out = processes.run([sys.executable, str(ROOT / script), "--help"], capture_output=True, text=True, check=True)
    assert out.stdout.startswith(f"usage: {script}") and "--restore-path" in out.stdout


def test_a_process_that_only_starts_workers_or_reads_options_loads_no_engine():
    """Parsing a command line, checking it and starting a run's workers import torch only: timm, torchvision and
    torch._dynamo (seconds of start-up, in every worker anyway) stay out of the launcher and of --help, also where
    the launcher builds a CIFAR ResNet to check the --pipeline-splits of its stages. The engine's modules, and
    fusing a CIFAR ResNet's passes, import neither timm nor torch's pipelining either: a CIFAR worker pays for
    neither (torch._dynamo it pays for anyway: torch's optimisers import it when built)."""
    code = ("import sys; import cnns.cli.runs, cnns.commands.train, cnns.commands.restore, cnns.models; "
            "from cnns.models import ModelSpec, build_model, resolve_splits; "
            "spec = ModelSpec(arch='resnet', size='20', num_classes=10, image_size=32, norm='group', groups=4); "
            "assert resolve_splits(spec, build_model(spec), ['stage2/unit1/relu']); "
            "print(sorted(m for m in ('timm', 'torchvision', 'torch._dynamo') if m in sys.modules)); "
            "import cnns.engine.setup, cnns.engine.assembly, cnns.engine.ema; "
            "from cnns.engine.fusion import fuse_norm_activations, fuse_squeeze_excitation; "
            "model = build_model(spec); assert fuse_norm_activations(model) == 9 + 1; "
            "assert fuse_squeeze_excitation(model) == 0; "
            "print(sorted(m for m in ('timm', 'torchvision', 'torch.distributed.pipelining') if m in sys.modules))")
    out = processes.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                        env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert out.stdout.splitlines() == ["[]", "[]"], out.stdout + out.stderr


def test_run_name_pipeline_and_replica_tags():
    options, _ = resolved_training_options("train", ["--config", "resnet50_bn_16ipus", "--data-dir", "/x/imagenet"])
    assert run_name(options) == "RN50_bs16x4rx256p_BN_16.32"


def test_a_pipelined_configuration_fitted_to_one_shard_runs(tmp_path, capfd):
    """resnet50_bn_16ipus sets pipeline, 4 shards, 3 splits and recomputation; with --shards 1 its splits
    are the recomputation points of one process (here: one update of generated data, to show it gets
    past option checks and trains)."""
    out = scripts.run_here(capfd, "train.py", "--config", "resnet50_bn_16ipus", "--shards", "1", "--replicas", "1",
                           "--generated-data", "--dataset", "imagenet", "--image-size", "64", "--micro-batch-size",
                           "2", "--gradient-accumulation-count", "1", "--iterations", "1", "--no-validation",
                           "--log-dir", str(tmp_path), cwd=tmp_path)
    assert "--pipeline with --shards 1: one stage; its --pipeline-splits are the recomputation points" in out.stdout
    assert "step:" in out.stdout


def test_a_run_resolves_its_configuration_once_and_the_engine_never_again(monkeypatch, tmp_path):
    """The command line becomes one frozen RunConfig per process; what the processes agree on later comes back
    as a replace of it, so a training run (validation after it included) builds it exactly once."""
    from cnns.config import RunConfig

    built = []
    original = RunConfig.from_options.__func__
    monkeypatch.setattr(RunConfig, "from_options", classmethod(lambda cls, o: built.append(cls) or original(cls, o)))
    folder = tmp_path / "run"
    scripts.train_here("--synthetic-data", "--dataset", "cifar-10", "--model-size", "8", "--iterations", "2",
                       "--micro-batch-size", "8", "--seed", "3", "--validation-images", "16",
                       "--logs-path", str(folder))
    assert len(built) == 1
    assert json.loads((folder / "arguments.json").read_text())["seed"] == 3
