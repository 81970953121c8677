"""--ckpts-per-epoch gives the checkpoints asked where it can, by Graphcore's rule: one every int(updates per
epoch / N) updates counted from the start, from --ckpt-epochs-offset on, the initial weights and the last update's
too, at most once per device iteration (the host holds the weights only where it meets the device). Where the
request cannot be honoured as asked, one line at the start says what is saved instead."""

from __future__ import annotations

from pathlib import Path

import pytest

import scripts
from cnns.engine.cadence import checkpoint_cadence, device_iterations_as_run


@pytest.fixture(scope="module")
def data_dir(shapes_cifar10) -> Path:
    return shapes_cifar10("cadence", train=48, test=8, seed=6)  # micro-batch 4: 12 updates an epoch


def test_the_cadence_is_the_closed_form():
    # 12 updates an epoch, the host meeting the device every 1, 2 or 5 of them.
    assert checkpoint_cadence(12, 4, 1) == (3, None)
    assert checkpoint_cadence(12, 0, 1) == (None, None)
    assert checkpoint_cadence(12, 0.5, 5) == (25, "--ckpts-per-epoch 0.5 asks for checkpoints between the host's "
                                                  "synchronisations, every 5 updates (--device-iterations): one every "
                                                  "25 updates is saved instead")
    assert checkpoint_cadence(12, 4, 2)[0] == 4  # every 3 asked, coarsened to whole device iterations
    assert checkpoint_cadence(12, 1_000_000, 2)[0] == 2
    assert checkpoint_cadence(12, 6, 2) == (2, None)


@pytest.mark.parametrize("log_every, device_iterations, expected", [
    (10, 1000, 10), (10, 1, 1), (10, 2, 2), (10, 3, 3), (4, 2, 2), (1562, 1000, 781)])
def test_device_iterations_are_fitted_to_the_step_lines(log_every, device_iterations, expected):
    assert device_iterations_as_run(log_every, device_iterations) == expected


@pytest.mark.parametrize("cadence, expected, notice", [
    # 4 an epoch of 12 updates: every 3, between the step lines (every 10 updates); the run's last update too.
    (["--ckpts-per-epoch", "4"], [0, 3, 6, 9, 10], None),
    (["--ckpts-per-epoch", "4", "--ckpt-epochs-offset", "0.5"], [0, 6, 9, 10], None),
    (["--epochs-per-ckpt", "0.5"], [0, 6, 10], None),
    (["--ckpts-per-epoch", "1"], [0, 10], None),  # the first epoch's end is past the run's 10 updates
    (["--ckpts-per-epoch", "0"], [10], None),  # only the last
    (["--ckpts-per-epoch", "5"], [0, 2, 4, 6, 8, 10],
     "notice: --ckpts-per-epoch 5 does not divide an epoch's 12 updates: one every 2 updates is saved instead"),
    (["--ckpts-per-epoch", "20"], list(range(11)),
     "notice: --ckpts-per-epoch 20 asks for more checkpoints than an epoch's 12 updates: one after every update is "
     "saved instead"),
    # The host meets the device every 2 updates: every 3 asked is every 4 saved.
    (["--ckpts-per-epoch", "4", "--device-iterations", "2"], [0, 4, 8, 10],
     "notice: --ckpts-per-epoch 4 asks for checkpoints between the host's synchronisations, every 2 updates "
     "(--device-iterations): one every 4 updates is saved instead"),
    # The default device iterations (1000) fitted to the step lines: the host meets the device every 10 updates.
    (["--ckpts-per-epoch", "4", "--device-iterations", "1000"], [0, 10],
     "notice: --ckpts-per-epoch 4 asks for checkpoints between the host's synchronisations, every 10 updates "
     "(--device-iterations): one every 10 updates is saved instead"),
])
def test_the_checkpoints_are_exactly_those_asked(data_dir, tmp_path, capfd, cadence, expected, notice):
    folder = tmp_path / "run"
    out = scripts.run_here(capfd, "train.py", "--dataset", "cifar-10", "--data-dir", str(data_dir), "--model-size", "8",
                           "--micro-batch-size", "4", "--iterations", "10", "--log-freq", "10", "--no-validation",
                           "--seed", "3", "--device-iterations", "1", *cadence, "--logs-path", str(folder))
    assert sorted(int(path.stem.split("-")[1]) for path in folder.glob("ckpt-*.pt")) == expected
    notices = [line for line in out.stdout.splitlines() if line.startswith("notice: --ckpts-per-epoch")]
    assert notices == ([notice] if notice else [])
