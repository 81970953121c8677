"""Starting and joining a run's processes: `train.py --replicas N` without a launcher starts the N local
workers with torchrun's own agent; every process then joins the world (`join_run`).

Graphcore's single command line still works (its `TestReplicatedTraining` runs exactly that), and it
behaves as `torchrun --standalone --nproc-per-node N -m cnns train ...` would: the same agent
(torch.distributed.launcher), the same environment in the workers, SIGTERM/SIGINT forwarded to
every worker (each finishes its update, they agree to stop, one checkpoint is written), workers in
sessions of their own so a terminal's Ctrl-C reaches them once, through the agent. A worker that
fails stops the others: its own error line is the one the user sees. A launcher that ends without the agent's
shutdown (SIGKILL) takes its workers with it (`end_with_the_launcher`), as one process would end.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

from cnns.errors import ConfigError
from cnns.parallel.world import DEFAULT_TIMEOUT_S, join_world, launched, usable_cores

# Seconds the workers get to write their checkpoint after a SIGTERM before the agent kills them.
SHUTDOWN_TIMEOUT_S = 300

# The memory a worker process holds before its model (an interpreter with torch, torchvision, timm and cnns
# imported), set a little under what real workers were measured to hold (docs/performance.md, "A worker's
# memory"), so that the estimate stays a lower bound and refuses only what cannot fit.
WORKER_FIXED_BYTES = 380 << 20
# The launcher's pid, in the environment of the workers `spawn_local_workers` starts.
LAUNCHER_ENV = "CNNS_LAUNCHER_PID"
PR_SET_PDEATHSIG = 1  # prctl(2)


def spawn_local_workers(command: str, argv: list[str], processes: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> int:
    """Run `cnns <command> <argv>` in `processes` local worker processes; their exit code. The workers take their
    settings from `argv`, the launcher's own options (--threads-per-worker, --dist-timeout among them); `timeout_s`
    bounds only the agent's rendezvous with its own local workers."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # The agent logs every start and stop, and each failure again; the workers print what a user needs.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    source_root = str(Path(__file__).resolve().parents[2])  # the src/ folder: workers import this cnns
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (source_root, os.environ.get("PYTHONPATH")) if p)
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=processes, run_id=str(uuid.uuid4()),
        rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", rdzv_configs={"timeout": int(timeout_s)},
        max_restarts=0, monitor_interval=0.1, start_method="spawn", shutdown_timeout=SHUTDOWN_TIMEOUT_S,
    )
    os.environ[LAUNCHER_ENV] = str(os.getpid())  # for the workers only: taken back below
    try:
        elastic_launch(config, sys.executable)("-m", "cnns", command, *argv)
        return 0
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        if failure.exitcode < 0:  # killed by a signal: nothing was printed by the worker itself
            name = signal.Signals(-failure.exitcode).name
            print(f"error: worker rank {rank} was killed by {name}; the others were stopped", file=sys.stderr)
            return 1
        return failure.exitcode  # the worker printed its own one-line error
    except SignalException as exc:
        # The agent forwarded the signal; the workers checkpointed and said how to continue. 128 + the signal's
        # number, as one process ends (`cnns.engine.setup.interrupted_exit_code`).
        return 128 + int(exc.sigval)
    finally:
        os.environ.pop(LAUNCHER_ENV, None)


def end_with_the_launcher() -> None:
    """A worker `spawn_local_workers` started is SIGKILLed by the kernel when its launcher ends (prctl's
    PR_SET_PDEATHSIG; the agent, which starts the workers, runs in the launcher's main thread), so a launcher
    killed with SIGKILL, whose agent cannot stop them, leaves no worker behind: neither one training on, orphaned,
    nor one of restore.py or validation.py writing the run folder without the lock its launcher held
    (`cnns.runfolder.lock`). A launcher that ended before this call is noticed by the changed parent. Not on systems
    without prctl (the workers then outlive a SIGKILLed launcher, as torchrun's do)."""
    launcher = os.environ.pop(LAUNCHER_ENV, None)  # popped: the worker's own children are not its workers
    if launcher is None or int(launcher) == os.getpid() or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return  # the call failed (a sandbox without prctl): as on other systems
    if os.getppid() != int(launcher):
        os.kill(os.getpid(), signal.SIGKILL)


def checked_by_the_launcher() -> bool:
    """Whether this process is a worker `spawn_local_workers` started: its launcher ran the command's checks once
    for the whole run before starting it, so the worker does not run them again (a worker torchrun started has
    no such launcher and checks for itself). True until the worker joins the run (`join_run`)."""
    return LAUNCHER_ENV in os.environ


