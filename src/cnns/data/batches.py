"""Resumable batch iterators over datasets held whole in memory, and over generated random data.

No DataLoader and no worker processes: the dataset is one uint8 NHWC tensor, a batch is one
index_select, and augmentation runs on the whole batch (see augment.py). Worker processes would only
add copies and compete with the model for the same cores: a batch here is one gather, not a decode.

Every order and every random draw is a pure function of (seed, epoch, sample), never of the batch
size, the batch or the shard, so a run resumed from a checkpoint mid-epoch sees exactly the batches
it would have seen, and R replicas with accumulation A see in each update exactly the samples, and
the augmentation of each, that one process with accumulation R x A sees (see ShardPlan).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch

from cnns.data.augment import Augment
from cnns.errors import DataError

# Labels the random stream of the augmentation parameters, apart from other streams of (seed, epoch).
_AUGMENT_STREAM = 0xA7C


@dataclass(frozen=True)
class ShardPlan:
    """Which positions of an epoch's order of `count` samples shard (rank, world) takes, and how
    they are cut into its batches: the one rule every training and in-memory source follows.

    The epoch uses its first `used` positions: all of them, or with `global_batch_size` only whole
    global batches ((count // global_batch_size) * global_batch_size positions; the order is
    reshuffled every epoch, so a different remainder is left out each time), and with `drop_last`
    only whole groups of world * batch_size. Those positions are cut into blocks of batch_size
    (the last may be short without drop_last), dealt out in turn: block b goes to rank b % world,
    so rank r's k-th batch is block k * world + r, positions [(k * world + r) * batch_size,
    (k * world + r + 1) * batch_size). A rank whose turn at the last, partial group never comes has
    one batch fewer. Without drop_last every used position goes to exactly one rank: no padding,
    no duplicates.

    Why replicas equal accumulation: with global_batch_size = world * accumulation * batch_size,
    update u consumes batches [u * A, (u + 1) * A) of every rank, i.e. blocks [u * A * world,
    (u + 1) * A * world): exactly the blocks one process with world x A micro-batches of
    batch_size takes in update u, whatever the split of the global batch into world x accumulation.
    Each micro-batch is the same images as one of the one process's, so even batch norm, which
    normalises a micro-batch's images together, sees the same groups; and every rank has
    (count // G) * A batches per epoch, whatever world.
    """

    count: int
    batch_size: int
    rank: int = 0
    world: int = 1
    drop_last: bool = True
    global_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch size must be at least 1, got {self.batch_size}")
        if self.world < 1 or not 0 <= self.rank < self.world:
            raise ValueError(f"shard rank {self.rank} is outside 0..{self.world - 1}")
        if self.global_batch_size is not None and (
                self.global_batch_size < 1 or self.global_batch_size % (self.world * self.batch_size)):
            raise ValueError(f"the global batch size {self.global_batch_size} is not a multiple of "
                             f"{self.world} shards x batch size {self.batch_size}")

    @property
    def used(self) -> int:
        """How many positions of the epoch's order are used (by all shards together)."""
        used = self.count
        if self.global_batch_size is not None:
            used -= used % self.global_batch_size
        if self.drop_last:
            used -= used % (self.world * self.batch_size)
        return used

    @property
    def positions(self) -> np.ndarray:
        """This shard's positions in the epoch's order, in the order it visits them (int64)."""
        everything = np.arange(self.used, dtype=np.int64)
        return everything[(everything // self.batch_size) % self.world == self.rank]

    @property
    def samples(self) -> int:
        """This shard's samples per epoch."""
        return sum(len(self.batch(index)) for index in range(len(self)))

    def __len__(self) -> int:
        """This shard's batches per epoch (the same for every epoch)."""
        blocks = -(-self.used // self.batch_size)
        return max(0, -(-(blocks - self.rank) // self.world))

    def batch(self, index: int) -> range:
        """The positions of this shard's `index`-th batch of an epoch: one contiguous run."""
        start = (index * self.world + self.rank) * self.batch_size
        return range(min(start, self.used), min(start + self.batch_size, self.used))


def shuffled(indices: np.ndarray, seed: int, epoch: int) -> np.ndarray:
    """`indices` (int64) in a uniformly random order that is a function of (seed, epoch) alone: the training order of a
    reader that can read any sample as cheaply as the next (a folder tree, TFRecords)."""
    generator = torch.Generator().manual_seed(mix_seed(seed, epoch))
    return indices[torch.randperm(len(indices), generator=generator).numpy()]


def _positions_tensor(positions: range) -> torch.Tensor:
    return torch.arange(positions.start, positions.stop)


class TensorBatches:
    """Batches of (uint8 NHWC images, int64 labels) from tensors held in memory.

    Order: with shuffle, epoch e visits the samples in the order
    ``torch.randperm(N, generator=torch.Generator().manual_seed(seed + e))``; without, in index
    order. The order depends only on (seed, epoch), never on earlier epochs, so any epoch can be
    replayed on its own.

    Sharding and batching, shard=(rank, world): by ShardPlan (rank r takes the r-th run of
    batch_size positions of each group of world * batch_size positions of the order). Training passes drop_last and
    global_batch_size (micro-batch x accumulation x replicas), so every rank has the same number
    of full batches and an epoch is a whole number of global batches; evaluation passes neither,
    so every sample is seen exactly once across the ranks.

    Augmentation: an Augment (augment.py). Its per-sample parameters for epoch e are drawn for the
    whole dataset at once, row i for sample i, from a CPU generator seeded from (seed, e), and each
    batch applies the rows of the samples it holds: the augmentation of a sample is a function of
    (seed, epoch, sample) alone, the same whatever the batch size, the rank or the world. The
    images are wherever the dataset tensors are (CPU, or a CUDA device if the caller put them there).

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
        global_batch_size: int | None = None,
    ) -> None:
        rank, world = shard
        if len(images) != len(labels):
            raise ValueError(f"{len(images)} images but {len(labels)} labels")
        self.plan = ShardPlan(len(images), batch_size, rank, world, drop_last, global_batch_size)
        if len(images) == 0:
            raise DataError("the dataset is empty")
        if self.plan.used == 0:
            whole = global_batch_size if global_batch_size is not None else world * batch_size
            raise DataError(
                f"the dataset has {len(images)} samples, fewer than one global batch of {whole} "
                f"({world} x {whole // world}): no batch would ever be produced"
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
        self.shard_samples = self.plan.samples
        self._augment_params: tuple[int, torch.Tensor] | None = None  # (epoch, rows): the last drawn

    def __len__(self) -> int:
        """Batches per epoch for this shard (the same for every epoch)."""
        return len(self.plan)

    def epoch(self, epoch: int, start_batch: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Yield this shard's batches of `epoch`, skipping the first `start_batch` (already
        consumed before a resume); the rest are identical to an uninterrupted epoch."""
        if start_batch < 0:
            raise ValueError(f"start_batch must not be negative, got {start_batch}")
        order = self.order(epoch)
        params = self.augment_params(epoch) if self.augment is not None else None
        for batch_index in range(start_batch, len(self.plan)):
            positions = self.plan.batch(batch_index)
            indices = order[positions.start:positions.stop]
            on_device = indices.to(self.images.device)
            images = self.images.index_select(0, on_device)
            labels = self.labels.index_select(0, on_device.to(self.labels.device))
            if params is not None:
                images = self.augment(images, params.index_select(0, indices))
            yield images, labels

    def order(self, epoch: int) -> torch.Tensor:
        """The global visiting order of `epoch` (all ranks), int64 [N] on the CPU."""
        if not self.shuffle:
            return torch.arange(self.num_samples)
        return torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(self.seed + epoch))

    def augment_params(self, epoch: int) -> torch.Tensor:
        """The augmentation parameters of `epoch`, one row per sample (by dataset index), on the CPU."""
        if self._augment_params is None or self._augment_params[0] != epoch:
            generator = torch.Generator().manual_seed(mix_seed(self.seed, epoch, _AUGMENT_STREAM))
            self._augment_params = (epoch, self.augment.draw(self.num_samples, generator))
        return self._augment_params[1]


class GeneratedBatches:
    """A virtual dataset of `num_samples` random uint8 NHWC images with random labels.

    For measuring throughput without a dataset while still paying for a real batch on the host
    and the host->device copy. A fixed pool of POOL_SIZE random images and labels is made once
    from the seed; the sample at position p of every epoch is pool[p % POOL_SIZE]. Positions are
    sharded and batched by ShardPlan like any other source, so replicas see the samples one
    process with more accumulation sees. A batch is one index_select from the pool: a fresh
    tensor the caller may modify.
    """

    POOL_SIZE = 64

    def __init__(
        self,
        batch_size: int,
        image_size: int | tuple[int, int],
        num_classes: int,
        *,
        num_samples: int,
        seed: int,
        drop_last: bool = True,
        shard: tuple[int, int] = (0, 1),
        global_batch_size: int | None = None,
    ) -> None:
        if num_samples < 1 or num_classes < 1:
            raise ValueError("num_samples and num_classes must both be at least 1")
        rank, world = shard
        self.plan = ShardPlan(num_samples, batch_size, rank, world, drop_last, global_batch_size)
        if self.plan.used == 0:
            raise DataError(f"{num_samples} generated samples are fewer than one global batch")
        height, width = (image_size, image_size) if isinstance(image_size, int) else image_size
        generator = torch.Generator().manual_seed(seed)
        self.pool_images = torch.randint(0, 256, (self.POOL_SIZE, height, width, 3), dtype=torch.uint8,
                                         generator=generator)
        self.pool_labels = torch.randint(0, num_classes, (self.POOL_SIZE,), generator=generator)
        self.batch_size = batch_size
        self.num_samples = num_samples
        self.shard_samples = self.plan.samples

    @property
    def batches_per_epoch(self) -> int:
        return len(self.plan)

    def __len__(self) -> int:
        return len(self.plan)

    def epoch(self, epoch: int, start_batch: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The same batches every epoch (the virtual dataset is not shuffled)."""
        del epoch
        if start_batch < 0:
            raise ValueError(f"start_batch must not be negative, got {start_batch}")
        for batch_index in range(start_batch, len(self.plan)):
            slots = _positions_tensor(self.plan.batch(batch_index)) % self.POOL_SIZE
            yield self.pool_images.index_select(0, slots), self.pool_labels.index_select(0, slots)


def mix_seed(*parts: int) -> int:
    """One 64-bit seed from several integers, well mixed so that neighbouring (epoch, batch)
    pairs get unrelated random streams (seed + epoch + batch would collide)."""
    state = np.random.SeedSequence([part % 2**64 for part in parts]).generate_state(2, dtype=np.uint32)
    return int(state[0]) << 32 | int(state[1])
