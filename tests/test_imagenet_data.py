"""ImageNet loading from both layouts on tiny data written here: decoding of the odd files real
ImageNet holds, Graphcore's application's transforms and crop distribution, exact sharded evaluation, seeded training
order, batches filled by the workers in shared memory, and corrupt images with and without
--skip-corrupt-images."""

from __future__ import annotations

import io
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from cnns.data.decoding import ImageDecoder
from cnns.data.formats import format_of_folder, records_in
from cnns.data.imagefolder import ImageFolderDataset, decode_rgb
from cnns.data.image_loader import (
    CROP_AREA,
    CROP_ASPECT,
    EvaluationSampler,
    ImageNetBatches,
    ImageNetTransform,
    TrainingSampler,
    build_imagenet_loader,
    evaluation_resize,
    evaluation_transform,
    sample_generator,
    training_crop,
)
from cnns.errors import DataError
from test_tfrecord import colour_of, write_imagenet_shards

WHOLE_IMAGE = ImageDecoder(use_native=False)  # TorchCodec (PIL for other formats), whatever is built here


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


def test_each_layout_is_recognised_by_its_format(tmp_path):
    assert format_of_folder(tmp_path, "imagenet") is None
    assert format_of_folder(tmp_path / "missing", "imagenet") is None
    write_tree(tmp_path / "tree", "val", [1])
    assert format_of_folder(tmp_path / "tree", "imagenet").name == "folder"
    write_imagenet_shards(tmp_path / "records" / "imagenet-data", "validation", [[1]])
    assert format_of_folder(tmp_path / "records", "imagenet").name == "tfrecord"
    with pytest.raises(DataError, match="cannot infer the dataset"):
        records_in(tmp_path, "train")


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
            records_in(tmp_path, "validation"), False, batch_size=4, image_size=8, workers=0, seed=0, shard=(rank, 2))
        assert num_samples == 13 and num_classes == (3 if layout == "folder" else 1000)
        for images, labels, *_ in loader:  # then the images left out and the batch's buffer
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
    source = ImageNetBatches(records_in(tmp_path, "validation"), train=False, batch_size=4, image_size=8, workers=0, shard=(1, 2))
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
    return [(images.clone(), labels.clone()) for images, labels, *_ in loader]


def test_training_batches_are_seeded_and_independent_of_workers(tmp_path):
    write_tree(tmp_path, "train", [3, 3, 3], size=(48, 40))
    make = lambda workers, seed: build_imagenet_loader(  # noqa: E731
        records_in(tmp_path, "train"), True, batch_size=4, image_size=16, workers=workers, seed=seed, drop_last=True)[0]
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
    loader, num_samples, _ = build_imagenet_loader(records_in(tmp_path, "train"), True, 3, 8, 0, 0, percentage=30)
    assert num_samples == 9
    labels = torch.cat([labels for _, labels, *_ in loader])
    assert sorted(Counter(labels.tolist()).values()) == [3, 3, 3]


def test_dataset_percentage_takes_first_records(tmp_path):
    write_imagenet_shards(tmp_path, "train", [[1] * 10, [2] * 10])
    loader, num_samples, _ = build_imagenet_loader(records_in(tmp_path, "train"), True, 5, 8, 0, 0, percentage=50)
    assert num_samples == 10
    assert set(torch.cat([labels for _, labels, *_ in loader]).tolist()) == {0}


def random_photo(height: int, width: int, file_format: str = "PNG", seed: int = 1) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)).save(
        buffer, file_format)
    return buffer.getvalue()


@pytest.mark.parametrize("file_format", ["PNG", "JPEG"])
def test_whole_image_training_crop_is_torchvision_random_resized_crop_and_flip(file_format):
    """The crop drawn from the header, cut from the whole decoded image and resized by torch, is exactly
    torchvision's resized_crop (+ horizontal flip) of that box."""
    from torchvision.transforms.v2 import functional as F

    data = random_photo(60, 80, file_format)
    image = decode_rgb(data, "x")
    transform = ImageNetTransform(True, 24, seed=3, decoder=WHOLE_IMAGE)
    flips = 0
    for index in range(12):
        crop = transform.crop(60, 80, (index, 0))
        top, left, height, width = (int(v) for v in crop.box)
        expected = F.resized_crop(image, top, left, height, width, [24, 24], antialias=True)
        if crop.flip:
            expected = F.horizontal_flip(expected)
        flips += crop.flip
        assert torch.equal(transform(data, "x", (index, 0)), expected.permute(1, 2, 0)), index
    assert 0 < flips < 12  # both ways were checked


