"""Data-parallel replicas on real processes (gloo over 127.0.0.1): replicas equal accumulation, BN
spans equal one big batch, sharded optimiser state equals unsharded, validation counts every image
once, torchrun (one node or two launchers), a lost worker recovered, signals, failures.

Every process started here runs under a bounded timeout and its whole tree is killed on expiry.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import processes
from model_kinds import MODELS
from processes import free_port
from scripts import run_here, train_here


pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parents[1]
TRAIN_IMAGES, TEST_IMAGES = 512, 101  # 101: not divisible by the replicas
TIMEOUT_S = 240
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]

# ResNet-8 with group norm in float32, 12 updates: the configuration of the equivalence tests. 16 updates an epoch,
# 5 checkpoints an epoch: at floor(k x 16 / 5) = 3, 6, 9, 12 (the host syncs there too).
COMMON = ("--dataset", "cifar-10", "--model-size", "8", "--precision", "32.32", "--group-norm", "--groups", "4",
          "--iterations", "12", "--log-freq", "6", "--device-iterations", "3", "--ckpts-per-epoch", "5", "--seed", "5",
          "--optimiser", "momentum",
          "--warmup-epochs", "0", "--base-learning-rate-exponent", "-9", "--no-validation",
          "--dist-timeout", "60")  # ranks give up on a dead or missing peer after 60 s: no test waits for ever


@pytest.fixture(scope="module")
def data_dir(shapes_cifar10) -> Path:
    return shapes_cifar10("replicas", train=TRAIN_IMAGES, test=TEST_IMAGES, seed=12)


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (torchrun's workers live in sessions of their own: a process group
    kill would miss them)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def start(command: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """A launcher or script, reaped with all its workers when the test ends (tests/processes.py)."""
    return processes.start(command, cwd=cwd, env={**ENV, **(env or {})}, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)


def finish(process: subprocess.Popen, expect: int | None = 0) -> tuple[str, str]:
    out, err = processes.communicate(process, TIMEOUT_S)  # kills the family and fails on expiry
    if expect is not None:
        assert process.returncode == expect, out[-3000:] + err[-3000:]
    return out, err


def train(cwd: Path, *args: str, script: str = "train.py", expect: int | None = 0,
          env: dict[str, str] | None = None) -> tuple[str, str]:
    return finish(start([sys.executable, str(ROOT / script), *args], cwd, env), expect)


def weights(path: Path) -> torch.Tensor:
    model = torch.load(path, weights_only=True)["model"]
    return torch.cat([t.flatten().double() for t in model.values() if t.is_floating_point()])


def relative_difference(a: Path, b: Path) -> float:
    x, y = weights(a), weights(b)
    return float((x - y).norm() / y.norm())


def common(norm: str = "--group-norm", model: tuple[str, ...] = (), validate: bool = False) -> list[str]:
    """COMMON with `norm` for its group norm, without --no-validation where the run `validate`s, and with the
    train.py options of `model` (tests/model_kinds.py) for its ResNet-8."""
    options = [norm if a == "--group-norm" else a for a in COMMON if not (validate and a == "--no-validation")]
    if model:
        at = options.index("--model-size")
        options[at:at + 2] = model
    return options


def trained(tmp: Path, name: str, data_dir: Path, *args: str, validate: bool = False,
            norm: str = "--group-norm", model: tuple[str, ...] = ()) -> Path:
    """A run of COMMON whose launcher is this process (tests/scripts.py `train_here`): its workers are real processes
    on gloo, started as a user's train.py starts them, without a launcher interpreter's seconds of start-up. The
    launcher itself is under test where it runs as a child: signals, exit codes, --replicas auto's affinity."""
    folder = tmp / name
    train_here(*common(norm, model, validate), "--data-dir", str(data_dir), "--logs-path", str(folder), *args, cwd=tmp)
    return folder


def trained_here(tmp: Path, name: str, data_dir: Path, *args: str, norm: str = "--group-norm",
                 model: tuple[str, ...] = ()) -> Path:
    """A one-process run of COMMON, in this process (one thread, as the replicas'), without a new interpreter."""
    folder = tmp / name
    train_here(*common(norm, model), "--data-dir", str(data_dir), "--logs-path", str(folder), *args)
    return folder


# Tests that share the module's runs below go to one test worker, so each run is made once.
SHARED_RUNS = pytest.mark.xdist_group("test_replicas-runs")
# One thread per replica whatever the machine's cores, so that runs launched in different ways compute alike
# (arguments.json records it: a restore or a validation of the run keeps it).
ONE_THREAD = ("--threads-per-worker", "1")


