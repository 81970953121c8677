"""Precision x parallelism (DESIGN.md): with --replicas every replica holds the same weights after every update,
bitwise, in every precision; replicas update as one process with accumulation does, in every precision, on the seed's
ResNet-8 and a timm model named by its timm name (tests/model_kinds.py); and every
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

from digit_records import held_out_accuracy, write_digits_cifar10
from model_kinds import SEED, TIMM
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
EQUIVALENCE = ("--dataset", "cifar-10", "--micro-batch-size", "16", "--iterations", str(UPDATES),
               # 16 updates an epoch (512 images, 16 x 2): a checkpoint after every update, each update a host sync
               "--ckpts-per-epoch", "16", "--device-iterations", "1",
               "--optimiser", "momentum", "--warmup-epochs", "0", "--base-learning-rate-exponent", "-7",
               "--no-validation", "--seed", "3", "--dist-timeout", "60", *ONE_THREAD)
# Batch norm as the models have it: each replica's micro-batch is one of the one process's micro-batches
# (`cnns.data.batches.ShardPlan` deals whole runs of the order), so batch norm normalises the same groups of images.
# When rank r took every other position of the global batch, the same 32 images were normalised in other groups of
# 16, and the first update differed by 27 % (ResNet-8) and 128 % (the timm model) of itself in 32.32.
MODELS = {**SEED, **TIMM}
# Every precision on the seed's model; on timm's, float32 and the default 16.16 (bfloat16 weights, stochastic
# rounding), the policy whose all-reduce hook issue 70 broke.
CASES = [*((model, precision) for model in SEED for precision in PRECISIONS),
         *((model, precision) for model in TIMM for precision in ("32.32", "16.16-bfloat16"))]


@pytest.fixture(scope="module")
def shapes(shapes_cifar10) -> Path:
    return shapes_cifar10("precision-parallel", train=512, test=64, seed=21)


@pytest.mark.parametrize("model, precision", CASES)
def test_replicas_hold_bitwise_the_same_weights_after_every_update_and_update_as_accumulation(
        model, precision, shapes, tmp_path):
    replicas, accumulation = tmp_path / "replicas", tmp_path / "accumulation"
    options = (*EQUIVALENCE, *MODELS[model], *PRECISIONS[precision], "--data-dir", str(shapes))
    train_here(*options, "--logs-path", str(replicas), "--replicas", "2", "--ckpt-all-instances", "true", cwd=tmp_path)
    train_here(*options, "--logs-path", str(accumulation), "--gradient-accumulation-count", "2", cwd=tmp_path)
    for update in range(1, UPDATES + 1):
        ours = model_state(replicas / f"ckpt-{update}.pt")
        theirs = model_state(replicas / "instance_1" / f"ckpt-{update}.pt")
        assert ours.keys() == theirs.keys()
        unequal = [name for name in ours if not torch.equal(ours[name], theirs[name])]
        assert not unequal, f"after update {update} the replicas differ in {unequal}"
    # The first update, against the update itself, before training has amplified anything. The same micro-batches
    # and the same rounding stream: the replicas' mean gradient is the one process's sum of halves but for the order
    # of its additions: in 32.32 a float32 rounding (2^-24 relative; measured 8e-7 of the update on both models, the
    # Xeon of 2026-12-02); with half-precision arithmetic a half rounding of a gradient now and then (2^-8; 16.32
    # 1.9e-3, 16.16 float16 1.4e-3 on ResNet-8), which 16.16's stochastic rounding turns into a whole bfloat16 step
    # of a weight, as large as the weight's update where that is below one step (ResNet-8 1.1e-2, the timm model
    # 9.9e-3). The scrambled convolution gradients of issue 70 give every convolution weight another weight's
    # update: a difference of the order of the update itself, 10x above the bound in 16 bits.
    first, start = (parameters_only(model_state(folder / "ckpt-1.pt")) for folder in (replicas, accumulation)), \
        parameters_only(model_state(accumulation / "ckpt-0.pt"))
    ours, theirs = (weights - start for weights in first)
    assert float((ours - theirs).norm() / theirs.norm()) < (1e-4 if precision == "32.32" else 0.1)
    if model not in SEED and precision != "32.32":
        return
    # 6 updates on: momentum carries each difference on. Relative difference of the parameters
    # after 6 updates, measured on the Zen 5 EPYC (AVX512-BF16): 32.32 1.7e-5, 16.32 8.1e-4, 16.16 bfloat16 1.6e-3,
    # 16.16 float16 4.1e-4; with the scrambled convolution gradients of issue 70, 7.7e-2 in 16.16 (both half types).
    # 1e-2 sits 6x above the worst measured and 7x below the bug. The timm model: 1.9e-4 in 32.32; deeper, it
    # amplifies 16.16's rounding steps faster (2.0e-2 after 6 updates from 2.6e-4 after the first): there the first
    # update is the check.
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
# Every precision in every mode, on this CPU. The other CPU kind's default (16.16 where bfloat16 is only emulated:
# float32 convolution kernels) was measured in one process and 2 replicas, 81.8-85.9 % (docs/performance.md), and
# is tested as Graphcore's replicated test (tests/test_seed_replicated_training.py): not again here, for time.
CELLS = [pytest.param(precision, mode, id=f"{precision}-{mode}") for precision in PRECISIONS for mode in MODES]
# The bar: 32.32 in one process over seeds 1-12 reached 85.27 % of the held-out digits on average, standard
# deviation 1.97 points (81.48-87.88 %; docs/performance.md). On another CPU a cell's rounding differs, and 375
# updates carry a rounding difference as far as another seed would: each cell is one new draw. The bar is the
# one-sided Student-t prediction bound for one new run from 12, mean - t(11, 1 - 0.01/25) x sqrt(1 + 1/12) x sd =
# 85.27 - 4.76 x 1.97 = 75.9 %, which a cell that learns as 32.32 in one process misses with probability 0.04 %, so
# up to 25 cells (20 here) fail together by chance at most 1 % of the time (Bonferroni). It stands 5-10 points below every
# cell measured (81.5-86.2 %; micro-batches of 8 reach about 2 points less than one process's 16) and 22 above the
# replicas' scrambled float32 all-reduce of issue 70, put back on purpose: 51.2 % (bfloat16), 54.2 % (float16).
HELD_OUT_BAR = 75.9


@pytest.fixture(scope="module")
def digits(tmp_path_factory) -> Path:
    return write_digits_cifar10(tmp_path_factory.mktemp("cifar-10-digits"))


@pytest.mark.slow
@pytest.mark.parametrize(("precision", "mode"), CELLS)
def test_every_precision_in_every_parallel_mode_learns_the_digits_as_32_32_in_one_process(
        precision, mode, digits, tmp_path):
    run = tmp_path / "run"
    train_here(*LEARNING, *PRECISIONS[precision], *MODES[mode], "--data-dir", str(digits), "--logs-path", str(run),
               cwd=tmp_path)
    held_out = held_out_accuracy(run)
    print(f"{precision}, {mode}: {held_out:.2f} % of the held-out digits")
    assert held_out >= HELD_OUT_BAR, (f"{precision}, {mode}: {held_out:.2f} % of the held-out digits, below "
                                      f"the {HELD_OUT_BAR} % that 32.32 in one process reaches within its spread")
    if "--replicas" in MODES[mode] and "--shards" not in MODES[mode]:
        # and the replicas end with the same model, bitwise (each instance's own last checkpoint; the test above
        # checks every update; pipeline stages write from rank 0 only)
        (ours,), (theirs,) = (list(folder.glob("ckpt-*.pt")) for folder in (run, run / "instance_1"))
        ours, theirs = model_state(ours), model_state(theirs)
        assert ours.keys() == theirs.keys()
        assert [name for name in ours if not torch.equal(ours[name], theirs[name])] == []
