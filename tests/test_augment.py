"""Whole-batch augmentation, normalisation and the in-memory batch iterators."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cnns.data.augment import IMAGENET_MEAN, IMAGENET_STD, cifar_augment, normalise, random_crop_flip
from cnns.data.batches import GeneratedBatches, TensorBatches
from cnns.errors import DataError


def random_images(count: int, size: int = 8, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, 256, (count, size, size, 3), dtype=torch.uint8, generator=generator)


def all_crops_and_flips(image: torch.Tensor, padding: int) -> list[tuple[int, int, bool, torch.Tensor]]:
    """Every (row offset, col offset, flipped, crop) of one HWC image, by brute force."""
    height, width, _ = image.shape
    padded = F.pad(image, (0, 0, padding, padding, padding, padding))
    results = []
    for row in range(2 * padding + 1):
        for col in range(2 * padding + 1):
            crop = padded[row : row + height, col : col + width]
            results.append((row, col, False, crop))
            results.append((row, col, True, crop.flip(1)))
    return results


# --- random_crop_flip ------------------------------------------------------------------------------


def test_crop_flip_output_is_a_crop_or_flipped_crop_of_its_own_image():
    images = random_images(24, size=8)
    out = random_crop_flip(images, 2, torch.Generator().manual_seed(1))
    assert out.shape == images.shape and out.dtype == torch.uint8
    offsets = set()
    for image, result in zip(images, out):
        matches = [(r, c, f) for r, c, f, crop in all_crops_and_flips(image, 2) if torch.equal(crop, result)]
        assert matches, "output image is no crop of its input"
        offsets.add(matches[0][:2])
    assert len(offsets) > 5  # offsets really vary between images


def test_padding_zero_only_flips_about_half():
    images = random_images(400, size=6, seed=3)
    out = random_crop_flip(images, 0, torch.Generator().manual_seed(2))
    unchanged = (out == images).flatten(1).all(1)
    flipped = (out == images.flip(2)).flatten(1).all(1)
    assert bool((unchanged | flipped).all())
    assert 150 < int(flipped.sum()) < 250


def test_crop_flip_is_reproducible_from_the_generator_seed():
    images = random_images(16, size=32)
    first = random_crop_flip(images, 4, torch.Generator().manual_seed(7))
    second = random_crop_flip(images, 4, torch.Generator().manual_seed(7))
    other = random_crop_flip(images, 4, torch.Generator().manual_seed(8))
    assert torch.equal(first, second) and not torch.equal(first, other)
    augment = cifar_augment(4)
    assert torch.equal(augment(images, augment.draw(len(images), torch.Generator().manual_seed(7))), first)


def test_crop_flip_zero_pads():
    images = torch.full((300, 4, 4, 3), 200, dtype=torch.uint8)
    out = random_crop_flip(images, 4, torch.Generator().manual_seed(0))
    assert set(out.unique().tolist()) == {0, 200}


# --- normalise -----------------------------------------------------------------------------------


def test_normalise_matches_the_closed_form_and_is_channels_last():
    images = random_images(5, size=7)
    out = normalise(images, IMAGENET_MEAN, IMAGENET_STD, torch.float32)
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    expected = (images.permute(0, 3, 1, 2).float() / 255 - mean) / std
    assert out.shape == (5, 3, 7, 7) and out.dtype == torch.float32
    assert out.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)


def test_normalise_casts_after_computing_in_float32():
    images = random_images(3, size=4)
    out = normalise(images, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25), torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out.is_contiguous(memory_format=torch.channels_last)
    exact = normalise(images, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25), torch.float32)
    assert torch.equal(out, exact.to(torch.bfloat16))


def test_normalise_traced_by_export_leaves_nothing_behind_for_eager_batches_or_the_next_export():
    """An export traces with fake tensors: constants it computes must not be cached for the eager batches and
    exports after it (inference_embedded.py compiling twice in one process failed on them)."""

    class Normalised(torch.nn.Module):
        def forward(self, images):
            return normalise(images, (0.3, 0.4, 0.5), (0.2, 0.25, 0.3), torch.float32)

    images = random_images(2, size=5)
    for _ in range(2):  # the second export after the first
        exported = torch.export.export(Normalised(), (images,))
        torch.testing.assert_close(exported.module()(images), Normalised()(images), rtol=0, atol=0)


# --- TensorBatches -------------------------------------------------------------------------------


def indexed_dataset(count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Images whose pixels encode their own index, so a batch tells which samples it holds."""
    index = torch.arange(count)
    images = torch.stack([index % 256, index // 256, torch.zeros_like(index)], 1).to(torch.uint8)
    return images.view(count, 1, 1, 3).expand(count, 4, 4, 3).contiguous(), index


def sample_ids(images: torch.Tensor) -> list[int]:
    pixel = images[:, 0, 0].to(torch.int64)
    return (pixel[:, 0] + 256 * pixel[:, 1]).tolist()


def test_every_sample_once_per_epoch_and_orders_reproducible():
    images, labels = indexed_dataset(100)
    batches = TensorBatches(images, labels, 10, shuffle=True, drop_last=True, seed=3)
    assert len(batches) == 10 and batches.num_samples == 100
    epochs = []
    for epoch in (0, 1):
        seen = []
        for batch_images, batch_labels in batches.epoch(epoch):
            assert batch_images.dtype == torch.uint8 and batch_labels.dtype == torch.int64
            assert sample_ids(batch_images) == batch_labels.tolist()
            seen += batch_labels.tolist()
        assert sorted(seen) == list(range(100))
        epochs.append(seen)
    assert epochs[0] != epochs[1]
    again = TensorBatches(images, labels, 10, shuffle=True, drop_last=True, seed=3)
    assert [label for _, b in again.epoch(1) for label in b.tolist()] == epochs[1]
    assert epochs[0] == torch.randperm(100, generator=torch.Generator().manual_seed(3)).tolist()


def test_drop_last_and_partial_batches():
    images, labels = indexed_dataset(25)
    assert len(TensorBatches(images, labels, 10, shuffle=True, drop_last=True, seed=0)) == 2
    evaluation = TensorBatches(images, labels, 10, shuffle=False, drop_last=False, seed=0)
    sizes = [len(b) for _, b in evaluation.epoch(0)]
    assert sizes == [10, 10, 5] and len(evaluation) == 3
    assert [i for _, b in evaluation.epoch(0) for i in b.tolist()] == list(range(25))


def test_resume_mid_epoch_yields_identical_batches_including_augmentation():
    images = random_images(64, size=8)
    labels = torch.arange(64)
    batches = TensorBatches(images, labels, 8, shuffle=True, drop_last=True, seed=11, augment=cifar_augment(2))
    full = list(batches.epoch(4))
    resumed_source = TensorBatches(images, labels, 8, shuffle=True, drop_last=True, seed=11, augment=cifar_augment(2))
    resumed = list(resumed_source.epoch(4, start_batch=5))
    assert len(resumed) == 3
    for (full_images, full_labels), (images_now, labels_now) in zip(full[5:], resumed):
        assert torch.equal(full_images, images_now) and torch.equal(full_labels, labels_now)
    # Augmentation really happened, and differs between batches and epochs.
    assert not torch.equal(full[0][0], images[full[0][1]])
    assert not torch.equal(list(batches.epoch(5))[0][0], full[0][0])


def test_evaluation_sharding_covers_every_sample_exactly_once():
    images, labels = indexed_dataset(103)
    seen = []
    lengths = []
    for rank in range(3):
        shard = TensorBatches(images, labels, 8, shuffle=False, drop_last=False, seed=0, shard=(rank, 3))
        rank_batches = [b.tolist() for _, b in shard.epoch(0)]
        assert len(rank_batches) == len(shard)
        assert all(0 < len(b) <= 8 for b in rank_batches)
        assert shard.shard_samples == sum(len(b) for b in rank_batches)
        lengths.append(len(shard))
        seen += [i for b in rank_batches for i in b]
    assert sorted(seen) == list(range(103))
    assert lengths == [5, 4, 4]  # 13 runs of 8 (the last of 7) dealt in turn: runs 0, 3, .. 12 to rank 0


def test_training_shards_take_runs_of_the_order_in_turn():
    images, labels = indexed_dataset(50)
    world, batch = 2, 4
    order = torch.randperm(50, generator=torch.Generator().manual_seed(9)).tolist()
    together = []
    for rank in range(world):
        shard = TensorBatches(images, labels, batch, shuffle=True, drop_last=True, seed=9, shard=(rank, world))
        rank_batches = [b.tolist() for _, b in shard.epoch(0)]
        assert len(rank_batches) == len(shard) == 50 // (world * batch)
        for group, rank_batch in enumerate(rank_batches):
            start = (group * world + rank) * batch  # the one process's micro-batch group * world + rank
            assert rank_batch == order[start:start + batch]
        together += [i for b in rank_batches for i in b]
    assert len(set(together)) == len(together) == 48


def test_shard_with_nothing_left_has_one_batch_fewer():
    images, labels = indexed_dataset(17)  # two full groups of 8, then one sample for rank 0 only
    lengths = [len(TensorBatches(images, labels, 4, shuffle=False, drop_last=False, seed=0, shard=(r, 2))) for r in (0, 1)]
    assert lengths == [3, 2]


def test_bad_arguments():
    images, labels = indexed_dataset(10)
    with pytest.raises(DataError, match="fewer than one global batch"):
        TensorBatches(images, labels, 4, shuffle=True, drop_last=True, seed=0, shard=(0, 3))
    with pytest.raises(ValueError):
        TensorBatches(images, labels[:5], 4, shuffle=True, drop_last=True, seed=0)
    with pytest.raises(ValueError):
        TensorBatches(images, labels, 4, shuffle=True, drop_last=True, seed=0, shard=(2, 2))


# --- GeneratedBatches ----------------------------------------------------------------------------


def test_generated_batches_shape_range_and_resume():
    source = GeneratedBatches(6, 16, 7, num_samples=57, seed=1)
    assert len(source) == source.batches_per_epoch == 9 and source.num_samples == 57
    batches = list(source.epoch(2))
    assert len(batches) == 9
    images, labels = batches[0]
    assert images.shape == (6, 16, 16, 3) and images.dtype == torch.uint8
    assert labels.dtype == torch.int64 and int(labels.max()) < 7
    resumed = list(source.epoch(2, start_batch=4))
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(batches[4:], resumed))
    again = GeneratedBatches(6, 16, 7, num_samples=57, seed=1)
    assert torch.equal(next(iter(again.epoch(0)))[0], next(iter(source.epoch(0)))[0])


def test_generated_samples_are_a_fixed_pool_by_position():
    pool = GeneratedBatches.POOL_SIZE
    source = GeneratedBatches(16, 4, 5, num_samples=3 * pool + 7, seed=2, drop_last=False)
    images = torch.cat([b for b, _ in source.epoch(0)])
    labels = torch.cat([b for _, b in source.epoch(0)])
    assert len(images) == 3 * pool + 7
    for position in range(len(images)):
        assert torch.equal(images[position], images[position % pool])
        assert labels[position] == labels[position % pool]
    assert len({bytes(image.numpy()) for image in images[:pool]}) == pool
    # The batches are fresh tensors: changing one changes no later batch.
    first = next(iter(source.epoch(1)))[0]
    first.zero_()
    assert torch.equal(next(iter(source.epoch(1)))[0], images[:16])
