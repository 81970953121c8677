"""More --replicas than the machine holds: refused in one line, before any process starts, when the workers cannot
fit in the available memory (estimated from the model: cnns.parallel.launch.worker_memory); a notice when they
outnumber the cores; nothing checked under torchrun, whose launcher decided. The machine's memory and cores are
mocked, so these tests start no worker."""

from __future__ import annotations

from pathlib import Path

import pytest

import scripts
from cnns.errors import ConfigError
from cnns.parallel import launch

RUN = ("--synthetic-data", "--dataset", "cifar-10", "--model-size", "8", "--micro-batch-size", "8",
       "--iterations", "1", "--no-validation")


@pytest.fixture
def started(monkeypatch) -> list[int]:
    """The worker counts train.py asked to start; none is started."""
    import cnns.commands.train

    calls: list[int] = []
    monkeypatch.setattr(cnns.commands.train, "spawn_local_workers",
                        lambda command, argv, processes, timeout_s: calls.append(processes) or 0)
    return calls


def config(*argv: str):
    from cnns.cli.parsing import resolve_command_line

    return resolve_command_line("train", [*RUN, *argv]).config


def test_more_replicas_than_the_memory_holds_are_refused_in_one_line_before_any_starts(
        monkeypatch, tmp_path, capfd, started):
    monkeypatch.setattr(launch, "available_memory_bytes", lambda: 1 << 30)
    folder = tmp_path / "run"
    done = scripts.run_here(capfd, "train.py", *RUN, "--replicas", "8", "--logs-path", str(folder), expect=2)
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("error: --replicas 8: 8 worker processes need at least ") and line.endswith(
        "more than the 1.00 GiB available on this machine; start at most 2, or launch them with torchrun where the "
        "memory is"), line
    each = launch.worker_memory(config("--replicas", "8"))
    assert f"({each.total / (1 << 30):.2f} GiB each: interpreter " in line
    assert started == [] and not folder.exists()


def test_replicas_that_fit_start_and_more_than_the_cores_get_one_notice(monkeypatch, tmp_path, capfd, started):
    monkeypatch.setattr(launch, "available_memory_bytes", lambda: 64 << 30)
    monkeypatch.setattr(launch, "usable_cores", lambda: 2)
    done = scripts.run_here(capfd, "train.py", *RUN, "--replicas", "4", "--logs-path", str(tmp_path / "run"))
    assert started == [4]
    notices = [line for line in done.stderr.splitlines() if line.startswith("notice:")]
    assert notices == ["notice: --replicas 4 starts 4 worker processes on 2 usable CPU cores: they take turns on the "
                       "cores, one thread each"], done.stderr
    done = scripts.run_here(capfd, "train.py", *RUN, "--replicas", "2", "--logs-path", str(tmp_path / "run2"))
    assert started == [4, 2] and "usable CPU cores" not in done.stderr


def test_under_a_launcher_nothing_is_checked(monkeypatch):
    monkeypatch.setattr(launch, "available_memory_bytes", lambda: 1)
    monkeypatch.setattr(launch, "usable_cores", lambda: 1)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "8")
    launch.check_machine_holds_workers(config("--replicas", "8"))  # torchrun's agent started them: no refusal
    monkeypatch.delenv("RANK")
    with pytest.raises(ConfigError, match="^--replicas 8: 8 worker processes need"):
        launch.check_machine_holds_workers(config("--replicas", "8"))


def test_the_estimate_grows_with_the_micro_batch_and_the_optimiser_state():
    small, large = (launch.worker_memory(config("--micro-batch-size", size)) for size in ("8", "64"))
    assert large.activations == pytest.approx(8 * small.activations, rel=0.01)  # activations scale with the batch
    sgd, momentum = (launch.worker_memory(config("--optimiser", name, "--precision", "32.32"))
                     for name in ("SGD", "momentum"))
    parameters = 78_042  # ResNet-8 for CIFAR-10 (test_training.py's parameter counts)
    assert momentum.model - sgd.model == pytest.approx(4 * parameters, rel=0.05)  # one float32 buffer per weight
    evaluation = launch.worker_memory(config("--replicas", "2"), trains=False)
    assert evaluation.activations == 0 and evaluation.model < sgd.model


def test_the_fixed_cost_is_below_what_an_interpreter_with_the_imports_really_holds():
    """WORKER_FIXED_BYTES is a lower bound: this process, with every library a worker imports, holds more of its
    own (anonymous) memory."""
    import timm  # noqa: F401
    import torchvision  # noqa: F401

    import cnns.engine.setup  # noqa: F401

    rollup = Path("/proc/self/smaps_rollup")
    if not rollup.exists():
        pytest.skip("needs Linux's /proc/self/smaps_rollup")
    fields = dict(line.split(":", 1) for line in rollup.read_text().splitlines() if ":" in line)
    anonymous = int(fields["Anonymous"].split()[0]) * 1024
    assert anonymous > launch.WORKER_FIXED_BYTES


def test_available_memory_is_read_from_the_machine():
    available = launch.available_memory_bytes()
    if available is None:
        pytest.skip("neither /proc/meminfo nor a cgroup limit can be read here")
    assert 0 < available
