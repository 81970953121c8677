"""The region JPEG decoder (cnns.kernels.jpeg): header, errors, and agreement with torchvision's whole-image
decoding + crop + antialiased resize, on photo-like JPEGs of the kinds ImageNet holds."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms.v2 import functional as F

from cnns.data.photos import photo_like_image
from cnns.kernels import jpeg

# The reference is torchvision's libjpeg-turbo decoder, the one cnns decoded with before this decoder existed.
pytestmark = [pytest.mark.skipif(not jpeg.available(), reason="the region JPEG decoder is not built here"),
              pytest.mark.filterwarnings("ignore:The image decoding and encoding capabilities:DeprecationWarning")]

# (PIL save options): chroma 4:2:0 (PIL's default and most of ImageNet), 4:4:4, 4:2:2, progressive, restart
# markers every 3 MCUs; grayscale is made separately.
KINDS = {
    "420": {"quality": 92, "subsampling": 2},
    "444": {"quality": 95, "subsampling": 0},
    "422": {"quality": 90, "subsampling": 1},
    "progressive": {"quality": 92, "progressive": True},
    "restarts": {"quality": 96, "restart_marker_blocks": 3},
}


def encode(image: Image.Image, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", **options)
    return buffer.getvalue()


def photo_jpeg(kind: str, width: int, height: int, seed: int) -> bytes:
    image = photo_like_image(np.random.default_rng(seed), width, height)
    if kind == "gray":
        return encode(image.convert("L"), quality=92)
    return encode(image, **KINDS[kind])


def whole(data: bytes) -> torch.Tensor:
    """torchvision's decoding of the whole image, RGB [3, H, W]."""
    return decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)


def reference(data: bytes, box: tuple[int, int, int, int], size: tuple[int, int]) -> torch.Tensor:
    """torchvision's training transform: the whole image decoded, cropped to the integer box, resized
    (antialias=True, uint8), HWC."""
    top, left, height, width = box
    crop = whole(data)[:, top:top + height, left:left + width]
    return F.resize(crop, list(size), antialias=True).permute(1, 2, 0)


def decoded(data, box, size, flip=False, **options) -> torch.Tensor:
    out = torch.empty(*size, 3, dtype=torch.uint8)
    assert jpeg.decode_resized_into(data, out, box, flip, **options) is None
    return out


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = ((a.double() - b.double()) ** 2).mean().item()
    return 10 * math.log10(255**2 / max(mse, 1e-12))


def random_boxes(rng: np.random.Generator, height: int, width: int, count: int, scaled: bool):
    """(box, output size) pairs; `scaled`: boxes at least twice the output in both dimensions, so that the
    decoder scales the DCT (by 1/2 or 1/4); otherwise boxes under twice the output in some dimension."""
    found = 0
    while found < count:
        box_h, box_w = int(rng.integers(8, height + 1)), int(rng.integers(8, width + 1))
        out_h, out_w = int(rng.integers(8, 240)), int(rng.integers(8, 240))
        if (box_h >= 2 * out_h and box_w >= 2 * out_w) != scaled:
            continue
        found += 1
        top, left = int(rng.integers(0, height - box_h + 1)), int(rng.integers(0, width - box_w + 1))
        yield (top, left, box_h, box_w), (out_h, out_w)


# ---------------------------------------------------------------------------------------------
# Header and errors
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", [*KINDS, "gray"])
def test_header_is_pils_size(kind):
    data = photo_jpeg(kind, 333, 251, seed=1)
    width, height = Image.open(io.BytesIO(data)).size
    components = 1 if kind == "gray" else 3
    assert jpeg.header(data) == (height, width, components)
    # Every form the loader holds bytes in.
    array = np.frombuffer(data, dtype=np.uint8)
    for form in (memoryview(data), bytearray(data), array, torch.from_numpy(array.copy())):
        assert jpeg.header(form) == (height, width, components)