@pytest.mark.parametrize("size", [(60, 80), (375, 500), (500, 333), (31, 29)])
def test_whole_image_evaluation_is_resize_then_centre_crop_exactly(size):
    data = random_photo(*size)
    expected = evaluation_transform(24)(decode_rgb(data, "x")).permute(1, 2, 0)
    assert torch.equal(ImageNetTransform(False, 24, decoder=WHOLE_IMAGE)(data, "x"), expected)


def test_training_crop_has_random_resized_crops_distribution():
    """training_crop on n samples' own generators against torchvision's RandomResizedCrop.get_params,
    n draws each, on a 500 x 375 image. The area fraction and log aspect: two-sample Kolmogorov-Smirnov
    distance under the critical distance for alpha = 1e-4 at these sample sizes (a correct sampler fails
    one run in 10,000; aspect 1/2-2 is over it), and the extremes reach the ends of the ranges (draws
    within 0.01 of the smallest area are about 1 % of them, within 0.02 of either end of the log aspect at
    least 1 %: none of them in n = 4000 draws has a chance of e^-40, while an area range of 8-100 % has
    none). The flip rate within 4.5 binomial standard deviations of 1/2."""
    from torchvision.transforms import v2

    n = 4000
    height, width = 375, 500
    # As the loader draws them: each sample from its own stream, a function of (seed, epoch, index).
    ours = [training_crop(height, width, sample_generator(7, 2, index)) for index in range(n)]
    torch.manual_seed(0)
    theirs = [v2.RandomResizedCrop.get_params(torch.empty(3, height, width), list(CROP_AREA), list(CROP_ASPECT))
              for _ in range(n)]

    def area_and_log_aspect(boxes):
        boxes = np.asarray(boxes, dtype=np.float64)
        return boxes[:, 2] * boxes[:, 3] / (height * width), np.log(boxes[:, 3] / boxes[:, 2])

    our_area, our_aspect = area_and_log_aspect([crop.box for crop in ours])
    their_area, their_aspect = area_and_log_aspect(theirs)
    critical = np.sqrt(-np.log(1e-4 / 2) / 2) * np.sqrt(2 / n)
    for mine, reference in ((our_area, their_area), (our_aspect, their_aspect)):
        both = np.sort(np.concatenate([mine, reference]))
        distance = np.max(np.abs(np.searchsorted(np.sort(mine), both, side="right") / n
                                 - np.searchsorted(np.sort(reference), both, side="right") / n))
        assert distance < critical, (distance, critical)
    # Rounding to whole pixels moves the area by at most about one row and column, the aspect likewise.
    assert our_area.min() > CROP_AREA[0] - 2 * (height + width) / (height * width) and our_area.max() <= 1
    slack = 2 / 30  # a 30-pixel box side, the smallest at 5 % of this image, rounded by half a pixel each way
    assert np.log(CROP_ASPECT[0]) - slack < our_aspect.min() and our_aspect.max() < np.log(CROP_ASPECT[1]) + slack
    assert our_area.min() < CROP_AREA[0] + 0.01
    assert our_aspect.min() < np.log(CROP_ASPECT[0]) + 0.02 and our_aspect.max() > np.log(CROP_ASPECT[1]) - 0.02
    assert abs(our_area.mean() - their_area.mean()) < 4.5 * np.sqrt((our_area.var() + their_area.var()) / n)
    boxes = np.asarray([crop.box for crop in ours])
    assert (boxes[:, 0] >= 0).all() and (boxes[:, 0] + boxes[:, 2] <= height).all()
    assert (boxes[:, 1] >= 0).all() and (boxes[:, 1] + boxes[:, 3] <= width).all()
    flips = sum(crop.flip for crop in ours)
    assert abs(flips / n - 0.5) < 4.5 * np.sqrt(0.25 / n)


def test_training_crop_falls_back_to_the_centre_when_no_box_fits():
    """A 1 x 100 strip: no drawn box fits in 10 tries, so the centre crop at the widest allowed aspect."""
    crop = training_crop(1, 100, np.random.default_rng(0))
    assert crop.box == (0, 49, 1, 1)


