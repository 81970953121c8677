"""Replicas equal accumulation, in the data: with a global batch G = micro-batch x accumulation x
replicas, R shards with accumulation A see in each update exactly the samples (the same images,
augmented the same way, with the same labels) that one process with accumulation R x A sees, over
several epochs and with a dataset size that is no multiple of anything; a stream resumed at any
micro-batch repeats the uninterrupted one; evaluation over R shards counts every image once.

Every source is built here directly, one per shard, in one process."""

from __future__ import annotations

import io
from collections import Counter
from itertools import count, islice
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import pytest
import torch
from PIL import Image

from cnns.data.augment import cifar_augment
from cnns.data.batches import GeneratedBatches, ShardPlan, TensorBatches
from cnns.data.image_loader import ImageNetBatches
from test_tfrecord import imagenet_example, write_tfrecord
from cnns.data.formats import records_in

pytestmark = pytest.mark.filterwarnings("ignore:The image decoding and encoding capabilities:DeprecationWarning")

MICRO_BATCH = 4
SPLITS = [(2, 1), (2, 2), (4, 1)]  # (replicas, accumulation)
N = 37  # training images: no multiple of any global batch here
CLASSES = 3

# A source for shard (rank, world), micro-batch size and global batch size.
MakeSource = Callable[[tuple[int, int], int, int], object]


def micro_batch_stream(source, start_micro_batch: int) -> Iterator:
    """The training loop's reading rule (cnns.engine.loop.micro_batch_stream): len(source)
    micro-batches per epoch, from micro-batch `start_micro_batch` counted from the start of training."""
    epoch, offset = divmod(start_micro_batch, len(source))
    for e in count(epoch):
        yield from source.epoch(e, offset)
        offset = 0


def sample_keys(images: torch.Tensor, labels: torch.Tensor) -> list[tuple[bytes, int]]:
    return [(bytes(image.contiguous().numpy()), int(label)) for image, label in zip(images, labels)]


def updates(make: MakeSource, num_samples: int, replicas: int, accumulation: int, micro_batch: int,
            count_: int) -> list[Counter]:
    """The multiset of (image bytes, label) of each of the first `count_` updates, over all shards."""
    global_batch = replicas * accumulation * micro_batch
    sources = [make((rank, replicas), micro_batch, global_batch) for rank in range(replicas)]
    for source in sources:  # whole global batches per epoch, whatever the split
        assert len(source) == num_samples // global_batch * accumulation
    streams = [micro_batch_stream(source, 0) for source in sources]
    result = []
    for _ in range(count_):
        samples = Counter()
        for stream in streams:
            for images, labels in islice(stream, accumulation):
                assert len(images) == micro_batch
                samples.update(sample_keys(images, labels))
        assert sum(samples.values()) == global_batch
        result.append(samples)
    return result


