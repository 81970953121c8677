import sys
from pathlib import Path

# Tests run against the checkout's sources whether or not the package is installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import os

# `make test` is the CPU suite on every machine. A GPU, where there is one, is hidden from it and from the
# scripts its tests start, which would otherwise train on it by default (and two workers would share it);
# `make test-gpu` (CNNS_TEST_GPU=1) runs the CUDA tier there. Set before torch reads it.
GPU_TIER = os.environ.get("CNNS_TEST_GPU") == "1"
if not GPU_TIER:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

# pytest-xdist runs two workers on two cores: one torch thread each, and for the scripts the tests
# launch (they inherit the environment), avoids oversubscription: two workers each running a thread per
# core would contend for the same cores, and small convolutions suffer most. Set for every test here, so no
# test module repeats it.
os.environ["OMP_NUM_THREADS"] = "1"

import torch  # noqa: E402

torch.set_num_threads(1)


import pytest  # noqa: E402

import processes  # noqa: E402


NO_GPU = "no CUDA GPU here" if GPU_TIER else "the CUDA tier: make test-gpu runs it on a machine with a GPU"


def pytest_collection_modifyitems(config, items):
    """The CUDA tier is skipped without a GPU, with one reason that the summary below counts; the tests of an
    xdist_group go to one worker."""
    keep_xdist_groups_together(config, items)
    if torch.cuda.is_available():
        return
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=NO_GPU))


def keep_xdist_groups_together(config, items):
    """`--dist loadgroup` sends the tests of one `xdist_group` to one worker, so a trained run they share is made
    once. pytest-xdist 3.8 marks the group by appending it to `item._nodeid`, which pytest 9 no longer reads (a
    node's id is the structured `item._id`): every group was silently spread over the workers. This sets the id
    pytest 9 reads, in the worker, with the same `name@group` form the scheduler splits. Imported here, not at the
    top: `_pytest.nodeid` is private and pytest 8 has none, and `make test-gpu` runs under a GPU machine's own pytest."""
    if not getattr(config, "workerinput", None) or not config.getvalue("loadgroup"):
        return
    try:
        from _pytest.nodeid import NodeId  # pytest 9's structured ids
    except ImportError:  # an older pytest (a GPU machine's own) reads the `_nodeid` xdist sets: nothing to do
        return
    for item in items:
        groups = sorted({str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
                         for mark in item.iter_markers("xdist_group")})
        if groups and "@" not in item.nodeid:
            item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(groups)}")


def pytest_terminal_summary(terminalreporter):
    """Counts the CUDA tests skipped for want of a GPU, and only those: on a GPU the tier's other skips (two GPUs
    needed, a torch that crashes loading a package) say their own reasons, and were miscounted as 'no GPU here'."""
    skipped = [r for r in terminalreporter.stats.get("skipped", [])
               if "cuda" in getattr(r, "keywords", {}) and NO_GPU in skip_reason(r)]
    if skipped:
        terminalreporter.write_line(f"{len(skipped)} CUDA tests skipped ({NO_GPU})")


def skip_reason(report) -> str:
    """A skipped test's reason: pytest keeps it as the last item of the (path, line, reason) longrepr."""
    longrepr = getattr(report, "longrepr", None)
    return str(longrepr[-1]) if isinstance(longrepr, tuple) else str(longrepr or "")


@pytest.fixture(autouse=True)
def reap_children():
    """Whatever a test started and left running (a failed assertion before its clean-up) is killed
    with everything it started, so that no process outlives its test; a passing test that left one
    running fails."""
    yield
    left = processes.reap()
    assert not left, f"the test left processes running: {left}"


@pytest.fixture(scope="session")
def shapes_cifar10(tmp_path_factory):
    """Makes a learnable CIFAR-10 binary folder of the built-in dataset's drawn shapes: `train` training and
    `test` test images drawn with `seed`, in a new folder named cifar-10-<name>-... (the name tells the
    dataset, as the rule of Graphcore's application reads it)."""
    from cnns.data.drawn_shapes import draw_shapes
    from cnns.data.cifar_records import write_cifar10

    def make(name: str, *, train: int, test: int, seed: int) -> Path:
        folder = tmp_path_factory.mktemp(f"cifar-10-{name}")
        images, labels = draw_shapes(train + test, seed=seed)
        write_cifar10(folder, (images[:train], labels[:train]), (images[train:], labels[train:]))
        return folder

    return make


@pytest.fixture(scope="session")
def plateau_data(shapes_cifar10) -> Path:
    """2,000 training and 1,000 test drawings in CIFAR-10 format, with the class names as the CIFAR-10 binary
    archive ships them (batches.meta.txt: one a line, then a blank line)."""
    from cnns.data.drawn_shapes import BUILTIN_CLASSES

    folder = shapes_cifar10("plateau", train=2000, test=1000, seed=4)
    (folder / "batches.meta.txt").write_text("\n".join(BUILTIN_CLASSES) + "\n\n")
    return folder


@pytest.fixture(scope="session")
def plateau_run_32(plateau_data, tmp_path_factory) -> Path:
    """The 32.32 plateau run (tests/scripts.py), in this process, with a moving average of its weights
    (--ema-decay 0.9, which cnns predict offers) and its folder named by train.py (--log-dir). About 89 % on its
    1,000 test images. Tests that read it carry `scripts.ON_THE_PLATEAU_RUN`."""
    from scripts import plateau_options, train_here

    logs = tmp_path_factory.mktemp("plateau-32") / "logs"
    train_here(*plateau_options("32.32", plateau_data), "--ema-decay", "0.9", "--log-dir", str(logs))
    (folder,) = logs.iterdir()
    return folder