@pytest.fixture(scope="module")
def replicas_run(data_dir, tmp_path_factory) -> Path:
    """Two self-spawned replicas of 16 images, 12 updates, each checkpoint validated by both processes after
    training: what accumulation, a restore, sharded optimiser state, two torchrun launchers and validation are
    compared with."""
    return trained(tmp_path_factory.mktemp("replicas"), "replicas", data_dir, "--replicas", "2",
                   "--micro-batch-size", "16", *ONE_THREAD, validate=True)


@pytest.fixture(scope="module")
def accumulation_run(data_dir, tmp_path_factory) -> Path:
    """One process with accumulation 2 of 16 images: the replicas' global batch of 32."""
    return trained_here(tmp_path_factory.mktemp("accumulation"), "accumulation", data_dir,
                        "--gradient-accumulation-count", "2", "--micro-batch-size", "16")


def assert_replicas_train_as_accumulation(replicas: Path, accumulation: Path) -> None:
    # The same micro-batches, gradients and updates, but not the same float32 sums: the replicas add
    # their gradients in gloo's all-reduce, the one process in .grad, micro-batch after micro-batch, in
    # another order. Each update's gradient so differs by about one rounding (2^-24 relative), and 12
    # updates of training carry it on. Measured on the AVX-512 EPYC of 2026-11-24: 3.3e-8 (A1, two terms
    # reordered) and 5.8e-6 (A2, four); asserted 1e-4, which a wrong sample, a lost micro-batch or an
    # unscaled gradient (all >= 1e-2 here) breaks at once.
    assert relative_difference(replicas / "ckpt-12.pt", accumulation / "ckpt-12.pt") < 1e-4
    arguments = json.loads((replicas / "arguments.json").read_text())
    assert (arguments["replicas"], arguments["global_batch_size"]) == (2, 32)
    # The printed loss is the global batch's, so it matches the single process's: to the same rounding,
    # about 1e-6 on a loss of 2 here; 1e-4 keeps a margin and still fails on a loss of one replica's half.
    with open(replicas / "training.csv") as f, open(accumulation / "training.csv") as g:
        ours, theirs = ([float(row["loss_avg"]) for row in csv.DictReader(h)] for h in (f, g))
    assert len(ours) == len(theirs) > 0 and ours == pytest.approx(theirs, abs=1e-4)


@SHARED_RUNS
def test_replicas_train_as_one_process_with_accumulation(replicas_run, accumulation_run):
    assert_replicas_train_as_accumulation(replicas_run, accumulation_run)


def test_replicas_with_accumulation_train_as_one_process_with_more_accumulation(data_dir, tmp_path):
    replicas = trained(tmp_path, "replicas", data_dir, "--replicas", "2", "--gradient-accumulation-count", "2",
                       "--micro-batch-size", "8")
    accumulation = trained_here(tmp_path, "accumulation", data_dir, "--gradient-accumulation-count", "4",
                                "--micro-batch-size", "8")
    assert_replicas_train_as_accumulation(replicas, accumulation)


@SHARED_RUNS
def test_a_restored_replicated_run_continues_the_same_samples(replicas_run, tmp_path, capfd):
    cut = tmp_path / "cut"
    shutil.copytree(replicas_run, cut)
    # A checkpoint every 3 updates (16 an epoch, 5 checkpoints asked), between the step lines (every 6): continue
    # from ckpt-9, in the middle of a step line's window.
    for later in ("ckpt-12.pt", "training.csv"):
        (cut / later).unlink()
    out = run_here(capfd, "restore.py", "--restore-path", str(cut), cwd=tmp_path).stdout  # its 2 workers: processes
    assert "Restoring training from latest checkpoint:" in out and "ckpt-9.pt" in out
    # Bitwise: the restored run computes the same shapes on the same threads and kernels from the same
    # weights, optimiser state, random states and samples as the uninterrupted one.
    assert relative_difference(cut / "ckpt-12.pt", replicas_run / "ckpt-12.pt") == 0.0


