"""Precision x parallelism (DESIGN.md): with --replicas every replica holds the same weights after every update,
bitwise, in every precision; replicas update as one process with accumulation does, in every precision; and every
precision x parallel mode learns scikit-learn's handwritten digits as 32.32 in one process does, within the
run-to-run spread measured over seeds (docs/performance.md, "Precision x parallelism").

The bug these stand guard against (issue 70): 16.16's float32 all-reduce hook read DDP's gradient buckets through
torch's ``GradBucket.gradients()``, which views every stretch of the bucket as contiguous while DDP fills it in
the parameter's own memory order; every channels_last convolution weight of 16.16 replicas so trained on a
permutation of its gradient. The replicas still agreed bitwise (all held the same wrong update), a float32 run was
untouched (DDP's own all-reduce never views the bucket), and the seed's replicated test reached 46.7 % where one
process reached 98.7 %.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cpu_kinds import bfloat16_is_native, simulate_emulated_bfloat16
from digit_records import held_out_accuracy, write_digits_cifar10
from scripts import train_here

pytestmark = pytest.mark.multiprocess

# Every precision a run can ask for, with the half type named, so a CPU that only emulates it still runs it
# (without --half-dtype such a CPU runs 16.x in float32: tests/test_precision.py).
PRECISIONS = {
    "32.32": ("--precision", "32.32"),
    "16.32": ("--precision", "16.32", "--half-dtype", "bfloat16"),
    "16.16-bfloat16": ("--precision", "16.16", "--half-dtype", "bfloat16"),
    "16.16-float16": ("--precision", "16.16", "--half-dtype", "float16"),
}
ONE_THREAD = ("--threads-per-worker", "1")


def model_state(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)["model"]


def parameters_only(state: dict[str, torch.Tensor]) -> torch.Tensor:
    """The trained parameters as one float64 vector (batch-norm running statistics left out: a replica tracks its
    own micro-batches' and the one process its two micro-batches' in turn, so they differ by design)."""
    return torch.cat([t.flatten().double() for name, t in state.items()
                      if t.is_floating_point() and not name.endswith(("running_mean", "running_var"))])


# ---------------------------------------------------------------------------------------------
# Bitwise agreement and replicas = accumulation, after every update, in every precision


UPDATES = 6
# Group norm: per sample, so the replicas' split of the global batch into micro-batches is the one process's
# whatever it is (batch norm's statistics are each micro-batch's).
EQUIVALENCE = ("--dataset", "cifar-10", "--model-size", "8", "--group-norm", "--groups", "4", "--micro-batch-size", "16", "--iterations", str(UPDATES),
               # 16 updates an epoch (512 images, 16 x 2): a checkpoint after every update, each update a host sync
               "--ckpts-per-epoch", "16", "--device-iterations", "1",
               "--optimiser", "momentum", "--warmup-epochs", "0", "--base-learning-rate-exponent", "-7",
               "--no-validation", "--seed", "3", "--dist-timeout", "60", *ONE_THREAD)


@pytest.fixture(scope="module")
def shapes(shapes_cifar10) -> Path:
    return shapes_cifar10("precision-parallel", train=512, test=64, seed=21)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_replicas_hold_bitwise_the_same_weights_after_every_update_and_update_as_accumulation(
        precision, shapes, tmp_path):
    replicas, accumulation = tmp_path / "replicas", tmp_path / "accumulation"
    train_here(*EQUIVALENCE, *PRECISIONS[precision], "--data-dir", str(shapes), "--logs-path", str(replicas),
               "--replicas", "2", "--ckpt-all-instances", "true", cwd=tmp_path)
    train_here(*EQUIVALENCE, *PRECISIONS[precision], "--data-dir", str(shapes), "--logs-path", str(accumulation),
               "--gradient-accumulation-count", "2", cwd=tmp_path)
    for update in range(1, UPDATES + 1):
        ours = model_state(replicas / f"ckpt-{update}.pt")
        theirs = model_state(replicas / "instance_1" / f"ckpt-{update}.pt")
        assert ours.keys() == theirs.keys()
        unequal = [name for name in ours if not torch.equal(ours[name], theirs[name])]
        assert not unequal, f"after update {update} the replicas differ in {unequal}"
    # The same micro-batches and the same rounding stream: the replicas' mean gradient is the one process's
    # sum of halves, but for float32's order of additions (2^-24 relative) and the half-precision arithmetic of
    # two differently shaped passes; a stochastic rounding turns such a difference into one half-precision step
    # of a weight now and then (2^-8 relative in bfloat16), and momentum carries it on. Relative difference of
    # the parameters after 6 updates, measured on the Zen 5 EPYC (AVX512-BF16): 32.32 1.7e-5, 16.32 8.1e-4,
    # 16.16 bfloat16 1.6e-3, 16.16 float16 4.1e-4; with the scrambled convolution gradients of issue 70, 7.7e-2
    # in 16.16 (both half types). 1e-2 sits 6x above the worst measured and 7x below the bug.
    x, y = (parameters_only(model_state(folder / f"ckpt-{UPDATES}.pt")) for folder in (replicas, accumulation))
    assert float((x - y).norm() / y.norm()) < 1e-2


# ---------------------------------------------------------------------------------------------
# Every precision x every parallel mode learns the digits as 32.32 in one process does


# ResNet-8 for 4 epochs (375 updates of 16 digits), momentum at 2^-7 x 16 on a cosine schedule, seeded: about 85 %
# of the 297 held-out digits, short of the plateau, where a gradient that is wrong, late or scrambled shows. (At
# 2^-6 one seed in 8 stayed near chance for 2 epochs and ended at 70 %: docs/performance.md.)
LEARNING = ("--dataset", "cifar-10", "--model-size", "8", "--epochs", "4", "--warmup-epochs", "0", "--lr-schedule",
            "cosine", "--optimiser", "momentum", "--base-learning-rate-exponent", "-7", "--seed", "1",
            "--ckpts-per-epoch", "0", "--logs-per-epoch", "1", "--dist-timeout", "120", *ONE_THREAD)
SPLIT = ("--pipeline", "--pipeline-splits", "stage2/unit1/relu")  # ResNet-8's stages 1-2 | stage 3 and the head
# Every mode at the one process's global batch of 16 (micro-batch x accumulation x replicas), so each learns at
# the same learning rate for the same number of updates, and every parallel mode on micro-batches of 8: batch
# norm's statistics are each micro-batch's, and over 4 images they cost replicas x stages 8-11 points here (2
# micro-batches of 4 in flight: 74.4-79.1 %, where micro-batches of 8 reach 81.8-86.2 %; docs/performance.md).
MODES = {
    "one process": ("--micro-batch-size", "16"),
    "accumulation 2": ("--micro-batch-size", "8", "--gradient-accumulation-count", "2"),
    "2 replicas": ("--micro-batch-size", "8", "--replicas", "2", "--ckpt-all-instances", "true"),
    "2 stages": ("--micro-batch-size", "8", "--gradient-accumulation-count", "2", "--shards", "2", *SPLIT),
    "2 replicas x 2 stages": ("--micro-batch-size", "8", "--replicas", "2", "--shards", "2", *SPLIT),
}
# Every precision in every mode on this CPU; and 16.16 in bfloat16, the default where the CPU computes bfloat16,
# on a CPU that only emulates it (tests/cpu_kinds.py), which computes its convolutions with float32 kernels: the
# bar holds on both kinds (on an emulated CPU its own cells are that kind already). The kind changes only each
# process's choice of kernels, so two modes carry it: one process (this process) and 2 replicas (their workers,
# and the all-reduce that scrambled 16.16's gradients); all five passed, 81.8-85.9 % (docs/performance.md).
EMULATED = "bfloat16 emulated"
CELLS = [pytest.param(precision, mode, "this CPU", id=f"{precision}-{mode}") for precision in PRECISIONS
         for mode in MODES] + [pytest.param("16.16-bfloat16", mode, EMULATED, id=f"16.16-bfloat16-{mode}-{EMULATED}")
                               for mode in ("one process", "2 replicas")]
# The bar: 32.32 in one process over seeds 1-12 reached 85.27 % of the held-out digits on average, standard
# deviation 1.97 points (81.48-87.88 %; docs/performance.md). On another CPU a cell's rounding differs, and 375
# updates carry a rounding difference as far as another seed would: each cell is one new draw. The bar is the
# one-sided Student-t prediction bound for one new run from 12, mean - t(11, 1 - 0.01/25) x sqrt(1 + 1/12) x sd =
# 85.27 - 4.76 x 1.97 = 75.9 %, which a cell that learns as 32.32 in one process misses with probability 0.04 %, so
# up to 25 cells (22 here) fail together by chance at most 1 % of the time (Bonferroni). It stands 5-10 points below every
# cell measured (81.5-86.2 %; micro-batches of 8 reach about 2 points less than one process's 16) and 22 above the
# replicas' scrambled float32 all-reduce of issue 70, put back on purpose: 51.2 % (bfloat16), 54.2 % (float16).
HELD_OUT_BAR = 75.9


@pytest.fixture(scope="module")
def digits(tmp_path_factory) -> Path:
    return write_digits_cifar10(tmp_path_factory.mktemp("cifar-10-digits"))


@pytest.mark.slow
@pytest.mark.parametrize(("precision", "mode", "cpu"), CELLS)
def test_every_precision_in_every_parallel_mode_learns_the_digits_as_32_32_in_one_process(
        precision, mode, cpu, digits, tmp_path, monkeypatch):
    if cpu == EMULATED:
        if not bfloat16_is_native():
            pytest.skip("this CPU only emulates bfloat16: its own 16.16-bfloat16 cells are this kind")
        simulate_emulated_bfloat16(tmp_path / "probes", monkeypatch)
    run = tmp_path / "run"
    train_here(*LEARNING, *PRECISIONS[precision], *MODES[mode], "--data-dir", str(digits), "--logs-path", str(run),
               cwd=tmp_path)
    held_out = held_out_accuracy(run)
    print(f"{precision}, {mode}, {cpu}: {held_out:.2f} % of the held-out digits")
    assert held_out >= HELD_OUT_BAR, (f"{precision}, {mode}, {cpu}: {held_out:.2f} % of the held-out digits, below "
                                      f"the {HELD_OUT_BAR} % that 32.32 in one process reaches within its spread")
    if "--replicas" in MODES[mode] and "--shards" not in MODES[mode]:
        # and the replicas end with the same model, bitwise (each instance's own last checkpoint; the test above
        # checks every update; pipeline stages write from rank 0 only)
        (ours,), (theirs,) = (list(folder.glob("ckpt-*.pt")) for folder in (run, run / "instance_1"))
        ours, theirs = model_state(ours), model_state(theirs)
        assert ours.keys() == theirs.keys()
        assert [name for name in ours if not torch.equal(ours[name], theirs[name])] == []
