"""Decisions that depend on the device, taken on this CPU with `torch.cuda` mocked where the logic allows:
one half type however the GPU is chosen, the DataLoader's pinned memory, --replicas auto, a GPU that is
not there. (The CUDA tier, `make test-gpu`, runs the same paths on a real GPU.)"""

from __future__ import annotations

import pytest
import torch

from cnns.cli import resolved_training_options

IMAGENET = ["--config", "resnet50_bn_16ipus", "--data-dir", "/nonexistent/imagenet"]
PLAIN = ["--model", "resnet", "--model-size", "50", "--data-dir", "/nonexistent/imagenet"]


@pytest.fixture
def two_gpus(monkeypatch):
    """A machine with two CUDA GPUs, as far as the option logic can tell."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)

    def set_bf16(supported: bool) -> None:
        # What torch.cuda reports of an Ampere (8.0) or a Volta (7.0) GPU. Like torch's own, the fake
        # is_bf16_supported() says True on both unless asked without emulation (Volta emulates bfloat16 far
        # slower than its float16): a half type decided from it would be bfloat16 on Volta.
        capability = (8, 0) if supported else (7, 0)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                            lambda including_emulation=True: including_emulation or supported)

    set_bf16(True)
    return set_bf16


@pytest.mark.parametrize("bf16, half, loss_scale", [(True, "bfloat16", 1.0), (False, "float16", 128.0)],
                         ids=["ampere", "volta"])
@pytest.mark.parametrize("choice", [[], ["--device", "cuda"], ["--device", "cuda:1"], ["--select-ipus", "0"]],
                         ids=["default", "device", "device-index", "select-ipus"])
def test_every_way_of_choosing_the_gpu_gives_its_one_half_type(two_gpus, choice, bf16, half, loss_scale):
    two_gpus(bf16)
    options, _ = resolved_training_options("train", [*IMAGENET, *choice])
    assert options["half_dtype"] == half and options["half_dtype_given"] is False
    # The loss scale follows the half type where the configuration does not set one (this one sets 128).
    options, _ = resolved_training_options("train", [*PLAIN, *choice])
    assert (options["half_dtype"], options["loss_scaling"]) == (half, loss_scale)


def test_on_a_cpu_the_half_type_is_bfloat16_and_an_explicit_one_is_kept(two_gpus):
    options, _ = resolved_training_options("train", [*PLAIN, "--device", "cpu"])
    assert (options["half_dtype"], options["loss_scaling"]) == ("bfloat16", 1.0)
    options, _ = resolved_training_options("train", [*PLAIN, "--half-dtype", "float16"])
    assert (options["half_dtype"], options["loss_scaling"], options["half_dtype_given"]) == ("float16", 128.0, True)


@pytest.mark.parametrize("script", ["validate", "weight-avg"])
def test_validation_without_a_run_takes_the_devices_half_type_and_a_runs_is_kept(two_gpus, tmp_path, script):
    import json

    from cnns.cli.parsing import resolved_evaluation_options

    two_gpus(False)  # a GPU without bfloat16 arithmetic: float16
    _, options, _, _ = resolved_evaluation_options(script, PLAIN)
    assert (options["half_dtype"], options["half_dtype_given"]) == ("float16", False)
    _, options, _, _ = resolved_evaluation_options(script, [*PLAIN, "--device", "cpu"])
    assert options["half_dtype"] == "bfloat16"
    _, options, _, _ = resolved_evaluation_options(script, [*PLAIN, "--half-dtype", "bfloat16"])
    assert (options["half_dtype"], options["half_dtype_given"]) == ("bfloat16", True)
    # A run trained on a CPU keeps its half type when validated on this GPU (its checkpoints are in it).
    trained, _ = resolved_training_options("train", [*PLAIN, "--device", "cpu"])
    (tmp_path / "arguments.json").write_text(json.dumps(trained))
    _, options, _, _ = resolved_evaluation_options(script, ["--restore-path", str(tmp_path)])
    assert options["half_dtype"] == "bfloat16"


def test_the_half_type_is_that_of_the_gpu_the_run_uses_not_the_current_one(two_gpus, monkeypatch):
    # cuda:0 a Volta, cuda:1 an Ampere; torch's current device stays cuda:0.
    capabilities = {0: (7, 0), 1: (8, 0)}

    def capability(device=None):
        index = torch.device(device).index if device is not None else None
        return capabilities[0 if index is None else index]

    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    for choice, half in ([["--device", "cuda:1"], "bfloat16"], [["--select-ipus", "1"], "bfloat16"],
                         [["--device", "cuda:0"], "float16"], [[], "float16"]):
        options, _ = resolved_training_options("train", [*PLAIN, *choice])
        assert options["half_dtype"] == half, choice


@pytest.mark.parametrize("argv, message", [
    (["--device", "cuda:3"], "device cuda:3 requested but this machine has 2 GPUs (cuda:0, cuda:1)"),
    (["--select-ipus", "2"], "device cuda:2 requested but this machine has 2 GPUs (cuda:0, cuda:1)"),
    (["--device", "tpu"], "unknown device 'tpu'; use cpu, cuda or cuda:N"),
])
def test_a_gpu_that_is_not_there_is_one_line(two_gpus, argv, message):
    from cnns.errors import ConfigError

    with pytest.raises(ConfigError) as error:
        resolved_training_options("train", [*IMAGENET, *argv])
    assert str(error.value) == message


def test_no_cuda_at_all_is_one_line():
    from cnns.errors import ConfigError

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError, match="^device cuda:0 requested but CUDA is not available on this machine$"):
        resolved_training_options("train", [*IMAGENET, "--select-ipus", "0"])


@pytest.mark.parametrize("local_size, device, nccl, message", [
    (3, "cuda", True, "rank 1: the launcher started 3 processes on this host, which has 2 GPUs: each process "
                      "needs a GPU of its own (launch at most 2 per host, e.g. torchrun --nproc-per-node 2)"),
    (2, "cuda:1", True, "rank 1: --device cuda:1 would put all 2 processes of this host on one GPU; give "
                        "--device cuda and each process takes its own (cuda:LOCAL_RANK)"),
    (2, "cuda", False, "rank 1: processes on GPUs talk through NCCL, which this build of torch"),
], ids=["more-processes-than-gpus", "one-gpu-for-all", "no-nccl"])
def test_workers_that_cannot_each_have_a_gpu_are_one_line_before_the_rendezvous(
        two_gpus, monkeypatch, local_size, device, nccl, message):
    """Under a launcher each process of a host takes cuda:LOCAL_RANK and NCCL; the rendezvous address is
    unreachable, so the line must come before anyone waits for the others."""
    import torch.distributed as dist

    from cnns.errors import ConfigError
    from cnns.parallel.world import init_world

    monkeypatch.setattr(dist, "is_nccl_available", lambda: nccl)
    for name, value in {"RANK": "1", "WORLD_SIZE": str(local_size), "LOCAL_RANK": "1",
                        "LOCAL_WORLD_SIZE": str(local_size), "MASTER_ADDR": "192.0.2.1", "MASTER_PORT": "9"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as error:  # without the check: a rendezvous error in 5 s
        init_world(local_size, 1, 1, torch.device(device), timeout_s=5)
    assert str(error.value).startswith(message)


def test_one_worker_per_gpu_passes_the_check(two_gpus, monkeypatch):
    import torch.distributed as dist

    from cnns.parallel.world import check_a_gpu_per_worker

    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    check_a_gpu_per_worker(torch.device("cuda"), rank=1, local_size=2)
    check_a_gpu_per_worker(torch.device("cuda:1"), rank=0, local_size=1)  # one process a host: its GPU named


@pytest.mark.parametrize("choice, replicas", [([], 2), (["--device", "cpu"], None), (["--select-ipus", "AUTO"], 2)])
def test_replicas_auto_counts_the_devices_the_run_uses(two_gpus, choice, replicas):
    from cnns.parallel.world import usable_cores
    from cnns.precision import cpu_half_is_emulated

    options, _ = resolved_training_options("train", [*IMAGENET, "--replicas", "auto", "--shards", "1", *choice])
    on_the_cpu = 1 if not cpu_half_is_emulated(torch.device("cpu"), torch.bfloat16) else usable_cores()
    assert options["replicas"] == (replicas or on_the_cpu)


@pytest.mark.parametrize("device, pinned", [("cpu", False), ("cuda", True)])
def test_the_data_loader_pins_memory_only_for_a_gpu_run(two_gpus, tmp_path, device, pinned):
    from test_imagenet_training import encoded, picture

    from cnns.config import RunConfig
    from cnns.data.sources import build_sources

    root = tmp_path / "tree"
    for split in ("train", "validation"):
        folder = root / split / "n00000000"
        folder.mkdir(parents=True)
        for i in range(4):
            (folder / f"{i}.JPEG").write_bytes(encoded(picture(i)))
    options, _ = resolved_training_options("train", ["--dataset", "imagenet", "--data-dir", str(root),
                                                     "--image-size", "64", "--micro-batch-size", "2",
                                                     "--decode-device", "cpu"])  # the worker loader, with or without DALI
    cfg = RunConfig.from_options(options)
    sources = build_sources(cfg.data, micro_batch_size=2, eval_batch_size=2, seed=0, device=torch.device(device))
    assert sources.train.loader.pin_memory is pinned and sources.eval.loader.pin_memory is pinned


def test_pipeline_stage_timing_holds_a_bounded_number_of_cuda_events(monkeypatch):
    """A long CUDA run times 2M+1 chunks per update: the events whose end completed are folded in as it
    goes (here a stand-in for torch.cuda.Event that completes after a delay of 10 events)."""
    from types import SimpleNamespace

    from cnns.parallel.pipeline_schedules import StageClock

    recorded = []

    class Event:
        def __init__(self, enable_timing: bool):
            self.index = None

        def record(self):
            self.index = len(recorded)
            recorded.append(self)

        def query(self) -> bool:
            return self.index < len(recorded) - 10

        def elapsed_time(self, end) -> float:
            return 2.0  # milliseconds

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    stage = SimpleNamespace(forward_one_chunk=lambda: None, backward_one_chunk=lambda: None)
    clock = StageClock(stage, torch.device("cuda"))
    for _ in range(10_000):
        stage.forward_one_chunk()
        stage.backward_one_chunk()
        assert all(len(pairs) <= StageClock.PENDING_EVENTS + 1 for pairs in clock._events.values())
    Event.query = lambda self: True  # the end of the run: everything has completed
    totals = clock.totals()
    assert totals["forward"] == totals["backward"] == pytest.approx(10_000 * 0.002)


@pytest.mark.parametrize("choice, compiled", [([], True), (["--device", "cuda:1"], True), (["--device", "cpu"], False),
                                              (["--no-compile"], False)],
                         ids=["gpu-default", "gpu-index", "cpu", "no-compile"])
def test_a_gpu_run_compiles_by_default_and_a_cpu_run_does_not(two_gpus, choice, compiled):
    options, _ = resolved_training_options("train", [*PLAIN, *choice])
    assert options["compile"] is compiled
    # Pipeline stages do not compile yet: a GPU default must not make a pipelined run fail.
    staged, _ = resolved_training_options("train", [*PLAIN, *choice, "--shards", "2", "--pipeline",
                                                    "--pipeline-splits", "layer2"])
    assert staged["compile"] is False


def test_validation_compiles_as_its_run_trained_or_as_the_device_decides(two_gpus, tmp_path):
    import json

    from cnns.cli.parsing import resolved_evaluation_options

    _, options, _, _ = resolved_evaluation_options("validate", PLAIN)  # no run: the device decides
    assert options["compile"] is True
    trained, _ = resolved_training_options("train", [*PLAIN, "--device", "cpu"])
    (tmp_path / "arguments.json").write_text(json.dumps(trained))
    _, options, _, _ = resolved_evaluation_options("validate", ["--restore-path", str(tmp_path)])
    assert options["compile"] is False and options["half_dtype_given"] is False  # the run's, kept
    on_the_gpu, _ = resolved_training_options("train", PLAIN)
    (tmp_path / "arguments.json").write_text(json.dumps({**on_the_gpu, "half_dtype_given": True}))
    _, options, _, _ = resolved_evaluation_options("validate", ["--restore-path", str(tmp_path)])
    assert options["compile"] is True and options["half_dtype_given"] is True
    _, options, _, _ = resolved_evaluation_options("validate", ["--restore-path", str(tmp_path), "--no-compile"])
    assert options["compile"] is False


def test_a_run_on_cuda_without_an_index_is_on_an_indexed_gpu(two_gpus, monkeypatch):
    """A tensor's device always has an index; the run's must too, or a batch decoded on the run's GPU
    (--decode-device cuda) compares unequal to "cuda" and is copied and pinned again (on an H200:
    "cannot pin 'torch.cuda.ByteTensor'")."""
    from cnns.parallel.world import init_world, process_device

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert process_device(torch.device("cuda")) == torch.device("cuda", 1)
    assert process_device(torch.device("cuda:0")) == torch.device("cuda", 0)
    assert process_device(torch.device("cpu")) == torch.device("cpu")
    assert process_device(torch.device("cuda"), local_rank=0) == torch.device("cuda", 0)  # under a launcher
    assert init_world(1, 1, 1, torch.device("cuda")).device == torch.device("cuda", 1)  # the world holds it
