"""Photo-like JPEGs: what makes real ImageNet JPEGs cost what they cost to decode, without a download.

The images imitate the entropy-coded bytes (Huffman decoding is paid per bit), the pixel count (the IDCT and
colour conversion are paid per pixel) and the chroma layout of ImageNet's files. So they come in ImageNet's
usual shapes (mostly 500x375 and 375x500, some 500x333, 400x400, 500x500, a few larger up to 800x600 and a few
small), saved by libjpeg-turbo through PIL at a quality drawn from 90-96 with 4:2:0 chroma, and their content
has the statistics of photographs: a smooth colour field with sharp-edged shapes, texture whose amplitude falls
as 1/frequency (the spectrum of natural images), drawn with a strength that varies from image to image (smooth
skies to foliage), and a little sensor grain. The content carries no class signal. `cnns.data.jpegtree` writes
them as a dataset; `cnns.data.decode_rates` times the CPU decoder on them.
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

# (width, height) and how often each occurs: roughly ImageNet's shapes (mean about 460 x 425 px).
IMAGENET_LIKE_SIZES = ((500, 375), (375, 500), (500, 333), (333, 500), (400, 400), (500, 500), (640, 480),
                       (480, 640), (800, 600), (300, 225), (250, 250))
SIZE_WEIGHTS = (0.32, 0.16, 0.10, 0.04, 0.10, 0.12, 0.04, 0.03, 0.03, 0.03, 0.03)
JPEG_QUALITIES = range(90, 97)  # drawn uniformly, one per image
CHROMA_420 = 2  # PIL's `subsampling` value for 4:2:0, as cameras and ImageNet's files store colour
# The texture's standard deviation in pixel levels, drawn uniformly per image; with the grain it sets
# the bytes per pixel (together with the quality), chosen so the mean file lands near real ImageNet's.
TEXTURE_STRENGTH = (9.0, 28.0)
GRAIN = 2.0


def pink_noise(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """Gaussian noise with amplitude falling as 1/frequency, scaled to unit standard deviation."""
    fy = np.fft.fftfreq(height)[:, None]
    fx = np.fft.rfftfreq(width)[None, :]
    frequency = np.hypot(fy, fx)
    frequency[0, 0] = 1.0
    shape = (height, width // 2 + 1)
    spectrum = (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)) / frequency
    spectrum[0, 0] = 0.0
    noise = np.fft.irfft2(spectrum, s=(height, width))
    return noise / noise.std()


def shapes_on_a_colour_field(rng: np.random.Generator, width: int, height: int) -> np.ndarray:
    """A smooth colour field with sharp-edged ellipses and rectangles (edges cost bits at every scale)."""
    field = Image.fromarray(rng.integers(0, 256, (4, 5, 3), dtype=np.uint8)).resize((width, height), Image.BICUBIC)
    draw = ImageDraw.Draw(field)
    for _ in range(int(rng.integers(8, 20))):
        left, top = int(rng.integers(-50, width)), int(rng.integers(-50, height))
        box = [left, top, left + int(rng.integers(20, width // 2)), top + int(rng.integers(20, height // 2))]
        colour = tuple(int(c) for c in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=colour)
    return np.asarray(field.filter(ImageFilter.GaussianBlur(1.0)), dtype=np.float32)


def photo_like_image(rng: np.random.Generator, width: int, height: int) -> Image.Image:
    """An RGB image with photo-like statistics: shapes on a colour field, 1/f texture (mostly in
    brightness, less in colour, as in photographs), sensor grain."""
    strength = rng.uniform(*TEXTURE_STRENGTH)
    brightness = pink_noise(rng, height, width)[..., None] * strength
    colour = np.stack([pink_noise(rng, height, width) for _ in range(3)], axis=-1) * (0.3 * strength)
    grain = rng.normal(0.0, GRAIN, (height, width, 3))
    pixels = shapes_on_a_colour_field(rng, width, height) + brightness + colour + grain
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def photo_like_jpeg(seed: int, index: int) -> bytes:
    """JPEG bytes of image `index` of the tree made with `seed` (a pure function of both)."""
    rng = np.random.default_rng([seed, index])
    width, height = IMAGENET_LIKE_SIZES[rng.choice(len(IMAGENET_LIKE_SIZES), p=SIZE_WEIGHTS)]
    quality = int(rng.choice(JPEG_QUALITIES))
    buffer = io.BytesIO()
    photo_like_image(rng, width, height).save(buffer, "JPEG", quality=quality, subsampling=CHROMA_420)
    return buffer.getvalue()
