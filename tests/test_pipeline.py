"""Pipelined model parallelism on real processes (gloo over 127.0.0.1): a 2-stage ResNet-20 computes
the same updates as one process with the same micro-batches under every schedule, checkpoints hold
the whole model and restore at any stage count, Graphcore's pipelining command lines run, stages x
replicas run as 4 processes under torchrun.

Every process runs under a bounded timeout (test_replicas's helpers) and is killed on expiry.
"""

from __future__ import annotations

import re
import shutil

import pytest
import torch

from test_replicas import ROOT, TORCHRUN, data_dir, finish, relative_difference, start  # noqa: F401  (a fixture)
from test_replicas import train as train_with
from scripts import run_here, train_here

# CPU kernels sum in an order that depends on their thread count (one process, 1 vs 2 threads: 3e-4
# apart after 6 group-norm updates): every process here computes with one thread, so the layouts
# compared do the same arithmetic.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
ONE_THREAD_EACH = ("--threads-per-worker", "1")  # each worker of a launcher (restore.py keeps the run's)

pytestmark = pytest.mark.multiprocess

# The smallest run that shows a pipeline: ResNet-20, 4 micro-batches per update, 32.32, --seed, 6 updates.
PIPELINE = ("--dataset", "cifar-10", "--model-size", "20", "--precision", "32.32", "--micro-batch-size", "8",
            "--gradient-accumulation-count", "4", "--iterations", "6", "--log-freq", "3", "--ckpts-per-epoch", "0",
            "--seed", "3", "--optimiser", "momentum", "--warmup-epochs", "0", "--no-validation")
TWO_STAGES = ("--shards", "2", "--pipeline", "--pipeline-splits", "stage2/unit1/relu")
VARIANTS = {
    "group-norm": ("--group-norm", "--groups", "4"),
    "batch-norm": ("--batch-norm",),
    "group-norm-recomputed": ("--group-norm", "--groups", "4", "--enable-recomputation"),
    "batch-norm-recomputed": ("--batch-norm", "--enable-recomputation"),
    # 16.16 with bfloat16 weights, rounded to nearest so that both sides round alike: each stage sums its
    # micro-batch gradients in float32 as autograd produces them, as one process sums them.
    "group-norm-16.16": ("--group-norm", "--groups", "4", "--precision", "16.16", "--half-dtype", "bfloat16",
                         "--no-stochastic-rounding"),
}


def train(cwd, *args: str, script: str = "train.py"):
    """The root script as a child, the launcher of its stage processes."""
    threads = ONE_THREAD_EACH if script != "restore.py" else ()
    return train_with(cwd, *args, *threads, script=script, env=ONE_THREAD)


def launched_here(capfd, cwd, *args: str, script: str = "train.py", threads: tuple[str, ...] = ONE_THREAD_EACH):
    """The root script's command with this process as the launcher (tests/scripts.py `run_here`; one thread, as
    conftest sets for the suite): its stage processes are real processes on gloo, as a user's run starts them,
    without a launcher interpreter's seconds of start-up. (stdout, stderr), the workers' lines included."""
    done = run_here(capfd, script, *args, *(threads if script != "restore.py" else ()), cwd=cwd)
    return done.stdout, done.stderr


def one_process(tmp_path, data_dir, name, *args):  # noqa: F811
    """The reference run, in this process (one thread, as conftest sets for the suite): the same kernels on the
    same shapes as a stage process, without a new interpreter's start-up."""
    folder = tmp_path / name
    train_here(*args, "--data-dir", str(data_dir), "--logs-path", str(folder))
    return folder


# The tests that share the module's runs (the references, the uninterrupted 2-stage run) go to one test worker,
# so each run is made once.
SHARED_RUNS = pytest.mark.xdist_group("test_pipeline-runs")


@pytest.fixture(scope="module")
def references(data_dir, tmp_path_factory):  # noqa: F811
    """One process with accumulation 4, per norm and precision (recomputation changes no number: one reference
    each)."""
    tmp = tmp_path_factory.mktemp("pipeline-references")
    return {name: one_process(tmp, data_dir, name, *PIPELINE, *VARIANTS[name])
            for name in ("group-norm", "batch-norm", "group-norm-16.16")}


