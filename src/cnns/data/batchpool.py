"""Shared-memory batches that DataLoader workers write again once the main process has let go of them.

A batch made in fresh shared memory costs far more to hand over than its pixels cost to write: every batch
is a new shared-memory file whose pages the kernel zeroes and maps on first touch, in the worker and again
in the main process (`cnns bench-data`'s "across to the main process" row). Workers that write into a few
batches, over and over, pay that once.

The buffers are made by the main process, before the workers start, so both sides have them mapped from the
start and a batch crosses as its buffer's number. Sending the tensor itself would pass its file descriptor
each time (multiprocessing's resource sharer: a socket connection with an authentication handshake per
storage), and the main process would map it again; labels cross as a list for the same reason (a tensor is
another storage to share). docs/performance.md has the hand-off measured each way.

The hazard is writing a batch the main process still uses. So each buffer has a flag in memory shared by
the main process and the workers: a worker writes only a buffer whose flag is clear and sets it; the main
process clears it only when nothing but the pool holds the batch's memory (torch counts every tensor and
view of a storage). A consumer that keeps batches (a list of a whole epoch, a cache) keeps their buffers
flagged, and the workers make fresh shared memory instead: never slower than without the pool, never wrong.
"""

from __future__ import annotations

import math
from collections import deque

import torch
from torch.utils.data import get_worker_info


def storage_users(tensor: torch.Tensor) -> int:
    """How many tensors (views included) hold `tensor`'s memory, plus one for the storage object asked."""
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


def new_shared_tensor(shape: tuple[int, ...], dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """An uninitialised tensor in shared memory from the start, as torch's own collate makes its batches in
    workers: sending it to the main process then passes a handle, not the data (``share_memory_()`` on an
    ordinary tensor would copy it). The tensor is the storage's only holder (no base tensor), so that
    `storage_users` counts the views of it alone."""
    storage = torch.UntypedStorage._new_shared(math.prod(shape) * dtype.itemsize)
    return torch.empty(0, dtype=dtype).set_(storage, 0, shape)


# A storage held by exactly one tensor: what storage_users says once the consumers have let go of a batch.
_HELD_BY_ONE = storage_users(torch.empty(1))


class BatchPool:
    """`buffers_per_worker` reusable uint8 batches of `shape` for each of `workers` DataLoader workers, made in
    shared memory by the process that makes the pool (the main process), which the workers inherit.

    In a worker, `batch(rows)` gives (the first `rows` of a free buffer, its number), or (fresh shared memory,
    -1) when every buffer of the worker is still in use or the rows do not fit; in the main process (no
    workers), (ordinary memory, -1). The worker then sends the number, not the tensor. In the main process,
    `receive(images, rows, number)` gives the batch (its own view of the buffer, or `images` for -1) and
    records it as lent out until nothing holds it."""

    def __init__(self, workers: int, buffers_per_worker: int, shape: tuple[int, ...]) -> None:
        self.shape = tuple(shape)
        self.buffers_per_worker = buffers_per_worker
        self.in_use = torch.zeros(workers * buffers_per_worker, dtype=torch.uint8).share_memory_()
        # Address space only: the pages are the kernel's to find when a worker first writes them.
        self.buffers = [new_shared_tensor(self.shape) for _ in range(workers * buffers_per_worker)]
        self._lent: deque[int] = deque()  # the main process's: the numbers of the batches lent out
        self.batches_from_buffers = 0  # in the main process: batches received in a reusable buffer

    def __getstate__(self) -> dict:
        # A worker started by spawning receives the buffers' handles once, with the dataset; it lends nothing.
        return {"shape": self.shape, "buffers_per_worker": self.buffers_per_worker, "in_use": self.in_use,
                "buffers": self.buffers}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lent, self.batches_from_buffers = deque(), 0

    def batch(self, rows: int) -> tuple[torch.Tensor, int]:
        shape = (rows, *self.shape[1:])
        worker = get_worker_info()
        if worker is None:
            return torch.empty(shape, dtype=torch.uint8), -1
        if rows <= self.shape[0]:
            first = worker.id * self.buffers_per_worker
            for number in range(first, first + self.buffers_per_worker):
                if not self.in_use[number]:
                    self.in_use[number] = 1
                    return self.buffers[number][:rows], number
        return new_shared_tensor(shape), -1

    def receive(self, images: torch.Tensor | None, rows: int, number: int) -> torch.Tensor:
        """The batch a worker made: buffer `number`'s first `rows` (lent to the consumer until nothing holds
        them), or `images` when it came in memory of its own (number -1)."""
        self.take_back()
        if number < 0:
            return images
        self._lent.append(number)
        self.batches_from_buffers += 1
        return self.buffers[number][:rows]

    def take_back(self) -> None:
        still_used = deque()
        for number in self._lent:
            if storage_users(self.buffers[number]) <= _HELD_BY_ONE:
                self.in_use[number] = 0
            else:
                still_used.append(number)
        self._lent = still_used