@pytest.mark.parametrize("model", MODELS)
def test_bn_span_over_two_replicas_equals_batch_norm_over_their_whole_batch(model, data_dir, tmp_path):
    # Batch-norm training amplifies rounding quickly here: one process alone, run with 2 threads
    # instead of 1, differs by 1.7e-4 after 12 updates. Three updates keep the comparison at rounding.
    short = ("--iterations", "3", "--log-freq", "3")
    span = trained(tmp_path, "span", data_dir, "--replicas", "2", "--micro-batch-size", "8", "--BN-span", "2",
                   *short, norm="--batch-norm", model=MODELS[model])
    one = trained_here(tmp_path, "one", data_dir, "--micro-batch-size", "16", *short, norm="--batch-norm",
                       model=MODELS[model])
    # The span's statistics are sums of per-replica sums (all-reduced), the one process's one sum over 16
    # images: the same terms in another order, one float32 rounding apart per statistic, and batch norm's
    # division by the deviation amplifies that. Measured 7.2e-6 after 3 updates on the AVX-512 EPYC (ResNet-8);
    # a span that normalised each replica alone (8 images) differs by more than 1e-3. The timm model's batch norms
    # are timm's norm + activation layers (BatchNormAct2d), spanned inside the fused CPU passes, 34 of them: measured
    # 1.2e-6 (ResNet-8: 1.4e-8) on the Xeon of 2026-12-02.
    assert relative_difference(span / "ckpt-3.pt", one / "ckpt-3.pt") < 1e-4
    a, b = (torch.load(f / "ckpt-3.pt", weights_only=True)["model"] for f in (span, one))
    statistics = [key for key in b if key.endswith(("running_mean", "running_var"))]  # of 16 images, every layer's
    assert statistics
    # Per layer against the layer's own scale: a mean near zero is a cancellation of terms of the layer's size,
    # and its rounding is theirs (an element-wise rtol failed on a 0.003 mean of a timm layer whose others are 0.05).
    for key in statistics:
        assert float((a[key] - b[key]).norm()) <= 1e-4 * float(b[key].norm()) + 1e-6, key


@SHARED_RUNS
def test_rts_shards_the_optimiser_state_and_changes_no_weight(data_dir, replicas_run, tmp_path):
    sharded = trained(tmp_path, "rts", data_dir, "--replicas", "2", "--micro-batch-size", "16", "--rts",
                      "--log-all-instances", "true", *ONE_THREAD)
    plain = replicas_run
    # Bitwise: each replica applies the same element-wise momentum update to its shard that the plain
    # optimiser applies to the whole, from the same all-reduced gradients, and broadcasts the result.
    assert relative_difference(sharded / "ckpt-12.pt", plain / "ckpt-12.pt") == 0.0
    owned = []
    for log in (sharded / "log.txt", sharded / "instance_1" / "log.txt"):
        line = re.search(r"owns (\d+) of (\d+) optimiser state elements", log.read_text())
        owned.append((int(line.group(1)), int(line.group(2))))
    total = owned[0][1]
    assert sum(mine for mine, _ in owned) == total and all(0.3 * total < mine < 0.7 * total for mine, _ in owned)
    # The checkpoint holds the whole optimiser state, in the plain optimiser's layout.
    a, b = (torch.load(f / "ckpt-12.pt", weights_only=True)["optimiser"]["inner"] for f in (sharded, plain))
    assert a["state"].keys() == b["state"].keys()
    for key in b["state"]:
        assert torch.equal(a["state"][key]["momentum_buffer"], b["state"][key]["momentum_buffer"])


# Mixup draws from the global stream and its own generator on every update: the streams move.
MIXUP = ("--mixup-alpha", "0.5")
# The tests that read the instances' run share one test worker, so it is made once.
ON_THE_INSTANCES_RUN = pytest.mark.xdist_group("test_replicas-instances")


def assert_replica_streams(checkpoint: Path, identical: bool) -> None:
    rank0, rank1 = torch.load(checkpoint, weights_only=True)["rng_by_rank"]
    for stream in ("torch", "gen:mix"):
        assert torch.equal(rank0[stream], rank1[stream]) == identical, stream
    assert (rank0["python"] == rank1["python"]) == identical


def test_identical_replica_seeding_gives_every_replica_the_same_random_streams(data_dir, tmp_path):
    folder = trained(tmp_path, "seeding", data_dir, "--replicas", "2", "--micro-batch-size", "16", *MIXUP,
                     "--iterations", "4", "--identical-replica-seeding")
    assert_replica_streams(folder / "ckpt-4.pt", identical=True)


@ON_THE_INSTANCES_RUN
def test_replicas_are_seeded_apart_by_default(instances_run):
    assert_replica_streams(instances_run / "ckpt-12.pt", identical=False)


