"""Resumable batch iterators over datasets held whole in memory, and over generated random data.

No DataLoader and no worker processes: the dataset is one uint8 NHWC tensor, a batch is one
index_select, and augmentation runs on the whole batch (see augment.py). On a 2-core CPU this
beats worker processes, which would compete with the model for the same two cores.

Every order and every random draw is a pure function of (seed, epoch, batch, shard), so a run
resumed from a checkpoint mid-epoch sees exactly the batches it would have seen.
"""

from __future__ import annotations

from typing import Callable, Iterator

import numpy as np
import torch

from cnns.errors import DataError

Augment = Callable[[torch.Tensor, torch.Generator], torch.Tensor]


class TensorBatches:
    """Batches of (uint8 NHWC images, int64 labels) from tensors held in memory.

    Order: with shuffle, epoch e visits the samples in the order
    ``torch.randperm(N, generator=torch.Generator().manual_seed(seed + e))``; without, in index
    order. The order depends only on (seed, epoch), never on earlier epochs, so any epoch can be
    replayed on its own.

    Sharding, shard=(rank, world): the epoch's order is cut into consecutive groups of
    world * batch_size positions; from each group, rank r takes positions r, r + world,
    r + 2 * world, ... (batch_size of them). With drop_last, only whole groups are used, so every
    rank has the same number of full batches. Without drop_last, the last, partial group is dealt
    out by the same rule: every sample is seen exactly once across the ranks, with no padding and
    no duplicates; the last batch of a rank may be smaller, and a rank whose share of the partial
    group is empty has one batch fewer than the others.

    Augmentation: `augment(images, generator)` is applied to each batch, with a fresh CPU
    generator seeded from (seed, epoch, batch, rank); the images are wherever the dataset tensors
    are (CPU, or a CUDA device if the caller put the dataset there).

    The yielded tensors are new (index_select copies), so the caller may modify them in place.
    """

    def __init__(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        batch_size: int,
        *,
        shuffle: bool,
        drop_last: bool,
        seed: int,
        augment: Augment | None = None,
        shard: tuple[int, int] = (0, 1),
    ) -> None:
        rank, world = shard
        if not 0 <= rank < world:
            raise ValueError(f"shard rank {rank} is outside 0..{world - 1}")
        if batch_size < 1:
            raise ValueError(f"batch size must be at least 1, got {batch_size}")
        if len(images) != len(labels):
            raise ValueError(f"{len(images)} images but {len(labels)} labels")
        if len(images) == 0:
            raise DataError("the dataset is empty")
        if drop_last and len(images) < world * batch_size:
            raise DataError(
                f"the dataset has {len(images)} samples, fewer than one global batch of "
                f"{world} x {batch_size}: no batch would ever be produced"
            )
        self.images = images
        self.labels = labels
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.seed = seed
        self.augment = augment
        self.rank = rank
        self.world = world
        # The whole dataset (all shards) and this shard's share of one epoch.
        self.num_samples = len(images)
        self.shard_samples = self._shard_sample_count()

    def __len__(self) -> int:
        """Batches per epoch for this shard (the same for every epoch)."""
        group = self.world * self.batch_size
        full_groups = self.num_samples // group
        if self.drop_last:
            return full_groups
        leftover = self.num_samples - full_groups * group
        return full_groups + (1 if leftover > self.rank else 0)

    def _shard_sample_count(self) -> int:
        group = self.world * self.batch_size
        full_groups = self.num_samples // group
        leftover = 0 if self.drop_last else self.num_samples - full_groups * group
        return full_groups * self.batch_size + len(range(self.rank, leftover, self.world))

    def epoch(self, epoch: int, start_batch: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Yield this shard's batches of `epoch`, skipping the first `start_batch` (already
        consumed before a resume); the rest are identical to an uninterrupted epoch."""
        if start_batch < 0:
            raise ValueError(f"start_batch must not be negative, got {start_batch}")
        batches = self._shard_batches(epoch)
        for batch_index in range(start_batch, len(batches)):
            indices = batches[batch_index].to(self.images.device)
            images = self.images.index_select(0, indices)
            labels = self.labels.index_select(0, indices.to(self.labels.device))
            if self.augment is not None:
                images = self.augment(images, self._augment_generator(epoch, batch_index))
            yield images, labels

    def order(self, epoch: int) -> torch.Tensor:
        """The global visiting order of `epoch` (all ranks), int64 [N] on the CPU."""
        if not self.shuffle:
            return torch.arange(self.num_samples)
        return torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(self.seed + epoch))

    def _shard_batches(self, epoch: int) -> list[torch.Tensor]:
        """This shard's batches of `epoch`, as CPU index tensors, by the rule in the class docstring."""
        order = self.order(epoch)
        group = self.world * self.batch_size
        full_groups = self.num_samples // group
        # Each group viewed as [batch_size, world]: column r holds positions r, r + world, ...
        whole = order[: full_groups * group].view(full_groups, self.batch_size, self.world)
        batches = list(whole[:, :, self.rank].unbind(0))
        leftover = order[full_groups * group :]
        if not self.drop_last and len(leftover) > self.rank:
            batches.append(leftover[self.rank :: self.world])
        return batches

    def _augment_generator(self, epoch: int, batch_index: int) -> torch.Generator:
        return torch.Generator().manual_seed(mix_seed(self.seed, epoch, batch_index, self.rank))


class GeneratedBatches:
    """Random uint8 NHWC images with random labels, made once on the host and reused.

    For measuring throughput without a dataset while still paying for the host->device copy. A
    small pool of distinct batches is made in the constructor and cycled through, so producing a
    batch costs nothing. The same tensors are yielded again and again: do not modify them in
    place.
    """

    POOL_SIZE = 4

    def __init__(
        self,
        batch_size: int,
        image_size: int | tuple[int, int],
        num_classes: int,
        batches_per_epoch: int,
        seed: int,
    ) -> None:
        if batch_size < 1 or batches_per_epoch < 1 or num_classes < 1:
            raise ValueError("batch_size, batches_per_epoch and num_classes must all be at least 1")
        height, width = (image_size, image_size) if isinstance(image_size, int) else image_size
        generator = torch.Generator().manual_seed(seed)
        pool_size = min(self.POOL_SIZE, batches_per_epoch)
        self.pool = [
            (
                torch.randint(0, 256, (batch_size, height, width, 3), dtype=torch.uint8, generator=generator),
                torch.randint(0, num_classes, (batch_size,), generator=generator),
            )
            for _ in range(pool_size)
        ]
        self.batch_size = batch_size
        self.batches_per_epoch = batches_per_epoch
        self.num_samples = batch_size * batches_per_epoch
        self.shard_samples = self.num_samples

    def __len__(self) -> int:
        return self.batches_per_epoch

    def epoch(self, epoch: int, start_batch: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if start_batch < 0:
            raise ValueError(f"start_batch must not be negative, got {start_batch}")
        for batch_index in range(start_batch, self.batches_per_epoch):
            yield self.pool[(epoch * self.batches_per_epoch + batch_index) % len(self.pool)]


def mix_seed(*parts: int) -> int:
    """One 64-bit seed from several integers, well mixed so that neighbouring (epoch, batch)
    pairs get unrelated random streams (seed + epoch + batch would collide)."""
    state = np.random.SeedSequence([part % 2**64 for part in parts]).generate_state(2, dtype=np.uint32)
    return int(state[0]) << 32 | int(state[1])