def test_cmyk_is_unsupported_and_garbage_is_an_error():
    cmyk = encode(photo_like_image(np.random.default_rng(2), 64, 48).convert("CMYK"), quality=90)
    with pytest.raises(jpeg.UnsupportedJpeg):
        jpeg.header(cmyk)
    with pytest.raises(jpeg.UnsupportedJpeg):
        decoded(cmyk, (0, 0, 48, 64), (24, 32))
    assert issubclass(jpeg.UnsupportedJpeg, jpeg.JpegError) and issubclass(jpeg.JpegError, ValueError)
    for garbage in (b"", b"not a jpeg at all", b"\xff\xd8\xff" + bytes(100)):
        with pytest.raises(jpeg.JpegError) as error:
            jpeg.header(garbage)
        assert not isinstance(error.value, jpeg.UnsupportedJpeg)


@pytest.mark.parametrize("kind", ["420", "progressive"])
def test_truncated_files_are_errors_wherever_the_crop_is(kind):
    """torchvision and PIL reject a JPEG cut anywhere; so does the region decoder, even for a crop whose rows
    lie before the cut (a file without its end marker is read to its end)."""
    data = photo_jpeg(kind, 320, 240, seed=3)
    top_rows = (0, 0, 32, 320)
    assert decoded(data, top_rows, (16, 160)).float().std() > 0
    for keep in (50, 60, len(data) // 2, len(data) - 10):
        with pytest.raises(jpeg.JpegError):
            decoded(data[:keep], top_rows, (16, 160))
    # The bytes the tests elsewhere cut to 50 and 60 fail at the header already.
    with pytest.raises(jpeg.JpegError):
        jpeg.header(data[:60])
    # Bytes after the end marker (padding, appended data) are not a truncation: read to the end, same image.
    for tail in (bytes(100), b"appended"):
        assert torch.equal(decoded(data + tail, top_rows, (16, 160)), decoded(data, top_rows, (16, 160)))


def test_corrupt_scan_data_is_an_error():
    """A stray marker inside the scan is a libjpeg warning ("premature end of data segment"), an error here:
    the loader then hands the file to its general decoder, which decides about it as for any other file
    (torchvision's decoder and PIL accept such files, with the warning)."""
    data = bytearray(photo_jpeg("420", 320, 240, seed=4))
    start = data.index(b"\xff\xda") + 3000  # inside the scan's entropy-coded data
    data[start:start + 8] = b"\xff\xd4" * 4
    with pytest.raises(jpeg.JpegError, match="premature end of data segment"):
        decoded(bytes(data), (0, 0, 240, 320), (120, 160))


def test_box_outside_the_image_and_wrong_outputs_are_value_errors():
    data = photo_jpeg("420", 64, 48, seed=5)
    for box in ((0, 0, 49, 64), (-1, 0, 10, 10), (0, 60, 10, 10), (0, 0, 0, 10)):
        with pytest.raises(ValueError, match="not inside"):
            decoded(data, box, (8, 8))
    for out in (torch.empty(8, 8, 3, dtype=torch.float32), torch.empty(8, 8, 4, dtype=torch.uint8),
                torch.empty(8, 16, 3, dtype=torch.uint8)[:, ::2]):
        with pytest.raises(ValueError, match="out must be"):
            jpeg.decode_resized_into(data, out, (0, 0, 48, 64), False)


# ---------------------------------------------------------------------------------------------
# Agreement with whole-image decoding + crop + resize
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", [*KINDS, "gray"])
def test_region_decoding_matches_whole_image_decoding(kind):
    """Without DCT scaling, the region's pixels are the whole decoding's (same IDCT and colour conversion;
    the decoded columns keep a margin so that chroma upsampling has its neighbours), so the two differ only in
    the resize's rounding: here 14-bit weights, the vertical pass first; torchvision's horizontal first. Each
    pass rounds to the nearest level once (error <= 0.5, plus < 0.05 from the weights' rounding), so each
    result is within about 1 level of the exact one: |diff| <= 2, and mean |diff| < 0.5 (rounding disagrees on
    a minority of pixels)."""
    rng = np.random.default_rng(6)
    for image in range(2):
        width, height = int(rng.integers(150, 520)), int(rng.integers(150, 520))  # odd sizes too
        data = photo_jpeg(kind, width, height, seed=10 + image)
        for box, size in random_boxes(rng, height, width, 6, scaled=False):
            diff = (decoded(data, box, size).int() - reference(data, box, size).int()).abs()
            assert diff.max() <= 2 and diff.float().mean() < 0.5, (kind, box, size)
        # Same size as the box: no filtering at all, the region's pixels themselves.
        top, left = int(rng.integers(0, height - 40)), int(rng.integers(0, width - 40))
        exact = decoded(data, (top, left, 40, 37), (40, 37))
        assert torch.equal(exact, whole(data)[:, top:top + 40, left:left + 37].permute(1, 2, 0)), kind


@pytest.mark.parametrize("kind", [*KINDS, "gray"])
def test_scaled_decoding_is_close_to_whole_image_decoding(kind):
    """A box at least 2x (4x) the output is decoded with the DCT scaled by 1/2 (1/4): each scaled pixel comes
    from the 8x8 block's low frequencies, close to the mean of the 2x2 (4x4) pixels it covers, and the triangle
    filter does the rest of the reduction; torchvision's triangle spans the whole factor, a wider low-pass. The
    two differ by the detail the wider kernel removes and the narrower keeps: on photo-like content (grain of
    6-14 levels) a mean |diff| of 1.5-4 levels and 31-42 dB. Bounds: mean |diff| < 5, PSNR > 28 dB; a
    misplaced pixel or a wrong scale gives far more (a one-pixel shift alone gives about 24 dB here)."""
    rng = np.random.default_rng(7)
    width, height = 500, 375
    data = photo_jpeg(kind, width, height, seed=20)
    for box, size in random_boxes(rng, height, width, 6, scaled=True):
        ours, theirs = decoded(data, box, size), reference(data, box, size)
        assert (ours.float() - theirs.float()).abs().mean() < 5 and psnr(ours, theirs) > 28, (kind, box, size)


@pytest.mark.parametrize("kind", ["420", "422", "progressive"])
def test_scaled_region_is_the_scaled_whole_image(kind):
    """The region decoded at 1/2 or 1/4 scale is exactly that part of the whole image decoded at that scale
    (boxes on the scale's grid, output at the scaled size: the resize copies pixels)."""
    rng = np.random.default_rng(8)
    height, width = 320, 480
    data = photo_jpeg(kind, width, height, seed=30)
    for scale in (2, 4):
        scaled_whole = decoded(data, (0, 0, height, width), (height // scale, width // scale))
        for _ in range(5):
            rows, cols = int(rng.integers(10, height // scale)), int(rng.integers(10, width // scale))
            top, left = int(rng.integers(0, height // scale - rows + 1)), int(rng.integers(0, width // scale - cols + 1))
            box = (top * scale, left * scale, rows * scale, cols * scale)
            region = decoded(data, box, (rows, cols))
            assert torch.equal(region, scaled_whole[top:top + rows, left:left + cols]), (kind, scale, box)


def test_evaluation_crop_with_and_without_the_pixels_around_the_box():
    """Evaluation resizes the short side to 256 and takes the centre 224 x 224: a fractional box in source
    pixels. With read_around_box the filter reads the pixels around the box, as resize-then-crop does: the
    same within the rounding bound of the region test. Without it the filter is clamped to the box, which only
    changes outputs whose support (about 1.5 source pixels here) crosses the box's edge: the outermost row and
    column on each side, which move towards their own side's pixels; the interior agrees as closely."""
    data = photo_jpeg("420", 500, 375, seed=40)
    resized = F.resize(whole(data), [256], antialias=True)  # 256 x 341
    scale_y, scale_x = 375 / resized.shape[1], 500 / resized.shape[2]
    top, left = round((resized.shape[1] - 224) / 2), round((resized.shape[2] - 224) / 2)
    expected = F.center_crop(resized, [224, 224]).permute(1, 2, 0).int()
    box = (top * scale_y, left * scale_x, 224 * scale_y, 224 * scale_x)

    around = decoded(data, box, (224, 224), read_around_box=True).int()
    assert (around - expected).abs().max() <= 2 and (around - expected).abs().float().mean() < 0.5

    clamped = decoded(data, box, (224, 224)).int()
    inner = (clamped - expected)[1:-1, 1:-1].abs()
    assert inner.max() <= 2 and inner.float().mean() < 0.5
    border = (clamped - expected).abs().float()
    assert border.mean() < 0.5  # the border is 4 x 224 of 224 x 224 pixels: under 2 % of them


def test_fractional_boxes_resize_the_exact_interval():
    """A box that starts half a pixel in and is resized to twice its size places its samples on the
    interval's grid: a horizontal ramp decodes to the ramp's values at the sample positions."""
    ramp = np.tile((np.arange(256, dtype=np.float32))[None, :, None], (32, 1, 3)).astype(np.uint8)
    data = encode(Image.fromarray(ramp), quality=100, subsampling=0)
    out = decoded(data, (8.0, 100.5, 16.0, 50.0), (16, 100))
    # Output column j samples source x = 100.5 + (j + 0.5) * 0.5; pixel x holds the value x (centre x + 0.5).
    expected = 100.5 + (np.arange(100) + 0.5) * 0.5 - 0.5
    got = out[8, :, 0].numpy().astype(np.float64)
    assert np.abs(got[1:-1] - expected[1:-1]).max() <= 1.0  # JPEG at quality 100: within a level


# ---------------------------------------------------------------------------------------------
# Flip, views into a batch, timings
# ---------------------------------------------------------------------------------------------


def test_flip_is_the_mirror_image_exactly():
    data = photo_jpeg("420", 401, 299, seed=50)
    for box, size in [((10, 20, 250, 300), (224, 224)), ((0, 0, 299, 401), (100, 133)), ((3, 5, 40, 41), (97, 61))]:
        plain, flipped = decoded(data, box, size), decoded(data, box, size, flip=True)
        assert torch.equal(flipped, torch.flip(plain, dims=[1])), (box, size)


def test_a_view_into_a_batch_is_written_in_place_and_its_neighbours_untouched():
    data = photo_jpeg("444", 320, 240, seed=60)
    batch = torch.full((4, 64, 48, 3), 7, dtype=torch.uint8)
    for index in (0, 3, 1):  # the last image too: nothing may be written past its last pixel
        assert jpeg.decode_resized_into(data, batch[index], (10, 10, 200, 150), index == 1) is None
    expected = decoded(data, (10, 10, 200, 150), (64, 48))
    assert torch.equal(batch[0], expected) and torch.equal(batch[3], expected)
    assert torch.equal(batch[1], torch.flip(expected, dims=[1]))
    assert (batch[2] == 7).all()
    shared = torch.zeros(2, 64, 48, 3, dtype=torch.uint8).share_memory_()
    jpeg.decode_resized_into(data, shared[1], (10, 10, 200, 150), False)
    assert torch.equal(shared[1], expected) and (shared[0] == 0).all()


def test_timings_are_three_durations():
    data = photo_jpeg("420", 320, 240, seed=70)
    out = torch.empty(32, 32, 3, dtype=torch.uint8)
    timings = jpeg.decode_resized_into(data, out, (0, 0, 240, 320), True, timings=True)
    assert len(timings) == 3 and all(isinstance(t, int) and t >= 0 for t in timings) and timings[0] > 0


def test_threads_decode_at_once_into_one_batch():
    """The GIL is released while decoding and each thread keeps its own buffers: images decoded by several
    threads at once into one batch are the ones decoded one after another."""
    from concurrent.futures import ThreadPoolExecutor

    rng = np.random.default_rng(80)
    files = [photo_jpeg(kind, 300 + 7 * index, 200 + 5 * index, seed=80 + index)
             for index, kind in enumerate(["420", "444", "gray", "progressive"] * 2)]
    jobs = [(data, next(random_boxes(rng, *jpeg.header(data)[:2], 1, scaled=bool(index % 2)))[0], bool(index % 3))
            for index, data in enumerate(files)]
    one_by_one = torch.stack([decoded(data, box, (56, 48), flip) for data, box, flip in jobs])
    batch = torch.zeros(len(jobs), 56, 48, 3, dtype=torch.uint8)
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda i: jpeg.decode_resized_into(jobs[i][0], batch[i], jobs[i][1], jobs[i][2]), range(len(jobs))))
    assert torch.equal(batch, one_by_one)


def test_the_native_training_crop_is_pythons_draw_to_the_bit():
    """The crop decode_training_into draws (numpy's PCG64 stream and Generator draws redone natively) is
    cnns.data.image_loader.training_crop's for every size, seed, epoch and index: small and very elongated
    images (the fallback after ten tries), seeds above 2**63."""
    from cnns.data.image_loader import sample_generator, training_crop

    rng = np.random.default_rng(5)
    for trial in range(20000):
        kind = trial % 4
        height = int(rng.integers(1, 40 if kind == 0 else 5000))
        width = int(rng.integers(1, 40 if kind == 0 else 60 if kind == 1 else 5000))
        seed = (trial % 7, int(rng.integers(0, 2**63)), 2 * int(rng.integers(0, 2**63)) + 1)[trial % 3]
        epoch, index = int(rng.integers(0, 1000)), int(rng.integers(0, 2_000_000))
        crop = training_crop(height, width, sample_generator(seed, epoch, index))
        draw = (seed, epoch, index, *transform_draw())
        assert jpeg.training_crop(height, width, draw) == (*crop.box, crop.flip), (height, width, seed, epoch, index)


def transform_draw():
    from cnns.data.image_loader import _NATIVE_CROP_DRAW

    return _NATIVE_CROP_DRAW


def test_decode_training_into_is_the_drawn_crop_decoded():
    from cnns.data.image_loader import sample_generator, training_crop

    data = photo_jpeg("420", 200, 150, 3)
    for index in range(12):
        crop = training_crop(150, 200, sample_generator(1, 2, index))
        one, two = torch.empty(24, 24, 3, dtype=torch.uint8), torch.zeros(24, 24, 3, dtype=torch.uint8)
        jpeg.decode_resized_into(data, one, crop.box, crop.flip)
        times = jpeg.decode_training_into(data, two, (1, 2, index, *transform_draw()), 10**9, timings=True)
        assert torch.equal(one, two) and len(times) == 4 and min(times) >= 0
    with pytest.raises(jpeg.TooManyPixels, match="^150 200$"):
        jpeg.decode_training_into(data, two, (1, 2, 0, *transform_draw()), 150 * 200 - 1)


def test_the_threads_decompressor_is_reused_after_every_kind_of_failure():
    """One decompressor serves a thread from image to image: after a corrupt, truncated, CMYK or garbage file
    (each stopped by libjpeg mid-way) the next image decodes exactly as in a fresh thread."""
    import threading

    good = [photo_jpeg(kind, 200, 150, seed) for seed, kind in enumerate(("420", "progressive", "444", "gray"))]
    box, size = (10, 20, 120, 160), (40, 48)

    def fresh(data):
        found = []
        thread = threading.Thread(target=lambda: found.append(decoded(data, box, size)))
        thread.start()
        thread.join()
        return found[0]

    expected = [fresh(data) for data in good]
    corrupt = bytearray(good[0])
    start = corrupt.index(b"\xff\xda") + 2000
    corrupt[start:start + 8] = b"\xff\xd4" * 4
    cmyk = encode(photo_like_image(np.random.default_rng(2), 64, 48).convert("CMYK"), quality=90)
    bad = [bytes(corrupt), good[1][:len(good[1]) // 2], cmyk, b"\xff\xd8\xff" + bytes(100), b""]
    for failing in bad:
        for data, want in zip(good, expected):
            with pytest.raises(jpeg.JpegError):
                decoded(failing, box, size)
            assert torch.equal(decoded(data, box, size), want)