def check_replicas_equal_accumulation(make: MakeSource, num_samples: int, augmented: bool) -> None:
    for replicas, accumulation in SPLITS:
        global_batch = replicas * accumulation * MICRO_BATCH
        # Two whole epochs and the first update of a third: the stream crosses epoch boundaries.
        total = 2 * (num_samples // global_batch) + 1
        split = updates(make, num_samples, replicas, accumulation, MICRO_BATCH, total)
        single = updates(make, num_samples, 1, replicas * accumulation, MICRO_BATCH, total)
        assert split == single, f"{replicas} replicas x {accumulation} differ from 1 x {replicas * accumulation}"
        # Per sample, not per batch: the same again with half the micro-batch and twice the accumulation.
        halves = updates(make, num_samples, 1, 2 * replicas * accumulation, MICRO_BATCH // 2, total)
        assert halves == single
        # Not vacuous: epochs differ (reshuffled, or re-augmented), and an update holds distinct samples.
        per_epoch = num_samples // global_batch
        if augmented:
            assert single[0] != single[per_epoch]
        assert len(single[0]) > 1


# ---------------------------------------------------------------------------------------------
# CIFAR, in memory
# ---------------------------------------------------------------------------------------------


def noise_images(count_: int, size: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (count_, size, size, 3), dtype=torch.uint8, generator=generator)


@pytest.fixture(scope="module")
def cifar():
    return noise_images(N, 8, 0), torch.arange(N) % 10


def cifar_maker(cifar) -> MakeSource:
    images, labels = cifar

    def make(shard, micro_batch, global_batch):
        return TensorBatches(images, labels, micro_batch, shuffle=True, drop_last=True, seed=5,
                             augment=cifar_augment(2), shard=shard, global_batch_size=global_batch)

    return make


def test_cifar_replicas_see_the_samples_of_accumulation(cifar):
    check_replicas_equal_accumulation(cifar_maker(cifar), N, augmented=True)


def test_cifar_augmentation_is_per_sample_and_really_happens(cifar):
    images, labels = cifar
    make = lambda batch, shard: TensorBatches(  # noqa: E731
        images, labels, batch, shuffle=True, drop_last=False, seed=5, augment=cifar_augment(2), shard=shard)
    index_augmented = {}  # dataset index -> its augmented images seen, over batch sizes and shards
    for batch, shard in [(1, (0, 1)), (8, (0, 1)), (3, (1, 2)), (3, (0, 2)), (5, (2, 3))]:
        source = make(batch, shard)
        order = source.order(3)
        positions = list(source.plan.positions)
        seen = torch.cat([b for b, _ in source.epoch(3)])
        for position, image in zip(positions, seen):
            index_augmented.setdefault(int(order[position]), set()).add(bytes(image.numpy()))
    assert sorted(index_augmented) == list(range(N))
    assert all(len(versions) == 1 for versions in index_augmented.values())  # one augmentation per sample
    changed = sum(next(iter(index_augmented[i])) != bytes(images[i].numpy()) for i in range(N))
    assert changed > N // 2


# ---------------------------------------------------------------------------------------------
# ImageNet: a JPEG folder tree, TFRecords and WebDataset shards
# ---------------------------------------------------------------------------------------------


def noise_jpeg(index: int) -> bytes:
    array = np.random.default_rng(index).integers(0, 256, (20, 24, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, "JPEG", quality=95)
    return buffer.getvalue()


def write_noise_tree(root: Path, split: str, count_: int) -> None:
    for index in range(count_):
        path = root / split / f"c{index % CLASSES}" / f"img{index:03d}.JPEG"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(noise_jpeg(index))


def write_noise_records(root: Path, split: str, count_: int) -> None:
    """Two shards, written with the tests' own framing and protobuf writer."""
    records = [imagenet_example(noise_jpeg(index), 1 + index % CLASSES) for index in range(count_)]
    root.mkdir(parents=True, exist_ok=True)
    write_tfrecord(root / f"{split}-00000-of-00002", records[: count_ // 2])
    write_tfrecord(root / f"{split}-00001-of-00002", records[count_ // 2:])


def write_noise_shards(root: Path, split: str, count_: int) -> None:
    """WebDataset shards of 8 samples, written by GNU tar (test_webdataset's writer)."""
    from test_webdataset import write_shards

    write_shards(root, split, count_, first=0 if split == "train" else count_, label=lambda index: index % CLASSES)


@pytest.fixture(scope="module", params=["folder", "tfrecord", "webdataset"])
def imagenet(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    write = {"folder": write_noise_tree, "tfrecord": write_noise_records, "webdataset": write_noise_shards}[request.param]
    write(root, "train", N)
    write(root, "validation", N)
    return root


def imagenet_maker(root: Path) -> MakeSource:
    def make(shard, micro_batch, global_batch):
        return ImageNetBatches(records_in(root, "train"), train=True, batch_size=micro_batch, image_size=8, workers=0, seed=7,
                               shard=shard, pin_memory=False, global_batch_size=global_batch)

    return make


def test_imagenet_replicas_see_the_samples_of_accumulation(imagenet):
    check_replicas_equal_accumulation(imagenet_maker(imagenet), N, augmented=True)


def test_imagenet_evaluation_counts_every_image_once(imagenet):
    whole = ImageNetBatches(records_in(imagenet, "validation"), train=False, batch_size=5, image_size=8, workers=0, pin_memory=False)
    expected = Counter(key for images, labels in whole.epoch(0) for key in sample_keys(images, labels))
    assert sum(expected.values()) == N and len(expected) == N
    for world in (2, 3, 4):
        seen = Counter()
        for rank in range(world):
            source = ImageNetBatches(records_in(imagenet, "validation"), train=False, batch_size=3, image_size=8, workers=0,
                                     shard=(rank, world), pin_memory=False)
            batches = list(source.epoch(0))
            assert len(batches) == len(source)
            seen.update(key for images, labels in batches for key in sample_keys(images, labels))
        assert seen == expected


# ---------------------------------------------------------------------------------------------
# Generated data
# ---------------------------------------------------------------------------------------------

GENERATED = 150  # more than the pool, so positions wrap around it


def generated_make(shard, micro_batch, global_batch):
    return GeneratedBatches(micro_batch, 4, 10, num_samples=GENERATED, seed=3, shard=shard,
                            global_batch_size=global_batch)


def test_generated_replicas_see_the_samples_of_accumulation():
    check_replicas_equal_accumulation(generated_make, GENERATED, augmented=False)


def test_generated_evaluation_counts_every_sample_once():
    whole = GeneratedBatches(7, 4, 10, num_samples=GENERATED, seed=4, drop_last=False)
    expected = Counter(key for images, labels in whole.epoch(0) for key in sample_keys(images, labels))
    assert sum(expected.values()) == GENERATED
    for world in (2, 3, 4):
        seen = Counter()
        for rank in range(world):
            source = GeneratedBatches(7, 4, 10, num_samples=GENERATED, seed=4, drop_last=False, shard=(rank, world))
            seen.update(key for images, labels in source.epoch(0) for key in sample_keys(images, labels))
        assert seen == expected


# ---------------------------------------------------------------------------------------------
# Resuming, and evaluation of in-memory data
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["cifar", "imagenet", "generated"])
def test_resumed_stream_repeats_the_uninterrupted_one(kind, cifar, tmp_path):
    if kind == "cifar":
        make = cifar_maker(cifar)
    elif kind == "imagenet":
        write_noise_tree(tmp_path, "train", N)
        make = imagenet_maker(tmp_path)
    else:
        make = generated_make
    for rank in (0, 1):
        per_epoch = len(make((rank, 2), MICRO_BATCH, 16))
        total = 3 * per_epoch + 1
        full = list(islice(micro_batch_stream(make((rank, 2), MICRO_BATCH, 16), 0), total))
        for start in (1, per_epoch - 1, per_epoch, per_epoch + 1, 2 * per_epoch + 1):
            resumed = islice(micro_batch_stream(make((rank, 2), MICRO_BATCH, 16), start), total - start)
            for (images, labels), (images_now, labels_now) in zip(full[start:], resumed, strict=True):
                assert torch.equal(images, images_now) and torch.equal(labels, labels_now)


def test_cifar_evaluation_counts_every_image_once(cifar):
    images, labels = cifar
    expected = Counter(sample_keys(images, labels))
    for world in (2, 3, 4, 5):
        for batch in (1, 4, 16):
            seen = Counter()
            for rank in range(world):
                source = TensorBatches(images, labels, batch, shuffle=False, drop_last=False, seed=0,
                                       shard=(rank, world))
                batches = list(source.epoch(0))
                assert len(batches) == len(source)
                seen.update(key for b_images, b_labels in batches for key in sample_keys(b_images, b_labels))
            assert seen == expected


def test_shard_plan_update_covers_consecutive_positions():
    """Update u of (world x accumulation) covers positions [u * G, (u + 1) * G) of the epoch's order."""
    for num in (37, 50, 64):
        for world, accumulation, batch in [(1, 1, 4), (2, 1, 4), (2, 3, 2), (4, 1, 3), (3, 2, 1)]:
            global_batch = world * accumulation * batch
            plans = [ShardPlan(num, batch, rank, world, True, global_batch) for rank in range(world)]
            per_epoch = num // global_batch
            assert all(len(plan) == per_epoch * accumulation for plan in plans)
            for update in range(per_epoch):
                covered = sorted(
                    position
                    for plan in plans
                    for k in range(update * accumulation, (update + 1) * accumulation)
                    for position in plan.batch(k)
                )
                assert covered == list(range(update * global_batch, (update + 1) * global_batch))
    with pytest.raises(ValueError, match="not a multiple"):
        ShardPlan(50, 4, 0, 2, True, 12)


def test_replicas_micro_batches_are_the_one_process_micro_batches():
    """Each replica's micro-batch is one of the one process's (accumulation world x A) micro-batches, the same
    positions, so batch norm normalises the same groups of images with replicas as with accumulation: update u's
    micro-batch j of rank r is the one process's micro-batch (u * A + j) * world + r. Also without drop_last and
    with any count: the ranks' batches are disjoint runs that cover every used position once."""
    for num in (37, 50, 64):
        for world, accumulation, batch in [(2, 1, 4), (2, 3, 2), (4, 1, 3), (3, 2, 1)]:
            global_batch = world * accumulation * batch
            one = ShardPlan(num, batch, 0, 1, True, global_batch)
            plans = [ShardPlan(num, batch, rank, world, True, global_batch) for rank in range(world)]
            for rank, plan in enumerate(plans):
                for k in range(len(plan)):
                    assert plan.batch(k) == one.batch(k * world + rank)
                assert list(plan.positions) == [p for k in range(len(plan)) for p in plan.batch(k)]
            for drop_last in (False, True):
                plans = [ShardPlan(num, batch, rank, world, drop_last) for rank in range(world)]
                runs = [list(plan.batch(k)) for plan in plans for k in range(len(plan))]
                assert all(runs) and all(run == list(range(run[0], run[-1] + 1)) for run in runs)
                assert sorted(p for run in runs for p in run) == list(range(plans[0].used))
                assert [plan.samples for plan in plans] == [len(plan.positions) for plan in plans]
