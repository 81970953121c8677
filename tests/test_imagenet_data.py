"""ImageNet loading from both layouts on tiny data written here: decoding of the odd files real
ImageNet holds, the seed's transforms, exact sharded evaluation and seeded training order."""

from __future__ import annotations

import io
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from cnns.data.imagefolder import ImageFolderDataset, decode_rgb
from cnns.data.imagenet import (
    EvaluationSampler,
    ImageNetBatches,
    ImageNetTransform,
    TrainingSampler,
    build_imagenet_loader,
    detect_imagenet,
    evaluation_resize,
)
from cnns.errors import DataError
from test_tfrecord import colour_of, write_imagenet_shards

pytestmark = pytest.mark.filterwarnings("ignore:The image decoding and encoding capabilities:DeprecationWarning")


def save(image: Image.Image, path: Path, file_format: str = "JPEG") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, file_format)


def colour_image(index: int, size=(30, 20)) -> Image.Image:
    return Image.new("RGB", size, colour_of(index))


def write_tree(root: Path, split: str, per_class: list[int], size=(30, 20)) -> list[tuple[int, int]]:
    """Class folders c0, c1, ... with per_class[c] solid-colour images each; image k (in sorted
    order) has colour_of(k). Returns (colour index, class) per image, in dataset order."""
    written = []
    for label, count in enumerate(per_class):
        for item in range(count):
            save(colour_image(len(written), size), root / split / f"c{label}" / f"img{item:03d}.JPEG")
            written.append((len(written), label))
    return written


def colour_index_of(image_hwc: torch.Tensor, candidates: int) -> int:
    """Which colour_of(k) a (solid-colour) image is."""
    mean = image_hwc.float().mean(dim=(0, 1))
    distances = [float((mean - torch.tensor(colour_of(k), dtype=torch.float32)).abs().max()) for k in range(candidates)]
    best = int(np.argmin(distances))
    assert distances[best] < 4, distances[best]
    return best


# ---------------------------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------------------------


def test_grayscale_cmyk_and_png_named_jpeg_decode_to_rgb(tmp_path):
    rgb = Image.fromarray(np.random.default_rng(0).integers(0, 256, (20, 30, 3), dtype=np.uint8))
    save(rgb.convert("L"), tmp_path / "train" / "a" / "gray.JPEG")
    save(rgb.convert("CMYK"), tmp_path / "train" / "a" / "cmyk.JPEG")
    save(rgb, tmp_path / "train" / "b" / "png_bytes.JPEG", "PNG")
    save(rgb.convert("RGBA"), tmp_path / "train" / "b" / "rgba_png.JPEG", "PNG")
    dataset = ImageFolderDataset(tmp_path, "train")
    assert dataset.classes == ["a", "b"] and len(dataset) == 4
    for index in range(len(dataset)):
        image, _ = dataset[index]
        assert image.dtype == torch.uint8 and image.shape == (3, 20, 30), dataset.path(index)
        path = dataset.path(index)
        expected = np.asarray(Image.open(path).convert("RGB"))
        assert np.abs(image.permute(1, 2, 0).numpy().astype(int) - expected).max() <= 1, path


def test_pil_fallback_and_corrupt_file_named(tmp_path):
    buffer = io.BytesIO()
    Image.new("RGB", (5, 4), (10, 200, 30)).save(buffer, "BMP")  # not a torchvision format
    image = decode_rgb(buffer.getvalue(), "x.bmp")
    assert image.shape == (3, 4, 5) and image[:, 0, 0].tolist() == [10, 200, 30]

    good = tmp_path / "train" / "a" / "good.JPEG"
    save(colour_image(1), good)
    bad = tmp_path / "train" / "a" / "truncated.JPEG"
    bad.write_bytes(good.read_bytes()[:60])
    dataset = ImageFolderDataset(tmp_path, "train")
    with pytest.raises(DataError, match="truncated.JPEG: cannot decode image"):
        for index in range(len(dataset)):
            dataset[index]


