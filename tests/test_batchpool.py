"""Workers write their batches into reusable shared-memory buffers (cnns.data.batchpool), and a buffer is
written again only once nothing in the main process holds the batch it carried."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from cnns.data.formats import records_in
from cnns.data.image_loader import BATCH_BUFFERS_PER_WORKER, ImageNetBatches


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """24 noise images in 3 classes: every training batch differs from every other."""
    root = tmp_path_factory.mktemp("pooltree")
    rng = np.random.default_rng(5)
    for index in range(24):
        folder = root / "train" / f"c{index % 3}"
        folder.mkdir(parents=True, exist_ok=True)
        pixels = rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / f"img{index:02d}.JPEG", quality=90)
    return root


def batches(tree, workers: int) -> ImageNetBatches:
    return ImageNetBatches(records_in(tree, "train"), train=True, batch_size=2, image_size=16, workers=workers, seed=3)


def test_batches_kept_by_the_consumer_are_never_written_again(tree):
    reference = [(images.clone(), labels) for images, labels in batches(tree, 0).epoch(0)]
    source = batches(tree, 1)
    kept = list(source.epoch(0))  # every batch of the epoch held at once
    assert len(kept) == len(reference) == 12
    for (images, labels), (want, want_labels) in zip(kept, reference):
        assert torch.equal(images, want) and torch.equal(labels, want_labels)
    # Only the buffers the worker had before the consumer held them all can have served.
    assert source.loader.dataset.pool.batches_from_buffers <= BATCH_BUFFERS_PER_WORKER


def test_buffers_are_reused_once_the_consumer_lets_go(tree):
    reference = [images.clone() for images, _ in batches(tree, 0).epoch(0)]
    source = batches(tree, 1)
    for epoch in range(2):
        for index, (images, _) in enumerate(source.epoch(epoch)):
            if epoch == 0:
                assert torch.equal(images, reference[index])
            pixels = images.clone()  # a copy, as the device feed makes; the batch itself is let go
            del images
            assert pixels.shape == (2, 16, 16, 3)
    pool = source.loader.dataset.pool
    # 24 batches over two epochs; the first few buffers are new, the rest reused (a batch whose buffer
    # was still flagged when the worker needed one comes in fresh memory, uncounted).
    assert pool.batches_from_buffers >= 24 - 2 * BATCH_BUFFERS_PER_WORKER


def test_a_view_kept_of_a_batch_keeps_its_buffer(tree):
    source = batches(tree, 1)
    epoch = source.epoch(0)
    first, _ = next(epoch)
    kept = first[1:]  # a view: the batch's memory is still used
    want = kept.clone()
    del first
    for _ in epoch:
        pass
    assert torch.equal(kept, want)
