"""The process world: who this process is among the replicas, and the few collectives the engine needs.

The world is a grid: `replicas` copies of a pipeline of `shards` stages. Rank r is stage r % shards of
replica r // shards; the stages of one replica form its pipeline group (activations and gradients
pass between them), the processes running the same stage form that stage's replica group (its
gradients are averaged there). It is built once, from the launcher's environment: torchrun's, or the
one cnns's own spawn of `--replicas N` sets up (`cnns.parallel.launch`), which is torchrun's agent
too. The engine gets a `World` and asks it; the only other reader of RANK and WORLD_SIZE is the run lock
(`cnns.runfolder.lock`), which runs before the world is built and asks only whether this is rank 0.

Every collective here and in the process groups has a bounded timeout (--dist-timeout seconds,
`cnns.config.defaults`): a peer that died or never came ends the run with one line naming the
rank, never a hang.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch
import torch.distributed as dist

from cnns.config.defaults import GENERIC_DEFAULTS
from cnns.devices import usable_cores
from cnns.errors import CnnsError, ConfigError, first_line

TIMEOUT_OPTION = "--dist-timeout"  # named in a timeout's error line: the option to raise
# Options computed from others (cnns.config): a difference in them is reported through its cause.
DERIVED_OPTIONS = frozenset({"global_batch_size", "learning_rate", "name", "base_learning_rate_exponent",
                             "rmsprop_decay", "poly_lr_end_ratio", "lars_weight_decay"})
DEFAULT_TIMEOUT_S = float(GENERIC_DEFAULTS["dist_timeout"])


class DistributedError(CnnsError):
    """A peer that died, never joined or disagrees: named with its rank."""


def launched() -> bool:
    """Whether a launcher (torchrun, or cnns's own spawn) started this process as one of several."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def restart_attempt() -> int:
    """torchrun's count of this process's restarts (0 on the first attempt): the one reader of
    TORCHELASTIC_RESTART_COUNT."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def threads_per_worker(local_workers: int, asked: int | None) -> int:
    """CPU threads of each local worker: --threads-per-worker (`asked`), or with auto (None) the cores shared out
    evenly."""
    return asked if asked is not None else max(1, usable_cores() // local_workers)


@dataclass
class World:
    """This process's place among all of them. A single process is `World()`."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    replicas: int = 1
    shards: int = 1
    restart: int = 0  # torchrun's restart count: > 0 when workers were restarted after a failure
    # This process's device, resolved once as it joined (`process_device`); a bare World() is a CPU process's.
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    timeout_s: float = DEFAULT_TIMEOUT_S
    control: Any = None  # a gloo group for host-side agreement (stop flags, objects), whatever the device
    store: Any = None  # the launcher's store: it outlives worker restarts
    bn_group: Any = None  # this replica's --BN-span group (None: statistics stay local)
    pipeline_group: Any = None  # this replica's stages (with shards > 1)
    replica_group: Any = None  # the processes running this process's stage (None: every process)
    _groups: list = field(default_factory=list, repr=False)  # every subgroup made, kept alive

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @property
    def is_writer(self) -> bool:
        """The process that prints, writes the run folder's files and saves checkpoints."""
        return self.rank == 0

    @property
    def replica_rank(self) -> int:
        return self.rank // self.shards

    @property
    def stage(self) -> int:
        """This process's pipeline stage (0 without pipelining)."""
        return self.rank % self.shards

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        """The stage that computes the loss and the metrics."""
        return self.stage == self.shards - 1

    def without_stages(self) -> "World":
        """The same processes as data-parallel replicas of a whole model each: validation after a
        pipelined run, where every process checks its share of the images with the whole model."""
        if self.shards == 1:
            return self
        return replace(self, replicas=self.size, shards=1, bn_group=None, pipeline_group=None, replica_group=None)

    @property
    def shard(self) -> tuple[int, int]:
        """(replica rank, replicas): how data sources deal out samples."""
        return self.replica_rank, self.replicas

    # -- host-side agreement (the control group) ---------------------------------------------

    def any(self, flag: bool) -> bool:
        """True on every process when it is true on any (e.g. a stop signal seen by one of them)."""
        if not self.distributed:
            return flag
        value = torch.tensor([int(flag)])
        self._collective("agree on stopping", dist.all_reduce, value, op=dist.ReduceOp.MAX, group=self.control)
        return bool(value.item())

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every process (pickled: only for small objects and trusted peers)."""
        if not self.distributed:
            return obj
        holder = [obj if self.rank == 0 else None]
        self._collective("receive rank 0's state", dist.broadcast_object_list, holder, src=0, group=self.control)
        return holder[0]

    def gather(self, obj: Any) -> list[Any]:
        """Every process's `obj`, in rank order, on every process."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.size
        self._collective("exchange state", dist.all_gather_object, out, obj, group=self.control)
        return out

    def gather_to_writer(self, obj: Any) -> list[Any] | None:
        """Every process's `obj`, in rank order, on the writer (None elsewhere)."""
        if not self.distributed:
            return [obj]
        out: list[Any] | None = [None] * self.size if self.is_writer else None
        self._collective("send state to rank 0", dist.gather_object, obj, out, dst=0, group=self.control)
        return out

    def sum(self, values: list[float]) -> list[float]:
        """Host numbers summed over every process (float64: exact for counts)."""
        if not self.distributed:
            return list(values)
        total = torch.tensor(values, dtype=torch.float64)
        self._collective("sum results", dist.all_reduce, total, group=self.control)
        return total.tolist()

    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """A device tensor summed in place over every process: the default group on a GPU (NCCL), the
        control group on the CPU (both gloo there), so that on the CPU the default group, which torch may
        keep alive past `close` (see there), never holds a tensor of ours."""
        if self.distributed:
            group = self.control if tensor.device.type == "cpu" else None
            self._collective("sum metrics", dist.all_reduce, tensor, group=group)
        return tensor

    def average_among_replicas_(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` averaged in place over the replicas of this process's stage (every process without
        pipeline stages), on the run's device (NCCL on CUDA)."""
        if self.replicas > 1:
            self._collective("average norm statistics", dist.all_reduce, tensor, group=self.replica_group)
            tensor.div_(self.replicas)
        return tensor

    def broadcast_state(self, module: torch.nn.Module, among_replicas: bool = False) -> None:
        """Rank 0's parameters and buffers into every process's copy of `module` (same architecture);
        `among_replicas`: replica 0's into the other replicas' copies of this process's stage."""
        if not self.distributed or (among_replicas and self.replicas == 1):
            return
        group, source = (self.replica_group, self.stage) if among_replicas else (None, 0)
        for tensor in module.state_dict().values():
            # channels_last weights are not contiguous in torch's sense: send a contiguous copy.
            buffer = tensor if tensor.is_contiguous() else tensor.contiguous()
            self._collective(f"receive rank {source}'s weights", dist.broadcast, buffer, src=source, group=group)
            if buffer is not tensor:
                tensor.copy_(buffer)

    def agree_on(self, key: str, make: Callable[[], str]) -> str:
        """A string every process agrees on, made once by rank 0 (e.g. the run folder's name).

        Kept in the launcher's store, which survives worker restarts: restarted workers get the
        value the first attempt made (so they continue the same run folder).
        """
        if not self.distributed:
            return make()
        full_key = f"cnns/{key}"
        if self.rank == 0:
            if self.restart > 0 and self.store.check([full_key]):
                return self.store.get(full_key).decode()
            value = make()
            self.store.set(full_key, value)
            return value
        try:
            return self.store.get(full_key).decode()
        except RuntimeError as exc:  # the store's own timeout
            raise DistributedError(f"rank {self.rank}: rank 0 did not publish {key} within {self.timeout_s:.0f} s "
                                   f"({TIMEOUT_OPTION}): {first_line(exc)}") from None

    def check_same_options(self, options: dict[str, Any], ignore: tuple[str, ...] = ("command",)) -> None:
        """Every process must run the same configuration: the first difference is named with its rank."""
        if not self.distributed:
            return
        mine = json.loads(json.dumps({k: v for k, v in options.items() if k not in ignore}, default=str))
        everyone = self.gather(mine)
        for rank, theirs in enumerate(everyone):
            differ = [key for key in set(everyone[0]) | set(theirs) if everyone[0].get(key) != theirs.get(key)]
            if differ:
                # Name an option the user gave before the values derived from it.
                key = min(differ, key=lambda k: (k in DERIVED_OPTIONS, k))
                raise ConfigError(f"rank {rank} was started with different options than rank 0: "
                                  f"{key} = {theirs.get(key)!r} there, {everyone[0].get(key)!r} on rank 0")

    def _collective(self, what: str, function: Callable, *args, **kwargs) -> None:
        try:
            function(*args, **kwargs)
        except (RuntimeError, dist.DistBackendError) as exc:
            raise DistributedError(f"rank {self.rank}: a peer failed or did not answer within {self.timeout_s:.0f} s "
                                   f"({TIMEOUT_OPTION}) while trying to {what}: {first_line(exc)}") from None

    def settle(self) -> None:
        """Wait until every process is done before tearing the groups down, so that none closes its
        connections while a peer is still in a collective with it. Only on success: on a failure path a
        peer may be gone."""
        if self.distributed:
            self._collective("finish together", dist.barrier, group=self.control)

    def close(self) -> None:
        """Destroy the process groups, and their threads with them, while the interpreter is still whole.

        `destroy_process_group` only unregisters the groups: each group's worker and transport threads
        live until the last Python reference to it goes (this world's fields, the modules and the
        optimiser that hold a group, often in reference cycles). Left to the interpreter's shutdown, a
        gloo worker thread still releasing a tensor of its last collective takes the GIL of a finalising
        interpreter and the process aborts ("terminate called without an active exception": a stage
        process of a pipelined run with replicas, now and then under load). So the references go here,
        and the cycles are collected now. (The default group is the exception: once torch's functional
        collectives (--BN-span's) or its ZeroRedundancyOptimizer (--rts) have used it, torch itself holds
        it; on the CPU it runs no collective of ours, see `sum_`.)
        """
        if self.control is None:  # this process joined no process group (a single process)
            return
        if dist.is_initialized():
            dist.destroy_process_group()
        self.control = self.bn_group = self.pipeline_group = self.replica_group = None
        self._groups.clear()
        gc.collect()


# Where torch's transports name themselves in the errors they raise deep in a collective (DDP's
# gradient all-reduce inside the backward raises a plain RuntimeError from gloo).
_TRANSPORT_MARKERS = ("gloo", "nccl", "c10d", "connection reset", "connection closed", "broken pipe")


def peer_failure(exc: BaseException, rank: int | None = None) -> str | None:
    """One line for an error that a dead or unreachable peer caused inside a collective, else None."""
    text = str(exc).lower()
    if not (isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError)
                                                and any(marker in text for marker in _TRANSPORT_MARKERS))):
        return None
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    return f"rank {rank}: a peer process failed or became unreachable during a collective: {first_line(exc)}"


def process_device(requested: torch.device, local_rank: int | None = None) -> torch.device:
    """A CUDA device without an index means this process's own GPU: cuda:LOCAL_RANK under a launcher (`local_rank`),
    the current one otherwise. Always indexed, because a tensor's device is: a batch already on the run's GPU
    (decoded there) must compare equal to the run's device, or it would be copied and pinned again."""
    if requested.type == "cuda" and requested.index is None:
        return torch.device("cuda", local_rank if local_rank is not None else torch.cuda.current_device())
    return requested


def init_world(replicas: int, shards: int, bn_span: int, device: torch.device, threads: int | None = None,
               timeout_s: float = DEFAULT_TIMEOUT_S) -> World:
    """Join the launcher's process group, or return the single-process world. `threads`: --threads-per-worker
    (None: auto); `timeout_s`: --dist-timeout, the bound on every rendezvous and collective.

    Under a launcher the process count must be replicas x shards. The process group's store is
    prefixed per restart attempt: torchrun's agent keeps one store across restarts, and without
    the prefix restarted gloo workers read the dead attempt's addresses and fail to connect
    (seen with torch 2.14.1 under `torchrun --max-restarts 1`).
    """
    if not launched():
        if replicas * shards > 1:
            raise ConfigError(f"--replicas {replicas} x --shards {shards} needs {replicas * shards} processes, "
                              "but this process was not started by a launcher")
        return World(device=process_device(device))
    env = os.environ
    rank, size = int(env["RANK"]), int(env["WORLD_SIZE"])
    if size != replicas * shards:
        raise ConfigError(f"rank {rank}: the launcher started {size} processes, but --replicas {replicas} x --shards "
                          f"{shards} = {replicas * shards}; give --replicas {max(1, size // shards)} "
                          "(or launch replicas x shards processes)")
    local_size = int(env.get("LOCAL_WORLD_SIZE", size))
    if device.type == "cuda":
        check_a_gpu_per_worker(device, rank, local_size)
    if device.type == "cpu":
        # The cores are shared by the local workers: one pool each would oversubscribe them.
        torch.set_num_threads(threads_per_worker(local_size, threads))
    seconds = timeout_s  # --dist-timeout, named in every line a timeout ends with
    timeout = datetime.timedelta(seconds=seconds)
    endpoint = f"{env.get('MASTER_ADDR')}:{env.get('MASTER_PORT')}"
    try:
        store, rank, size = next(dist.rendezvous("env://", timeout=timeout))
    except (RuntimeError, ValueError, dist.DistStoreError) as exc:
        raise DistributedError(f"rank {rank}: could not reach the rendezvous at {endpoint} within {seconds:.0f} s "
                               f"({TIMEOUT_OPTION}): {first_line(exc)}") from None
    restart = restart_attempt()
    backend = "nccl" if device.type == "cuda" else "gloo"
    local_rank = int(env.get("LOCAL_RANK", "0"))
    if device.type == "cuda":  # the GPU `World.device` gives this process
        torch.cuda.set_device(device.index if device.index is not None else local_rank)
    try:
        dist.init_process_group(backend, store=dist.PrefixStore(f"cnns/attempt{restart}", store), rank=rank,
                                world_size=size, timeout=timeout)
        control = dist.new_group(backend="gloo", timeout=timeout)
    except (RuntimeError, dist.DistBackendError) as exc:
        raise DistributedError(f"rank {rank}: the {size} processes did not all join at {endpoint} within "
                               f"{seconds:.0f} s ({TIMEOUT_OPTION}): {first_line(exc)}") from None
    world = World(rank=rank, size=size, local_rank=local_rank, local_size=local_size, replicas=replicas,
                  shards=shards, restart=restart, device=process_device(device, local_rank), timeout_s=seconds,
                  control=control, store=store)
    # Every process creates every group (torch's rule); each keeps its own.
    def subgroups(rank_lists: list[list[int]]):
        mine, every = dist.new_subgroups_by_enumeration(rank_lists, timeout=timeout)
        world._groups.extend(every)
        return mine

    if shards > 1:
        world.pipeline_group = subgroups([[r * shards + s for s in range(shards)] for r in range(replicas)])
        if replicas > 1:
            world.replica_group = subgroups([[r * shards + s for r in range(replicas)] for s in range(shards)])
    if bn_span > 1:
        # A span is bn_span replicas of the same stage; it divides the replicas (the option's rule, checked as
        # the options are resolved: cnns.config.defaults.check_bn_span).
        world.bn_group = subgroups([[r * shards + s for r in range(start, start + bn_span)]
                                    for s in range(shards) for start in range(0, replicas, bn_span)])
    return world


def check_a_gpu_per_worker(device: torch.device, rank: int, local_size: int) -> None:
    """On CUDA every process of a host takes a GPU of its own, cuda:LOCAL_RANK, and they talk through NCCL,
    which refuses two processes on one GPU: what stops that is said in one line before anyone waits."""
    if not dist.is_nccl_available():
        raise ConfigError(f"rank {rank}: processes on GPUs talk through NCCL, which this build of torch "
                          f"({torch.__version__}) does not have; install a CUDA build of torch or give --device cpu")
    count = torch.cuda.device_count()
    if local_size > count:
        raise ConfigError(f"rank {rank}: the launcher started {local_size} processes on this host, which has "
                          f"{count} GPU{'s' if count != 1 else ''}: each process needs a GPU of its own "
                          f"(launch at most {count} per host, e.g. torchrun --nproc-per-node {count})")
    if device.index is not None and local_size > 1:
        raise ConfigError(f"rank {rank}: --device {device} would put all {local_size} processes of this host on "
                          "one GPU; give --device cuda and each process takes its own (cuda:LOCAL_RANK)")


def join_world(cfg, device: torch.device, agree: Callable[[World, Any], Any] | None = None) -> tuple[World, Any]:
    """This process's place among the replicas and stages, and the run's configuration (`cnns.config.RunConfig`)
    as every process agrees on it: rank 0's random seed, then whatever `agree(world, cfg)` returns (rank 0's choice
    of --pipeline-splits auto). Every process must have been given the same options as rank 0."""
    p = cfg.parallel
    world = init_world(p.replicas, p.shards, p.BN_span, device, p.threads_per_worker, p.dist_timeout)
    try:
        # What each launcher was given must agree before anything is taken from rank 0: a seed given on every
        # command line is compared like every option; only a seed each process drew itself is rank 0's.
        drawn = () if cfg.arguments.get("seed_specified") else ("seed",)
        world.check_same_options(dict(cfg.arguments), ignore=("command", *drawn))
        cfg = cfg.with_seed(world.broadcast(cfg.train.seed))
        if agree is not None:
            cfg = agree(world, cfg)
        world.check_same_options(dict(cfg.arguments))
    except BaseException:
        world.close()
        raise
    return world, cfg


def auto_replicas(shards: int, device: torch.device, cpu_has_matrix_units: bool = False) -> int:
    """--replicas auto: under a launcher, its process count over the shards; otherwise one replica
    per GPU on CUDA. On a CPU with bfloat16 matrix units (AVX512-BF16, AMX) one process on all cores: its
    convolutions use the cores as well at the full batch as one-thread replicas do at a fraction of it, so
    replicas only add the all-reduce (docs/performance.md's replicas section: two one-thread replicas against one
    two-thread process, measured on 2 cores of an AMD EPYC with AVX512-BF16); on other CPUs one replica per
    usable core."""
    if launched():
        return max(1, int(os.environ["WORLD_SIZE"]) // shards)
    if device.type == "cuda":
        return max(1, torch.cuda.device_count() // shards)
    if cpu_has_matrix_units:
        return 1
    return max(1, usable_cores() // shards)
