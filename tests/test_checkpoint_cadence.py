"""--ckpts-per-epoch gives exactly the checkpoints asked (the loop meets the host at each, as it does for step
lines), by Graphcore's rule: one every int(updates per epoch / N) updates counted from the start, from
--ckpt-epochs-offset on, the initial weights and the last update's too. Where the request cannot be honoured as
asked, one line at the start says what is saved instead."""

from __future__ import annotations

from pathlib import Path

import pytest

import scripts


@pytest.fixture(scope="module")
def data_dir(shapes_cifar10) -> Path:
    return shapes_cifar10("cadence", train=48, test=8, seed=6)  # micro-batch 4: 12 updates an epoch


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
])
def test_the_checkpoints_are_exactly_those_asked(data_dir, tmp_path, capfd, cadence, expected, notice):
    folder = tmp_path / "run"
    out = scripts.run_here(capfd, "train.py", "--dataset", "cifar-10", "--data-dir", str(data_dir), "--model-size", "8",
                           "--micro-batch-size", "4", "--iterations", "10", "--log-freq", "10", "--no-validation",
                           "--seed", "3", *cadence, "--logs-path", str(folder))
    assert sorted(int(path.stem.split("-")[1]) for path in folder.glob("ckpt-*.pt")) == expected
    notices = [line for line in out.stdout.splitlines() if line.startswith("notice: --ckpts-per-epoch")]
    assert notices == ([notice] if notice else [])