# ---------------------------------------------------------------------------------------------
# Transforms and layouts
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("size", [(500, 375), (40, 90), (17, 17)])
def test_transforms_give_image_size_hwc_uint8(train, size):
    buffer = io.BytesIO()
    Image.new("RGB", size, (1, 2, 3)).save(buffer, "JPEG")
    for image_size in (224, 32):
        image = ImageNetTransform(train, image_size)(buffer.getvalue(), "x")
        assert image.dtype == torch.uint8 and image.shape == (image_size, image_size, 3)
    assert evaluation_resize(224) == 256


def test_evaluation_transform_is_resize_then_centre_crop():
    # A 64x32 image whose left and right quarters are red and blue: the centre crop of the short side
    # resized to 16 * 256/224 = 18 keeps only the green middle.
    array = np.zeros((32, 64, 3), np.uint8)
    array[:, :16] = (255, 0, 0)
    array[:, 16:48] = (0, 255, 0)
    array[:, 48:] = (0, 0, 255)
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, "PNG")
    image = ImageNetTransform(False, 16)(buffer.getvalue(), "x")
    assert image[:, :, 1].min() > 200 and image[:, :, 0].max() < 60 and image[:, :, 2].max() < 60


def test_detect_imagenet(tmp_path):
    assert detect_imagenet(tmp_path) is None
    assert detect_imagenet(tmp_path / "missing") is None
    write_tree(tmp_path / "tree", "val", [1])
    assert detect_imagenet(tmp_path / "tree") == "folder"
    write_imagenet_shards(tmp_path / "records" / "imagenet-data", "validation", [[1]])
    assert detect_imagenet(tmp_path / "records") == "tfrecord"
    with pytest.raises(DataError, match="no ImageNet found"):
        build_imagenet_loader(tmp_path, True, 2, 8, 0, 0)


# ---------------------------------------------------------------------------------------------
# Exact sharded evaluation
# ---------------------------------------------------------------------------------------------


def _write_validation(layout: str, root: Path) -> list[tuple[int, int]]:
    """13 validation images over 3 classes; (colour index, class) per image."""
    if layout == "folder":
        write_tree(root, "train", [1, 1, 1])
        return write_tree(root, "validation", [5, 4, 4])
    written = write_imagenet_shards(root, "validation", [[1, 2, 3, 1, 2], [3, 3, 1, 2], [2, 2, 1, 3]])
    return [(colour, label - 1) for colour, label in written]


@pytest.mark.parametrize("layout", ["folder", "tfrecord"])
def test_two_shard_evaluation_yields_every_image_exactly_once(tmp_path, layout):
    written = _write_validation(layout, tmp_path)
    assert len(written) == 13
    seen = []
    for rank in range(2):
        loader, num_samples, num_classes = build_imagenet_loader(
            tmp_path, False, batch_size=4, image_size=8, workers=0, seed=0, shard=(rank, 2))
        assert num_samples == 13 and num_classes == (3 if layout == "folder" else 1000)
        for images, labels in loader:
            assert images.dtype == torch.uint8 and images.shape[1:] == (8, 8, 3) and images.shape[0] <= 4
            assert labels.dtype == torch.int64
            for image, label in zip(images, labels):
                colour = colour_index_of(image, 13)
                seen.append(colour)
                assert written[colour][1] == label.item()
    assert Counter(seen) == Counter(range(13))


def test_evaluation_sampler_partitions_exactly():
    for size in (0, 1, 13, 50):
        for world in (1, 2, 3, 8):
            parts = [list(EvaluationSampler(size, (rank, world))) for rank in range(world)]
            assert sum(parts, []) == list(range(size))
            assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_imagenet_batches_protocol_and_resume(tmp_path):
    _write_validation("folder", tmp_path)
    source = ImageNetBatches(tmp_path, train=False, batch_size=4, image_size=8, workers=0, shard=(1, 2))
    batches = [labels.tolist() for _, labels in source.epoch(0)]
    assert len(source) == len(batches) == 2 and source.num_samples == 13 and source.num_classes == 3
    assert [labels.tolist() for _, labels in source.epoch(0, start_batch=1)] == batches[1:]
    assert len(source) == 2