@pytest.fixture(scope="module")
def uninterrupted(data_dir, tmp_path_factory):  # noqa: F811
    """A 2-stage run of 6 updates with a checkpoint every 3 (16 updates an epoch, 5 checkpoints), Grouped (the
    default schedule): (its folder, what it printed)."""
    tmp = tmp_path_factory.mktemp("pipeline-uninterrupted")
    out, _ = train(tmp, *PIPELINE, *VARIANTS["group-norm"], *TWO_STAGES, "--ckpts-per-epoch", "5",
                   "--data-dir", str(data_dir), "--logs-path", str(tmp / "run"), "--log-all-instances", "true")
    return tmp / "run", out


# Norm x recomputation x schedule, every pair of values once (a pairwise cover: 6 runs instead of 12), with the
# riskiest triples in: batch norm recomputed under Interleaved, whose backward of one micro-batch recomputes its
# forward after the next micro-batch's forward. Group norm without recomputation under Grouped is the
# uninterrupted run the restore tests continue; under Interleaved it runs in 16.16 (bfloat16 weights).
TWO_STAGE_CASES = [
    ("group-norm", "Grouped"),
    ("batch-norm-recomputed", "Grouped"),
    ("batch-norm-recomputed", "Interleaved"),
    ("group-norm-16.16", "Interleaved"),
    ("group-norm-recomputed", "Sequential"),
    ("batch-norm", "Sequential"),
]


@SHARED_RUNS
@pytest.mark.parametrize("variant, schedule", TWO_STAGE_CASES, ids=[f"{v}-{s}" for v, s in TWO_STAGE_CASES])
def test_two_stages_update_as_one_process_with_accumulation(data_dir, references, uninterrupted, tmp_path, capfd,
                                                            schedule, variant):  # noqa: F811
    if (variant, schedule) == ("group-norm", "Grouped"):
        folder, out = uninterrupted
    else:
        folder = tmp_path / "pipelined"
        out, _ = launched_here(capfd, tmp_path, *PIPELINE, *VARIANTS[variant], *TWO_STAGES, "--pipeline-schedule",
                               schedule, "--data-dir", str(data_dir), "--logs-path", str(folder))
    reference = references[variant.replace("-recomputed", "")]
    # Bitwise: the stages run the model's pieces on the same micro-batches, shapes, kernels and thread count (one
    # per process) as the one process, and add the micro-batches' gradients into the same (float32) sums in the
    # same order.
    assert relative_difference(folder / "ckpt-6.pt", reference / "ckpt-6.pt") == 0.0
    mine, theirs = (torch.load(f / "ckpt-6.pt", weights_only=True) for f in (folder, reference))
    half = "16.16" in variant  # bfloat16 weights in the checkpoint, as the one process saves them
    assert mine["model"]["conv1.weight"].dtype == (torch.bfloat16 if half else torch.float32)
    assert list(mine["model"]) == list(theirs["model"])  # the whole model, in the model's order
    for key, value in theirs["model"].items():
        if not value.is_floating_point():  # batch-norm counts: 24 micro-batches, each counted once
            assert torch.equal(mine["model"][key], value), key
    # The optimiser state has one process's layout: momentum of every parameter, the same groups.
    assert mine["optimiser"]["inner"]["param_groups"] == theirs["optimiser"]["inner"]["param_groups"]
    for index, state in theirs["optimiser"]["inner"]["state"].items():
        buffer = mine["optimiser"]["inner"]["state"][index]["momentum_buffer"]
        assert torch.equal(buffer, state["momentum_buffer"])
    # The printed loss is the whole batch's, as one process prints it (rank 0's lines, which its log.txt holds:
    # the uninterrupted run prints every instance's).
    losses = [re.findall(r"loss: +([\d.]+)", (f / "log.txt").read_text()) for f in (folder, reference)]
    assert losses[0] and losses[0] == losses[1]
    assert " Batch Size: 32 (micro-batch 8 x accumulation 4 x replicas 1)" in out
    assert "Total Parameters:269722" in out  # ResNet-20 (group norm or batch norm: the same count)


