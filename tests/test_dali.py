"""--decode-device dali on DALI's CPU backend: the plumbing the GPU path shares (order, labels, shards, epochs,
restore, crops, corrupt files) against the CPU loader, on a tiny JPEG tree. Skipped where the optional extra
`dali` is not installed; the GPU half (device="mixed", the hardware decoder) needs a GPU and does not run here."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

pytest.importorskip("nvidia.dali", reason="the optional extra 'dali' (pip install -e '.[dali]') is not installed")

from cnns.data import dali  # noqa: E402
from cnns.data.decoding import ImageDecoder, device_jpeg_size  # noqa: E402
from cnns.data.formats import records_in  # noqa: E402
from cnns.data.image_loader import _NATIVE_CROP_DRAW, ImageNetBatches  # noqa: E402
from cnns.errors import DataError  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import scripts  # noqa: E402

CPU = torch.device("cpu")
SIZE = 32
SEED = 3
BATCH = 4


def photo(index: int, mode: str = "RGB") -> Image.Image:
    """A smooth picture of its own size (44-90 px a side), so that crops, resizes and borders all differ."""
    rng = np.random.default_rng(index)
    height, width = (int(v) for v in rng.integers(44, 90, 2))
    y, x = np.mgrid[:height, :width]
    phase = rng.uniform(0, 6.28, 3)
    pixels = np.stack([127 + 100 * np.sin(x / (6 + c) + y / (9 - c) + phase[c]) for c in range(3)], axis=-1)
    return Image.fromarray(pixels.astype(np.uint8)).convert(mode)


def jpeg(image: Image.Image, file_format: str = "JPEG", orientation: int | None = None) -> bytes:
    buffer = io.BytesIO()
    options = {}
    if orientation is not None:  # an EXIF orientation tag, which cnns's decoders leave unapplied
        exif = Image.Exif()
        exif[0x0112] = orientation
        options["exif"] = exif.tobytes()
    image.save(buffer, file_format, quality=92, **options)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """3 classes: 7 training images each (one CMYK JPEG and one PNG named .JPEG among them, which DALI is not
    given, and a grey JPEG and one with an EXIF orientation, which it is), 3 validation images each."""
    root = tmp_path_factory.mktemp("dali-tree")
    index = 0
    for split, per_class in (("train", 7), ("validation", 3)):
        for label in range(3):
            folder = root / split / f"n{label:08d}"
            folder.mkdir(parents=True)
            for item in range(per_class):
                if split == "train" and (label, item) == (1, 2):
                    data = jpeg(photo(index, "CMYK"))
                elif split == "train" and (label, item) == (2, 5):
                    data = jpeg(photo(index), "PNG")
                elif (label, item) == (0, 1):
                    data = jpeg(photo(index, "L"))
                elif (label, item) == (2, 0):
                    data = jpeg(photo(index), orientation=6)
                else:
                    data = jpeg(photo(index))
                (folder / f"{item}.JPEG").write_bytes(data)
                index += 1
    return root


def _split(train: bool) -> str:
    return "train" if train else "validation"


def dali_batches(tree: Path, train: bool = True, **options) -> dali.DaliBatches:
    return dali.DaliBatches(records_in(tree, _split(train)), train, options.pop("batch_size", BATCH), SIZE, CPU,
                            seed=SEED, **options)


def cpu_batches(tree: Path, train: bool = True, **options) -> ImageNetBatches:
    """The CPU loader in this process, decoding whole images with TorchCodec and resizing with torch: the
    reference whose crops DALI cuts from the same decoded pixels (libjpeg-turbo underneath both)."""
    return ImageNetBatches(records_in(tree, _split(train)), train, options.pop("batch_size", BATCH), SIZE, workers=0,
                           seed=SEED,
                           decoder=ImageDecoder(use_native=False), **options)


def fed_sources(monkeypatch) -> list[list[str]]:
    """The files of each batch handed to DALI, as they are fed."""
    fed: list[list[str]] = []
    original = dali.feed

    def recording(pipe, train, samples):
        fed.append([sample.source for sample in samples])
        original(pipe, train, samples)

    monkeypatch.setattr(dali, "feed", recording)
    return fed


# Pixel tolerance. Both sides decode with libjpeg-turbo and resize with the antialiased triangle filter, but
# (1) each rounds its filter's result once to uint8, in its own arithmetic (DALI in float, torch with
# fixed-point weights): one level apart at most; (2) DALI decodes the crop's region only, and libjpeg-turbo
# upsamples the chroma at the region's edge from the edge's own samples where the whole image has neighbours
# outside the box: that reaches the output's outer pixel or two (the filter's support at these scales), so
# those are left out of the comparison.
LEVELS = 1
EDGE = 2


def assert_close_inside(ours: torch.Tensor, reference: torch.Tensor, edge: int = EDGE) -> None:
    difference = (ours.int() - reference.int()).abs()
    inside = difference[:, edge:SIZE - edge, edge:SIZE - edge]
    assert inside.max() <= LEVELS, f"{inside.max()} levels apart inside the {edge}-pixel border"


def test_training_batches_are_the_cpu_loaders_in_order_labels_and_pixels(tree):
    ours, reference = dali_batches(tree), cpu_batches(tree)
    assert len(ours) == len(reference) and ours.num_samples == reference.num_samples
    for epoch in (0, 1):
        got, expected = list(ours.epoch(epoch)), list(reference.epoch(epoch))
        assert len(got) == len(expected) == len(ours)
        for (images, labels), (images_ref, labels_ref) in zip(got, expected):
            assert torch.equal(labels, labels_ref)
            assert images.shape == images_ref.shape and images.dtype == torch.uint8
            assert_close_inside(images, images_ref)


def test_the_crops_fed_to_dali_are_the_native_decoders_own_draws(tree, monkeypatch):
    """The native decoder draws the CPU path's training crops in C (`cnns.kernels.jpeg.training_crop`, bit for
    bit `training_crop`): the boxes and flips DALI is given are those, for every (seed, epoch, index)."""
    jpeg_kernel = pytest.importorskip("cnns.kernels.jpeg")
    if not jpeg_kernel.available():
        pytest.skip("the native region decoder is not built here")
    samples = []
    original = dali.training_sample

    def recording(data, source, crop):
        sample = original(data, source, crop)
        samples.append(sample)
        return sample

    monkeypatch.setattr(dali, "training_sample", recording)
    ours = dali_batches(tree)
    index_of = {ours.records.source(index): index for index in range(len(ours.records))}
    flips = set()
    for epoch in (0, 1):
        samples.clear()
        list(ours.epoch(epoch))
        ours.keys.set_epoch(epoch)
        used = [index for batch in ours.keys for index, _ in batch]
        # every image of the epoch but the CMYK and PNG files, which the CPU decoder decodes
        assert sorted(index_of[sample.source] for sample in samples) == sorted(
            index for index in used if device_jpeg_size(*ours.records.read(index)[::2]) is not None)
        for sample in samples:
            height, width = device_jpeg_size(bytes(sample.data), sample.source)
            draw = (SEED, epoch, index_of[sample.source], *_NATIVE_CROP_DRAW)
            top, left, box_height, box_width, flip = jpeg_kernel.training_crop(height, width, draw)
            assert (sample.anchor, sample.shape, sample.flip) == ((left, top), (box_width, box_height), flip)
            flips.add(flip)
    assert flips == {True, False}


def test_replicas_take_disjoint_shares_that_cover_one_process_s_batches(tree, monkeypatch):
    """Two replicas with the global batch of two micro-batches see, update by update, the images one process
    with accumulation 2 sees: disjoint, and together the same."""
    fed = fed_sources(monkeypatch)
    global_batch = 2 * BATCH
    list(dali_batches(tree, shard=(0, 1), global_batch_size=global_batch).epoch(1))
    one = [source for batch in fed for source in batch]
    fed.clear()
    shares = []
    for rank in (0, 1):
        list(dali_batches(tree, shard=(rank, 2), global_batch_size=global_batch).epoch(1))
        shares.append([source for batch in fed for source in batch])
        fed.clear()
    assert not set(shares[0]) & set(shares[1])
    assert sorted(shares[0] + shares[1]) == sorted(one)


def test_evaluation_counts_every_image_once_over_the_replicas_and_matches_the_cpu_crop(tree):
    shares = [dali_batches(tree, train=False, batch_size=2, shard=(rank, 2)) for rank in (0, 1)]
    labels = torch.cat([labels for share in shares for _, labels in share.epoch(0)])
    reference = cpu_batches(tree, train=False, batch_size=2)
    assert torch.equal(torch.sort(labels).values, torch.sort(torch.cat([l for _, l in reference.epoch(0)])).values)
    ours = dali_batches(tree, train=False, batch_size=2)
    for (images, labels), (images_ref, labels_ref) in zip(ours.epoch(0), reference.epoch(0)):
        assert torch.equal(labels, labels_ref)
        # The whole image decoded and resized on both sides: no region edge, so every pixel is compared.
        assert_close_inside(images, images_ref, edge=0)


def test_epochs_reshuffle_and_a_restore_continues_at_the_same_image(tree):
    ours = dali_batches(tree)
    first, second = list(ours.epoch(0)), list(ours.epoch(1))
    assert len(first) == len(second) == len(ours)
    assert not all(torch.equal(a[1], b[1]) for a, b in zip(first, second))  # a new order each epoch
    for start in (1, len(ours) - 1):
        resumed = list(dali_batches(tree).epoch(1, start_batch=start))
        assert len(resumed) == len(second) - start
        for (images, labels), (images_ref, labels_ref) in zip(resumed, second[start:]):
            assert torch.equal(labels, labels_ref) and torch.equal(images, images_ref)
    # An epoch left after one batch (a run's end mid-epoch) leaves nothing queued for the next one.
    batches = ours.epoch(1)
    next(batches)
    batches.close()
    again = list(ours.epoch(1))
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(again, second))


def truncated_tree(tree: Path, tmp_path: Path) -> tuple[Path, Path]:
    root = tmp_path / "tree"
    for path in tree.rglob("*.JPEG"):
        copy = root / path.relative_to(tree)
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_bytes(path.read_bytes())
    bad = root / "train" / "n00000000" / "3.JPEG"
    bad.write_bytes(bad.read_bytes()[:len(bad.read_bytes()) // 2])
    return root, bad


def test_a_corrupt_jpeg_is_named_in_one_line_or_left_out_and_counted(tree, tmp_path):
    root, bad = truncated_tree(tree, tmp_path)
    with pytest.raises(DataError) as error:
        for epoch in (0, 1):
            list(dali_batches(root).epoch(epoch))
    message = str(error.value)
    assert message.startswith(f"{bad}: cannot decode image") and "\n" not in message
    skipping = dali_batches(root, skip_corrupt=True)
    reference = cpu_batches(root, skip_corrupt=True)
    got, expected = list(skipping.epoch(0)), list(reference.epoch(0))
    assert [len(labels) for _, labels in got] == [len(labels) for _, labels in expected]
    for (images, labels), (images_ref, labels_ref) in zip(got, expected):
        assert torch.equal(labels, labels_ref)
        assert_close_inside(images, images_ref)
    assert skipping.skipped_images == reference.skipped_images == 1 and skipping.skipped_names == [str(bad)]


def test_train_py_decodes_with_dali_and_says_so(tree, tmp_path, capfd):
    out = scripts.run_here(capfd, "train.py", "--model", "resnet", "--model-size", "18", "--dataset", "imagenet",
                           "--data-dir", str(tree), "--image-size", "48", "--iterations", "2", "--micro-batch-size",
                           "4", "--seed", "3", "--decode-device", "dali", cwd=tmp_path)
    assert "Images decoded by NVIDIA DALI" in out.stdout and "on the CPU (its CPU backend)" in out.stdout
    assert "(--decode-device dali)" in out.stdout
    assert "Validation top-1 accuracy" in out.stdout  # the evaluation pipeline, after training


def test_train_py_names_a_corrupt_jpeg_in_its_last_line_without_a_traceback(tree, tmp_path, capfd):
    """cnns's line is the last on stderr; nvImageCodec, under DALI, logs its own "[ERROR] [jpeg_parser] ..." lines
    before it (from its native threads: no option of DALI 2.4 turns them off)."""
    root, bad = truncated_tree(tree, tmp_path)
    # Batches of 3 take all 21 training images in the epoch: with 4, the epoch's one left-over image (a different
    # one for each run's seed) was sometimes the corrupt one, and the run trained to its end.
    out = scripts.run_here(capfd, "train.py", "--model", "resnet", "--model-size", "18", "--dataset", "imagenet",
                           "--data-dir", str(root), "--image-size", "48", "--epochs", "1", "--micro-batch-size", "3",
                           "--decode-device", "dali", "--no-validation", cwd=tmp_path, expect=2)
    assert "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith(f"error: {bad}: cannot decode image")


def test_tfrecord_shards_give_the_cpu_loaders_batches_too(tmp_path):
    from test_tfrecord import imagenet_example, write_tfrecord

    records = [imagenet_example(jpeg(photo(index)), index % 3 + 1) for index in range(14)]
    write_tfrecord(tmp_path / "train-00000-of-00002", records[:7])
    write_tfrecord(tmp_path / "train-00001-of-00002", records[7:])
    for epoch in (0, 1):
        got, expected = list(dali_batches(tmp_path).epoch(epoch)), list(cpu_batches(tmp_path).epoch(epoch))
        assert len(got) == len(expected) > 0
        for (images, labels), (images_ref, labels_ref) in zip(got, expected):
            assert torch.equal(labels, labels_ref)
            assert_close_inside(images, images_ref)
