"""Shared-memory batches that DataLoader workers write again once the main process has let go of them.

A batch made in fresh shared memory costs far more to hand over than its pixels cost to write: every batch
is a new shared-memory file whose pages the kernel zeroes and maps on first touch, in the worker and again
in the main process (`cnns bench-data`'s "across to the main process" row). Workers that write into a few
batches of their own, over and over, pay that once.

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
    ordinary tensor would copy it)."""
    storage = torch.UntypedStorage._new_shared(math.prod(shape) * dtype.itemsize)
    return torch.empty(0, dtype=dtype).set_(storage).view(shape)


# A storage held by exactly one tensor: what storage_users says once the consumers have let go of a batch.
_HELD_BY_ONE = storage_users(torch.empty(1))


class BatchPool:
    """`buffers_per_worker` reusable uint8 batches for each of `workers` DataLoader workers.

    In a worker, `batch(shape)` gives (tensor, buffer number), the number -1 for fresh shared memory when
    every buffer is still in use (or in the main process, where the tensor is ordinary memory). In the main
    process, `lend(images, number)` records a received batch and `take_back()` frees the buffers of the
    batches nothing holds any more."""

    def __init__(self, workers: int, buffers_per_worker: int) -> None:
        self.buffers_per_worker = buffers_per_worker
        self.in_use = torch.zeros(workers * buffers_per_worker, dtype=torch.uint8).share_memory_()
        self._buffers: dict[int, torch.Tensor] = {}  # a worker's own buffers, made on first use
        self._lent: deque[tuple[torch.Tensor, int]] = deque()  # the main process's: (its own alias, number)
        self.batches_from_buffers = 0  # in the main process: batches received in a reusable buffer

    def __getstate__(self) -> dict:
        # A worker starts with no buffers and lends nothing; only the flags are shared.
        return {"buffers_per_worker": self.buffers_per_worker, "in_use": self.in_use}

    def __setstate__(self, state: dict) -> None:
        self.buffers_per_worker, self.in_use = state["buffers_per_worker"], state["in_use"]
        self._buffers, self._lent, self.batches_from_buffers = {}, deque(), 0

    def batch(self, shape: tuple[int, ...]) -> tuple[torch.Tensor, int]:
        worker = get_worker_info()
        if worker is None:
            return torch.empty(shape, dtype=torch.uint8), -1
        size = math.prod(shape)
        first = worker.id * self.buffers_per_worker
        for number in range(first, first + self.buffers_per_worker):
            if self.in_use[number]:
                continue
            buffer = self._buffers.get(number)
            if buffer is None or buffer.numel() < size:
                buffer = self._buffers[number] = new_shared_tensor((size,))
            self.in_use[number] = 1
            return buffer[:size].view(shape), number
        return new_shared_tensor(shape), -1

    def lend(self, images: torch.Tensor, number: int) -> None:
        """A batch from buffer `number` goes to the consumer; the pool keeps an alias of its memory to watch."""
        self.take_back()
        if number >= 0:
            # The storage itself, not a view: a view would keep `images` (its base) alive and so counted.
            self._lent.append((torch.empty(0, dtype=images.dtype).set_(images.untyped_storage()), number))
            self.batches_from_buffers += 1

    def take_back(self) -> None:
        still_used = deque()
        for mine, number in self._lent:
            if storage_users(mine) <= _HELD_BY_ONE:
                self.in_use[number] = 0
            else:
                still_used.append((mine, number))
        self._lent = still_used