def test_replicas_auto_on_a_cpu_is_one_process_where_it_has_matrix_units_else_one_per_core(monkeypatch):
    from cnns.parallel import world

    monkeypatch.setattr(world, "usable_cores", lambda: 4)
    cpu = torch.device("cpu")
    assert world.auto_replicas(1, cpu, cpu_has_matrix_units=True) == 1
    assert world.auto_replicas(1, cpu, cpu_has_matrix_units=False) == 4
    assert world.auto_replicas(2, cpu, cpu_has_matrix_units=False) == 2  # replicas x shards = cores


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_replicas_auto_picks_the_process_count_for_this_cpu(data_dir, tmp_path):
    from cnns.precision import cpu_half_is_emulated

    cores = os.sched_getaffinity(0)
    folder = tmp_path / "auto"
    # This process is the launcher (its workers are real processes), on two cores while it runs: the affinity
    # --replicas auto reads, which the workers inherit.
    os.sched_setaffinity(0, sorted(cores)[:2])
    try:
        train_here(*COMMON, "--data-dir", str(data_dir), "--logs-path", str(folder), "--replicas", "auto",
                   "--micro-batch-size", "16", "--log-all-instances", "true", cwd=tmp_path)
    finally:
        os.sched_setaffinity(0, cores)
    arguments = json.loads((folder / "arguments.json").read_text())
    if not cpu_half_is_emulated(torch.device("cpu"), torch.bfloat16):  # matrix units: one process is faster
        assert (arguments["replicas"], arguments["global_batch_size"]) == (1, 16)
        assert not (folder / "instance_1").exists()
        return
    assert (arguments["replicas"], arguments["global_batch_size"]) == (2, 32)
    assert "step:" in (folder / "instance_1" / "log.txt").read_text()  # a second process trained
    assert not (folder / "instance_2").exists()