# ---------------------------------------------------------------------------------------------
# Training order and augmentation
# ---------------------------------------------------------------------------------------------


def test_training_sampler_equal_disjoint_shards_reshuffled_per_epoch():
    indices = np.arange(100, 123)  # 23 samples
    samplers = [TrainingSampler(indices, (rank, 3), seed=5) for rank in range(3)]
    epoch0 = [[i for i, _ in s] for s in samplers]
    assert all(len(part) == 23 // 3 for part in epoch0)
    flat = sum(epoch0, [])
    assert len(set(flat)) == len(flat) and set(flat) <= set(indices.tolist())
    assert [i for i, _ in TrainingSampler(indices, (0, 3), seed=5)] == epoch0[0]  # a function of the seed
    for s in samplers:
        s.set_epoch(1)
    assert [[i for i, _ in s] for s in samplers] != epoch0
    samplers[0].set_epoch(1, start=2)
    assert len(samplers[0]) == 23 // 3 - 2


def _batches(loader, epoch):
    loader.sampler.set_epoch(epoch)
    return [(images.clone(), labels.clone()) for images, labels in loader]


def test_training_batches_are_seeded_and_independent_of_workers(tmp_path):
    write_tree(tmp_path, "train", [3, 3, 3], size=(48, 40))
    make = lambda workers, seed: build_imagenet_loader(  # noqa: E731
        tmp_path, True, batch_size=4, image_size=16, workers=workers, seed=seed, drop_last=True)[0]
    loader, other_seed, with_worker = make(0, 1), make(0, 2), make(1, 1)
    torch.manual_seed(123)  # the global RNG must neither matter nor be disturbed
    state = torch.get_rng_state()
    first = _batches(loader, 0)
    assert torch.equal(torch.get_rng_state(), state)
    assert len(first) == 2 and all(images.shape == (4, 16, 16, 3) for images, _ in first)
    for again in (_batches(make(0, 1), 0), _batches(with_worker, 0)):
        assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(first, again))
    assert any(not torch.equal(a[0], b[0]) for a, b in zip(first, _batches(other_seed, 0)))
    assert any(not torch.equal(a[0], b[0]) for a, b in zip(first, _batches(loader, 1)))


def test_dataset_percentage_keeps_every_class_of_a_folder_tree(tmp_path):
    write_tree(tmp_path, "train", [10, 10, 10])
    loader, num_samples, _ = build_imagenet_loader(tmp_path, True, 3, 8, 0, 0, percentage=30)
    assert num_samples == 9
    labels = torch.cat([labels for _, labels in loader])
    assert sorted(Counter(labels.tolist()).values()) == [3, 3, 3]


def test_dataset_percentage_takes_first_records(tmp_path):
    write_imagenet_shards(tmp_path, "train", [[1] * 10, [2] * 10])
    loader, num_samples, _ = build_imagenet_loader(tmp_path, True, 5, 8, 0, 0, percentage=50)
    assert num_samples == 10
    assert set(torch.cat([labels for _, labels in loader]).tolist()) == {0}


def test_channels_last_crop_matches_torchvision_crop():
    from torchvision.transforms import v2

    from cnns.data.imagenet import ChannelsLastRandomResizedCrop

    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(1).integers(0, 256, (60, 80, 3), dtype=np.uint8)).save(buffer, "PNG")
    image = decode_rgb(buffer.getvalue(), "x")
    for seed in range(5):
        torch.manual_seed(seed)
        ours = ChannelsLastRandomResizedCrop(24, scale=(0.05, 1), ratio=(3 / 4, 4 / 3), antialias=True)(image)
        torch.manual_seed(seed)
        stock = v2.RandomResizedCrop(24, scale=(0.05, 1), ratio=(3 / 4, 4 / 3), antialias=True)(image)
        assert torch.equal(ours, stock)
        assert ours.permute(1, 2, 0).is_contiguous()
