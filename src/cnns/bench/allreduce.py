"""`python -m cnns.bench.allreduce [--processes 2] [--model resnet-50 ...]`: the all-reduce cost of one update.

Replicas all-reduce every gradient once per weight update (float32, DDP buckets). This measures that
one collective on this machine's processes and backend (gloo on 127.0.0.1 on a CPU, NCCL on CUDA)
for the float32 gradients of the named models, with one thread per process, so a replica run's
time per update can be split into compute and communication (docs/performance.md, "Replicas on this 2-core CPU").
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MODELS = {"resnet-20": ("resnet", "20", 10, 32), "resnet-50": ("resnet", "50", 1000, 224)}


def _gradient_elements(name: str) -> int:
    from cnns.models import ModelSpec, build_model

    arch, size, classes, image = MODELS[name]
    model = build_model(ModelSpec(arch=arch, size=size, num_classes=classes, image_size=image))
    return sum(p.numel() for p in model.parameters())


def _worker(rank: int, world: int, port: int, sizes: dict[str, int], repeats: int, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    for name, elements in sizes.items():
        tensor = torch.ones(elements)
        dist.all_reduce(tensor)  # warm-up: connections and buffers
        times = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(tensor)
            times.append(time.perf_counter() - start)
        if rank == 0:
            results[name] = statistics.median(times)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cnns.bench.allreduce", description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--model", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    sizes = {name: _gradient_elements(name) for name in args.model}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        results = manager.dict()
        mp.start_processes(_worker, args=(args.processes, port, sizes, args.repeats, results), nprocs=args.processes,
                           start_method="spawn", join=True)
        for name, elements in sizes.items():
            megabytes = elements * 4 / 1e6
            seconds = results[name]
            print(f"{name}: {elements} float32 gradients ({megabytes:.1f} MB), all-reduce over {args.processes} "
                  f"processes (gloo, 127.0.0.1): {1000 * seconds:.2f} ms median of {args.repeats}, "
                  f"{megabytes / 1000 / seconds:.2f} GB/s algorithm bandwidth")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