def needs_local_workers(replicas: int, shards: int) -> bool:
    """Several processes asked for and none started by a launcher: this process starts them."""
    return replicas * shards > 1 and not launched()


# ----------------------------------------------------------------------------------------------
# Whether the machine holds the workers this process would start


@dataclass(frozen=True)
class WorkerMemory:
    """What one worker process holds, in bytes: the interpreter, the model's weights with their gradients and
    optimiser state, and the activations a micro-batch keeps for the backward pass."""

    fixed: int
    model: int
    activations: int

    @property
    def total(self) -> int:
        return self.fixed + self.model + self.activations

    def describe(self) -> str:
        return (f"interpreter {_gib(self.fixed)}, weights, gradients and optimiser state {_gib(self.model)}, "
                f"activations {_gib(self.activations)}")


def _gib(size: float) -> str:
    return f"{size / (1 << 30):.2f} GiB"


def check_machine_holds_workers(cfg, trains: bool = True) -> None:
    """The worker processes this process would start itself (`needs_local_workers`), checked before any starts:
    ConfigError in one line when the machine's available memory cannot hold them (`worker_memory`, a lower
    bound), a one-line notice on stderr when they outnumber the usable cores; a run of one process, that it fits
    (`check_machine_holds_the_run`). Under a launcher (torchrun) the launcher decided how many processes a machine
    runs: nothing is checked."""
    p = cfg.parallel
    if launched():
        return
    if not needs_local_workers(p.replicas, p.shards):
        check_machine_holds_the_run(cfg, trains)
        return
    processes = p.replicas * p.shards
    asked = f"--replicas {p.replicas}" + (f" x --shards {p.shards}" if p.shards > 1 else "")
    available = available_memory_bytes()
    if available is not None:
        each = worker_memory(cfg, trains)
        if processes * each.total > available:
            fitting = max(1, available // each.total)
            raise ConfigError(
                f"{asked}: {processes} worker processes need at least {_gib(processes * each.total)} of memory "
                f"({_gib(each.total)} each: {each.describe()}), more than the {_gib(available)} available on this "
                f"machine; start at most {fitting}, or launch them with torchrun where the memory is")
    cores = usable_cores()
    if processes > cores:
        print(f"notice: {asked} starts {processes} worker processes on {cores} usable CPU cores: they take turns on "
              "the cores, one thread each", file=sys.stderr, flush=True)


def check_machine_holds_the_run(cfg, trains: bool = True) -> None:
    """One process's model, checked against the memory it will live in (the GPU's free memory, or the machine's
    available memory) with the estimate the workers are checked with: ConfigError before the run folder when its
    weights, gradients and optimiser state alone cannot fit, so that `--num-classes 2000000000` (a 512 GB
    classifier) is not found by the allocator once the run has started. Only that share: this process's
    interpreter is already in the memory in use, and the activations, which the allocator may find room for in what
    the kernel would reclaim, are left to the out-of-memory line (`cnns.cli.endings`), which names
    --micro-batch-size."""
    import torch

    from cnns.devices import default_device_name

    name = cfg.device or default_device_name()
    device = torch.device(name if name.startswith("cuda") else "cpu")
    if device.type == "cuda":
        try:
            available, where = torch.cuda.mem_get_info(device)[0], f"free on {name}"
        except (RuntimeError, AssertionError, ValueError):  # no such GPU: the device's own check says so
            return
    else:
        available, where = available_memory_bytes(), "available on this machine"
    if available is None:
        return
    need = model_memory(cfg, trains, device)
    if need > available:
        raise ConfigError(f"this run's model needs at least {_gib(need)} of memory for its weights, gradients "
                          f"and optimiser state, more than the {_gib(available)} {where}: lower "
                          "--num-classes or --model-size")


def model_memory(cfg, trains: bool, device) -> int:
    """Bytes of one process's share of the model on `device` (its precision there): its weights, and when it
    `trains` their gradients, the optimiser's state and the moving average. Built on the meta device: no memory."""
    parameters, _ = _meta_training_pass(cfg.model, cfg.train.micro_batch_size, trains=False)
    return _model_share(cfg, trains, cfg.precision.policy(device), parameters)


def worker_memory(cfg, trains: bool = True) -> WorkerMemory:
    """A lower bound of one worker's memory on this machine (WorkerMemory). The model is built on torch's meta
    device (no memory, no arithmetic) and run forward on a meta micro-batch, counting the tensors autograd keeps
    for the backward pass. On a GPU the model lives in the GPU's memory: only the interpreter counts here.
    Not counted (the bound stays a bound): data held in memory, loader workers, the allocator's slack.
    Sizes are those of the precision policy the workers will run on this CPU (float32 where it would only
    emulate the half type and none was insisted on)."""
    import torch

    from cnns.devices import default_device_name

    if (cfg.device or default_device_name()).startswith("cuda"):
        return WorkerMemory(WORKER_FIXED_BYTES, 0, 0)
    policy = cfg.precision.policy(torch.device("cpu"))
    parameters, activation_bytes = _meta_training_pass(cfg.model, cfg.train.micro_batch_size, trains)
    if policy.half_compute:
        activation_bytes //= 2  # computed in the half type
    if cfg.parallel.enable_recomputation:
        activation_bytes = 0  # only block inputs are kept: not estimated, so not counted
    shards = cfg.parallel.shards  # a stage holds about its share of the model
    return WorkerMemory(WORKER_FIXED_BYTES, _model_share(cfg, trains, policy, parameters), activation_bytes // shards)


def _model_share(cfg, trains: bool, policy, parameters: int) -> int:
    """Bytes of one process's share of a model of `parameters` under the precision `policy`: its weights, and when
    it `trains` their gradients, the optimiser's state and the moving average."""
    weight_bytes = parameters * policy.weight_dtype.itemsize  # 16.32 keeps float32 (master) weights
    copies = 1  # the weights
    if trains:
        state = cfg.optim.info.state_per_parameter  # its entry in the optimisers' registry (cnns.optim)
        copies += 1 + (state / cfg.parallel.replicas if cfg.parallel.rts else state)  # gradients, the state
    if trains and cfg.train.ema_decay:
        copies += 1
    return int(weight_bytes * copies / cfg.parallel.shards)  # a stage holds about its share of the model


def _meta_training_pass(spec, micro_batch_size: int, trains: bool) -> tuple[int, int]:
    """(parameters, bytes of the distinct tensors a float32 forward pass of `micro_batch_size` images keeps for
    the backward pass; 0 when it does not train) of the model `spec` describes, on the meta device."""
    import torch

    from cnns.models import build_model

    with torch.device("meta"):
        model = build_model(spec)
    parameters = {id(parameter) for parameter in model.parameters()}
    count = sum(parameter.numel() for parameter in model.parameters())
    if not trains:
        return count, 0
    kept: dict[int, torch.Tensor] = {}  # by identity: a tensor saved by two operations is held once

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in parameters:
            kept[id(tensor)] = tensor
        return tensor

    images = torch.empty(micro_batch_size, 3, spec.image_size, spec.image_size, device="meta")
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        model.train()(images)
    return count, sum(tensor.numel() * tensor.element_size() for tensor in kept.values())


def available_memory_bytes() -> int | None:
    """The memory new processes can take without swapping: the kernel's MemAvailable, or less where this
    process's cgroup (a container's limit) leaves less; None where neither can be read (not Linux)."""
    available = _meminfo_available()
    limit = _cgroup_room()
    if available is None or limit is None:
        return available if limit is None else limit
    return min(available, limit)


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_room() -> int | None:
    """cgroup v2: memory.max - memory.current of this process's cgroup; None without a limit."""
    try:
        with open("/proc/self/cgroup") as cgroup:
            path = next(line.split(":", 2)[2].strip() for line in cgroup if line.startswith("0::"))
        folder = Path("/sys/fs/cgroup") / path.lstrip("/")
        limit = (folder / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int((folder / "memory.current").read_text()))
    except (OSError, ValueError, StopIteration):
        return None


def join_run(cfg, model_to_plan) -> tuple:
    """(this process's World, the RunConfig every process agreed on, the notices rank 0 prints): the world on
    the run's device, rank 0's random seed, and rank 0's cuts for --pipeline-splits auto, timed on the model
    `model_to_plan` assembles (`cnns.parallel.planning.ModelToPlan`; the command's, as this floor cannot assemble)."""
    from cnns.devices import resolve_device
    from cnns.parallel.planning import settle_auto_splits

    end_with_the_launcher()
    device = resolve_device(cfg.device)
    notices: list[str] = []

    def agree(world, cfg):
        cfg, notice = settle_auto_splits(cfg, world, device, model_to_plan)
        notices.extend([notice] if notice else [])
        return cfg

    world, cfg = join_world(cfg, device, agree)
    return world, cfg, notices