def test_same_seed_same_batches_for_0_1_and_2_workers_in_shared_memory(tmp_path):
    write_tree(tmp_path, "train", [4, 4, 4], size=(48, 40))
    write_tree(tmp_path, "validation", [3, 2, 2], size=(48, 40))

    def batches(train: bool, workers: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        source = ImageNetBatches(records_in(tmp_path, "train" if train else "validation"), train=train, batch_size=4, image_size=16, workers=workers, seed=5)
        out = []
        for images, labels in source.epoch(1):
            # Filled by a worker in shared memory and handed over as it is: no copy on the way.
            assert images.is_shared() == (workers > 0)
            out.append((images.clone(), labels.clone()))
        return out

    for train in (True, False):
        first = batches(train, 0)
        assert len(first) == (3 if train else 2)
        for workers in (1, 2):
            again = batches(train, workers)
            assert len(again) == len(first)
            assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(first, again))


def odd_files(root: Path) -> dict[str, Path]:
    """Grayscale and CMYK JPEGs, PNG bytes named .JPEG, and a BMP named .JPEG, with smooth content (so
    that different JPEG decoders' IDCTs and resizes agree closely)."""
    y, x = np.mgrid[0:40, 0:60]
    rgb = Image.fromarray(np.stack([x * 4, y * 6, 255 - x * 2], axis=-1).astype(np.uint8))
    files = {"gray": ("L", "JPEG"), "cmyk": ("CMYK", "JPEG"), "png": ("RGB", "PNG"), "bmp": ("RGB", "BMP")}
    paths = {}
    for name, (mode, file_format) in files.items():
        paths[name] = root / "train" / "a" / f"{name}.JPEG"
        save(rgb.convert(mode), paths[name], file_format)
    return paths


@pytest.mark.parametrize("decoder", [ImageDecoder(), WHOLE_IMAGE], ids=["chosen", "whole-image"])
def test_odd_files_go_through_the_loader_as_rgb_crops(tmp_path, decoder):
    """Each odd file's batch row is the crop of PIL's RGB decoding (what today's loader gave), within 3
    levels: JPEG decoders' integer IDCTs and colour conversions differ by a level or two on smooth content,
    and the antialiased resize rounds once."""
    from torchvision.transforms.v2 import functional as F

    paths = odd_files(tmp_path)
    dataset = ImageFolderDataset(tmp_path, "train")
    transform = ImageNetTransform(True, 16, seed=2, decoder=decoder)
    loader, _, _ = build_imagenet_loader(records_in(tmp_path, "train"), True, len(paths), 16, 0, 2, decoder=decoder)
    loader.sampler.set_epoch(0)
    [(images, labels, *_)] = list(loader)
    keys = [key for batch in loader.sampler for key in batch]
    for row, (index, epoch) in enumerate(keys):
        reference = torch.from_numpy(np.array(Image.open(dataset.path(index)).convert("RGB"))).permute(2, 0, 1)
        crop = transform.crop(40, 60, (index, epoch))
        top, left, height, width = (int(v) for v in crop.box)
        expected = F.resized_crop(reference, top, left, height, width, [16, 16], antialias=True)
        if crop.flip:
            expected = F.horizontal_flip(expected)
        difference = (images[row].int() - expected.permute(1, 2, 0).int()).abs().max()
        assert difference <= 3, (dataset.path(index).name, difference)


@pytest.mark.parametrize("workers", [0, 1])
def test_corrupt_images_stop_the_pass_or_are_dropped_and_named(tmp_path, workers):
    write_tree(tmp_path, "validation", [3, 3])
    bad = tmp_path / "validation" / "c1" / "img001.JPEG"
    bad.write_bytes(bad.read_bytes()[:60])
    source = ImageNetBatches(records_in(tmp_path, "validation"), train=False, batch_size=4, image_size=8, workers=workers)
    with pytest.raises(DataError, match=f"^{re.escape(str(bad))}: cannot decode image"):
        list(source.epoch(0))
    source = ImageNetBatches(records_in(tmp_path, "validation"), train=False, batch_size=4, image_size=8, workers=workers, skip_corrupt=True)
    batches = [labels.tolist() for _, labels in source.epoch(0)]
    assert batches == [[0, 0, 0, 1], [1]]  # the second batch shrank by the dropped image
    assert source.skipped_images == 1 and source.skipped_names == [str(bad)]
