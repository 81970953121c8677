"""The CPU decoder's rate, measured on this machine, for --decode-device auto to weigh against the step's
(`cnns.data.decoding.choose_from_rates`): a measurement, not a core count, since a core's rate differs
several-fold between machines (docs/performance.md has the rates measured on each)."""

from __future__ import annotations

import time
from typing import Callable

import torch

from cnns.data.decoding import DecodeRates, ImageDecoder, local_gpu_processes
from cnns.data.image_loader import ImageNetTransform
from cnns.data.photos import photo_like_jpeg
from cnns.devices import usable_cores

# Long enough for a few hundred crops of one core, short enough for a run's start-up.
PROBE_SECONDS = 0.3
# Photo-like JPEGs in ImageNet's usual shapes (`cnns.data.photos`), decoded in turn.
PROBE_IMAGES = 4


def cpu_decoder_rate(image_size: int, seconds: float = PROBE_SECONDS, decoder: ImageDecoder | None = None) -> float:
    """Training crops a second that one core decodes with the CPU decoder the workers run (one thread, as in
    a worker), on photo-like JPEGs."""
    transform = ImageNetTransform(True, image_size, 0, decoder or ImageDecoder())
    images = [photo_like_jpeg(0, index) for index in range(PROBE_IMAGES)]
    out = torch.empty((image_size, image_size, 3), dtype=torch.uint8).numpy()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        transform.into(images[0], "probe", (0, 0), out)  # first-call costs, not timed
        done, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < seconds:
            transform.into(images[done % len(images)], "probe", (done, 0), out)
            done += 1
    finally:
        torch.set_num_threads(threads)
    return done / elapsed


def worker_cores(workers: int) -> int:
    """The cores the run's decoding workers have: its --pipeline-num-parallel, at most this process's share
    of the node's cores (torchrun's processes share them)."""
    return max(1, min(workers, usable_cores() // local_gpu_processes()))


def measured_rates(workers: int, image_size: int,
                   step_rate: Callable[[], float] | None) -> Callable[[], DecodeRates]:
    """What `choose_decode_device` calls, only where auto has to weigh rates: the CPU decoder's rate on the run's
    worker cores, and the step's (None where no step runs, as in `cnns bench-data`)."""
    def rates() -> DecodeRates:
        cores = worker_cores(workers)
        return DecodeRates(cpu_decoder_rate(image_size) * cores, cores, step_rate() if step_rate else None)

    return rates