@SHARED_RUNS
def test_distributed_validation_counts_every_image_once(replicas_run, tmp_path, capfd):
    folder = tmp_path / "val"
    shutil.copytree(replicas_run, folder)  # validation.py below adds its rows to the run's validation.csv
    with open(folder / "validation.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(row["val_size"]) for row in rows] == [TEST_IMAGES] * len(rows) and rows
    # The same checkpoint validated by one process gives the same accuracy.
    single = tmp_path / "single"
    single.mkdir()
    out = run_here(capfd, "validation.py", "--restore-path", str(folder / "ckpt-12.pt"), cwd=single).stdout
    accuracy = float(re.search(r"Validation top-1 accuracy:\s+([\d.]+)%", out).group(1))
    assert accuracy == pytest.approx(float(rows[-1]["val_acc"]), abs=5e-4)  # printed with 3 decimals
    # validation.py itself over 2 processes (Graphcore's application runs it under poprun): the same count and accuracy.
    out = run_here(capfd, "validation.py", "--restore-path", str(folder / "ckpt-12.pt"), "--replicas", "2",
                   cwd=single).stdout
    assert f"{accuracy:6.3f}%" in out
    with open(folder / "validation.csv") as f:
        assert [int(row["val_size"]) for row in csv.DictReader(f)][-1] == TEST_IMAGES


@SHARED_RUNS
def test_two_torchrun_launchers_on_loopback_make_one_run(data_dir, replicas_run, tmp_path):
    port = free_port()
    folder = tmp_path / "two-nodes"
    launchers = [start([*TORCHRUN, "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1",
                        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "cnns-test",
                        str(ROOT / "train.py"), *COMMON, "--data-dir", str(data_dir), "--logs-path", str(folder),
                        "--replicas", "2", "--micro-batch-size", "16", *ONE_THREAD], tmp_path) for node in (0, 1)]
    outputs = [finish(launcher) for launcher in launchers]
    arguments = json.loads((folder / "arguments.json").read_text())
    assert (arguments["replicas"], arguments["global_batch_size"]) == (2, 32)
    # poprun --host: the two hosts' processes train the model that two local replicas train, bit for bit (the
    # same two ranks, shards, threads and all-reduce), which is one process's with accumulation (test above).
    assert relative_difference(folder / "ckpt-12.pt", replicas_run / "ckpt-12.pt") == 0.0
    # poprun --only-output-from-instance 0, the default: rank 1 prints no line of the run and writes nothing.
    (node0, _), (node1, _) = outputs
    assert "Saving to" in node0 and "step:" in node0
    assert not any(word in node1 for word in ("Saving", "step:", "Total Parameters", "Saved checkpoint")), node1
    assert not list(folder.glob("instance_*")) and not list(tmp_path.glob("logs*"))


@pytest.fixture(scope="module")
def instances_run(data_dir, tmp_path_factory) -> Path:
    """Graphcore's popdist run: two torchrun instances that both log and checkpoint, with batch norm, and
    with mixup, whose streams the replicas' own seeds set apart."""
    tmp = tmp_path_factory.mktemp("instances")
    folder = tmp / "instances"
    batch_norm = ["--batch-norm" if a == "--group-norm" else a for a in COMMON]
    finish(start([*TORCHRUN, "--standalone", "--nproc-per-node", "2", str(ROOT / "train.py"), *batch_norm,
                  "--data-dir", str(data_dir), "--logs-path", str(folder), "--replicas", "2", "--micro-batch-size", "16",
                  *MIXUP, "--log-all-instances", "true", "--ckpt-all-instances", "true"], tmp))
    return folder


@ON_THE_INSTANCES_RUN
def test_torchrun_instances_log_and_checkpoint_with_equal_weights(instances_run):
    # Graphcore's popdist test: every instance's checkpoint holds the same model. With batch norm, each
    # replica tracks running statistics of its own shard; they are averaged before every checkpoint.
    folder = instances_run
    instance = folder / "instance_1"
    for place in (folder, instance):
        assert json.loads((place / "arguments.json").read_text())["replicas"] == 2
    assert "step:" in (instance / "log.txt").read_text()
    for iteration in (0, 6, 12):  # weights and running statistics, bit for bit
        assert torch.equal(weights(folder / f"ckpt-{iteration}.pt"), weights(instance / f"ckpt-{iteration}.pt"))
    state = torch.load(folder / "ckpt-12.pt", weights_only=True)["model"]
    assert "bn1.running_mean" in state and state["bn1.running_var"].ne(1).any()  # trained statistics


def _worker_of_rank(launcher: subprocess.Popen, rank: int) -> int | None:
    for pid in descendants(launcher.pid):
        try:
            environment = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environment:
            return pid
    return None


@SHARED_RUNS
def test_a_worker_killed_under_torchrun_max_restarts_is_recovered(data_dir, replicas_run, tmp_path):
    """torchrun --max-restarts 1 starts both workers again after one is killed; they restore the latest checkpoint
    and end where the uninterrupted replicas (the module's run, 12 updates) end. Killed once checkpoint 3 is
    written: 9 updates and two checkpoints remain, each longer than the test's 50 ms poll between seeing the
    checkpoint and killing."""
    folder = tmp_path / "recovered"
    launcher = start([*TORCHRUN, "--standalone", "--max-restarts", "1", "--nproc-per-node", "2",
                      str(ROOT / "train.py"), *COMMON, "--data-dir", str(data_dir), "--logs-path", str(folder),
                      "--replicas", "2", "--micro-batch-size", "16", *ONE_THREAD], tmp_path)
    deadline = time.monotonic() + TIMEOUT_S
    while not (folder / "ckpt-3.pt").exists() and launcher.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    victim = _worker_of_rank(launcher, 1)
    assert victim is not None and launcher.poll() is None, "the run ended before a worker could be killed"
    os.kill(victim, signal.SIGKILL)
    out, _ = finish(launcher)
    assert "Restoring training from latest checkpoint:" in out
    assert relative_difference(folder / "ckpt-12.pt", replicas_run / "ckpt-12.pt") < 1e-6


# Long enough to be stopped mid-run (its updates take seconds after the first step line, which the tests wait
# for), short enough for restore.py to finish it quickly.
LONG_RUN = 60


def started_long_run(folder: Path, data_dir: Path, cwd: Path) -> subprocess.Popen:
    """A self-spawned 2-replica run of LONG_RUN updates, returned once its first step line is written."""
    run = start([sys.executable, str(ROOT / "train.py"), *COMMON, "--data-dir", str(data_dir), "--logs-path",
                 str(folder), "--replicas", "2", "--micro-batch-size", "16", "--iterations", str(LONG_RUN),
                 "--log-freq", "1",
                 "--ckpts-per-epoch", "0"], cwd)
    deadline = time.monotonic() + TIMEOUT_S
    while not (folder / "training.csv").exists() and run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return run


def test_sigterm_to_a_self_spawned_run_checkpoints_once_and_restore_continues(data_dir, tmp_path, capfd):
    folder = tmp_path / "stopped"
    run = started_long_run(folder, data_dir, tmp_path)
    workers = descendants(run.pid)
    run.send_signal(signal.SIGTERM)
    out, _ = finish(run, expect=128 + signal.SIGTERM)  # after the checkpoint: a run that did not finish
    stopped_at = int(re.search(r"Training interrupted by SIGTERM at iteration (\d+)", out).group(1))
    assert 0 < stopped_at < LONG_RUN
    assert [p.name for p in sorted(folder.glob("ckpt-*.pt"))] == [f"ckpt-{stopped_at}.pt"]
    assert not [pid for pid in workers if Path(f"/proc/{pid}").exists()], "orphan worker processes left"
    out = run_here(capfd, "restore.py", "--restore-path", str(folder), cwd=tmp_path).stdout
    assert f"ckpt-{stopped_at}.pt" in out and (folder / f"ckpt-{LONG_RUN}.pt").is_file()


def test_a_rendezvous_that_never_completes_ends_with_one_line(tmp_path):
    env = {**ENV, "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    process = processes.start([sys.executable, str(ROOT / "train.py"), "--dataset", "cifar-10", "--generated-data",
                                "--model-size", "8", "--replicas", "2", "--iterations", "1", "--dist-timeout", "3"],
                               cwd=tmp_path, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, err = finish(process, expect=2)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "rank 1" in lines[0] and "--dist-timeout" in lines[0], err


# Options two launchers may be given differently, each member of the kind: an option every process resolves alike,
# and the seed, which rank 0 hands to the others only when none was given (a drawn seed).
@pytest.mark.parametrize("option, values", [("--micro-batch-size", ("16", "8")), ("--seed", ("5", "6"))])
def test_mismatched_options_across_ranks_are_named(data_dir, tmp_path, option, values):
    port = free_port()
    launchers = [start([*TORCHRUN, "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1",
                        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "cnns-mismatch",
                        str(ROOT / "train.py"), *COMMON, "--data-dir", str(data_dir), "--logs-path",
                        str(tmp_path / "mismatch"), "--replicas", "2", "--micro-batch-size", "16",
                        option, values[node]],
                       tmp_path) for node in (0, 1)]
    outputs = [finish(launcher, expect=None) for launcher in launchers]
    assert all(launcher.returncode != 0 for launcher in launchers)
    errors = [line for _, err in outputs for line in err.splitlines() if line.startswith("error:")]
    dest = option.removeprefix("--").replace("-", "_")
    assert errors and all("rank 1 was started with different options" in line and f"{dest} = {values[1]}" in line
                          for line in errors), errors
    assert not (tmp_path / "mismatch" / "training.csv").exists()


def test_a_worker_that_dies_stops_the_run_with_one_line_naming_it(data_dir, tmp_path):
    folder = tmp_path / "dies"
    run = started_long_run(folder, data_dir, tmp_path)
    victim = _worker_of_rank(run, 1)
    assert victim is not None and run.poll() is None
    os.kill(victim, signal.SIGKILL)
    _, err = finish(run, expect=None)
    assert run.returncode != 0
    lines = [line for line in err.splitlines() if line.strip()]
    assert any("rank 1" in line and "SIGKILL" in line for line in lines), err
    assert "Traceback" not in err


def test_ctrl_c_to_torchrun_reaches_every_worker_and_leaves_one_checkpoint(data_dir, tmp_path):
    folder = tmp_path / "interrupted"
    launcher = start([*TORCHRUN, "--standalone", "--nproc-per-node", "2", str(ROOT / "train.py"), *COMMON,
                      "--data-dir", str(data_dir), "--logs-path", str(folder), "--replicas", "2",
                      "--micro-batch-size", "16", "--iterations", "400", "--log-freq", "1", "--ckpts-per-epoch", "0"],
                     tmp_path)
    deadline = time.monotonic() + TIMEOUT_S
    while not (folder / "training.csv").exists() and launcher.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    workers = descendants(launcher.pid)
    launcher.send_signal(signal.SIGINT)
    out, _ = finish(launcher, expect=None)
    stopped_at = int(re.search(r"Training interrupted by SIGINT at iteration (\d+)", out).group(1))
    assert [p.name for p in sorted(folder.glob("ckpt-*.pt"))] == [f"ckpt-{stopped_at}.pt"]
    assert not [pid for pid in workers if Path(f"/proc/{pid}").exists()], "orphan worker processes left"