@SHARED_RUNS
def test_each_stage_process_holds_only_its_part_of_the_model(uninterrupted):
    """Each stage's log says what its process holds: the parameters before the cut, or after it, and
    together the whole model once."""
    from cnns.models import build_model
    from cnns.runfolder.run_folder import RunFolder

    uninterrupted, _ = uninterrupted
    pattern = r" Pipeline stage (\d) of 2: (\d+) parameters, (\d+) tensors \((\S+) \.\.\. (\S+)\)"
    stages = [re.search(pattern, (folder / "log.txt").read_text()).groups()
              for folder in (uninterrupted, uninterrupted / "instance_1")]
    model = build_model(RunFolder.open(uninterrupted).config.model)
    names = [name for name, _ in model.named_parameters()]
    sizes = dict((name, parameter.numel()) for name, parameter in model.named_parameters())
    cut = names.index(stages[1][3])  # the second stage starts where the first ends
    assert [int(stage[0]) for stage in stages] == [1, 2]
    assert (stages[0][3], stages[0][4], stages[1][4]) == (names[0], names[cut - 1], names[-1])
    assert [int(stages[0][2]), int(stages[1][2])] == [cut, len(names) - cut]
    assert [int(stages[0][1]), int(stages[1][1])] == [sum(sizes[n] for n in names[:cut]),
                                                      sum(sizes[n] for n in names[cut:])]
    assert 0 < int(stages[0][1]) < 269722 and int(stages[0][1]) + int(stages[1][1]) == 269722


@SHARED_RUNS
@pytest.mark.parametrize("layout", [(), ("--shards", "1")], ids=["two-stages", "one-process"])
def test_a_pipelined_run_restores_at_any_stage_count(uninterrupted, tmp_path, layout, capfd):
    uninterrupted, _ = uninterrupted
    cut = tmp_path / "cut"
    shutil.copytree(uninterrupted, cut)
    for later in ("ckpt-6.pt", "training.csv"):  # as the run folder was after update 3
        (cut / later).unlink()
    if layout:  # one process: this one
        out = run_here(capfd, "restore.py", "--restore-path", str(cut), *layout).stdout
    else:
        out, _ = launched_here(capfd, tmp_path, "--restore-path", str(cut), script="restore.py")
    assert "Restoring training from latest checkpoint:" in out and "ckpt-3.pt" in out
    # Bitwise at either stage count: stages compute as one process does (test above), and the restored
    # run starts from the same state.
    assert relative_difference(cut / "ckpt-6.pt", uninterrupted / "ckpt-6.pt") == 0.0


def test_torchrun_runs_stages_by_replicas_with_batch_norm_spans_and_sharded_state_as_the_replicas_alone(data_dir, tmp_path, capfd):  # noqa: F811,E501
    """Under torchrun the world is stages x replicas: 4 processes, rank r stage r % 2 of replica r // 2. Batch-norm
    statistics over the two replicas of each stage, the optimiser state of each stage sharded over its replicas:
    the weights of the same two replicas without stages (test_replicas checks those against one process)."""
    spans = ("--batch-norm", "--replicas", "2", "--gradient-accumulation-count", "2", "--BN-span", "2", "--rts",
             "--iterations", "3")
    grid = tmp_path / "grid"
    out, _ = finish(start([*TORCHRUN, "--standalone", "--nproc-per-node", "4", str(ROOT / "train.py"), *PIPELINE,
                           *spans, *TWO_STAGES, "--data-dir", str(data_dir), "--logs-path", str(grid),
                           *ONE_THREAD_EACH],
                          tmp_path, ONE_THREAD))
    reference = tmp_path / "replicas"
    launched_here(capfd, tmp_path, *PIPELINE, *spans, "--data-dir", str(data_dir), "--logs-path", str(reference))
    # Bitwise: the same replicas, cut into stages that compute as the whole model does.
    assert relative_difference(grid / "ckpt-3.pt", reference / "ckpt-3.pt") == 0.0
    assert " Batch Size: 32 (micro-batch 8 x accumulation 2 x replicas 2)" in out
    assert "Optimiser state sharded over 2 replicas (--rts)" in out


# The pipelining tests of Graphcore's application (one update each, generated ImageNet). It counted a 4th
# stem input channel (its --fused-preprocessing padded images to 4 channels); with 3 channels these are the
# counts.
GRAPHCORE_PIPELINES = {
    # Small images where those lines do not depend on the size (parameters, batch), so that one update
    # stays small: 64x64, and 48x48 for EfficientNet-B0, whose update is 512 images. (EfficientNet-B1's own
    # 240x240, which its run name carries, is test_cli's.)
    "resnext14-2-stages": (("--model", "resnext", "--model-size", "14", "--shards", "2",
                            "--pipeline-splits", "stage3/unit1/relu", "--micro-batch-size", "2",
                            "--gradient-accumulation-count", "2", "--image-size", "64"), ["Total Parameters:9411880"]),
    "efficientnet-b0-2-stages": (("--model", "efficientnet", "--model-size", "B0", "--group-norm", "--shards", "2",
                                  "--pipeline-splits", "block3b", "--micro-batch-size", "128",
                                  "--gradient-accumulation-count", "4", "--image-size", "48"),
                                 ["Total Parameters:5288548", " Batch Size: 512 "]),
    "efficientnet-b1-4-stages": (("--model", "efficientnet", "--model-size", "B1", "--shards", "4",
                                  "--pipeline-splits", "block2a/c", "block4a", "block5c", "--micro-batch-size", "2",
                                  "--gradient-accumulation-count", "4", "--image-size", "64"),
                                 ["Total Parameters:7794184", "64x64"]),
    "resnet50-2-stages-x-2-replicas": (("--model", "resnet", "--model-size", "50", "--shards", "2", "--replicas", "2",
                                        "--pipeline-splits", "b3/3/relu", "--pipeline-schedule", "Grouped",
                                        "--micro-batch-size", "2", "--gradient-accumulation-count", "2",
                                        "--image-size", "64"),
                                       ["Total Parameters:25557032", " Batch Size: 8 "]),
}


@pytest.mark.parametrize("name", list(GRAPHCORE_PIPELINES))
def test_graphcores_pipelining_command_lines_train(tmp_path, capfd, name):
    args, expected = GRAPHCORE_PIPELINES[name]
    out, err = launched_here(capfd, tmp_path, "--dataset", "imagenet", "--generated-data", "--pipeline",
                             "--no-validation", "--enable-recomputation", "--iterations", "1", *args, "--log-dir",
                             str(tmp_path / "logs"), threads=())
    for line in expected:
        assert line in out, out
    (folder,) = (tmp_path / "logs").iterdir()  # named as Graphcore's application names runs
    assert re.search(r"loss: +\d+\.\d+", out)
    assert "Traceback" not in err
    # The checkpoint holds the whole model, as one process's would.
    checkpoint = torch.load(folder / "ckpt-1.pt", weights_only=True)
    assert sum(t.numel() for k, t in checkpoint["model"].items() if "running" not in k and t.is_floating_point()) \
        == int(re.search(r"Total Parameters:(\d+)", out).group(1))


def test_splits_auto_then_validation_with_the_whole_model_counting_every_image_once(data_dir, tmp_path, capfd):  # noqa: F811
    """--pipeline-splits auto: rank 0 measures and every stage takes its proposal. After training each of
    the 2 processes validates its share of the 101 test images with the whole model; the accuracy is
    that of one process validating the same checkpoint."""
    import csv
    import json

    from test_replicas import TEST_IMAGES

    folder = tmp_path / "auto"
    out, _ = launched_here(capfd, tmp_path, *(a for a in PIPELINE if a != "--no-validation"), *VARIANTS["group-norm"],
                           "--shards", "2", "--pipeline", "--pipeline-splits", "auto", "--iterations", "2",
                           "--data-dir", str(data_dir), "--logs-path", str(folder))
    chosen = re.search(r"--pipeline-splits auto: (\S+) \(measured", out).group(1)
    assert json.loads((folder / "arguments.json").read_text())["pipeline_splits"] == [chosen]
    assert chosen.startswith("stage") and "Pipeline time by stage (Grouped, 2 stages" in out
    with open(folder / "validation.csv") as f:
        rows = list(csv.DictReader(f))
    assert rows and [int(row["val_size"]) for row in rows] == [TEST_IMAGES] * len(rows)
    out = run_here(capfd, "validation.py", "--restore-path", str(folder / "ckpt-2.pt")).stdout
    accuracy = float(re.search(r"Validation top-1 accuracy:\s+([\d.]+)%", out).group(1))
    assert accuracy == pytest.approx(float(rows[-1]["val_acc"]), abs=5e-4)
