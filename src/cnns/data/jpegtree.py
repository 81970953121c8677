"""A synthetic ImageNet-like set of JPEGs, as a folder tree, TFRecord shards or WebDataset shards, for benchmarking
the input pipeline without a download.

The images imitate what makes real ImageNet JPEGs cost what they cost to decode: the entropy-coded
bytes (Huffman decoding is paid per bit), the pixel count (the IDCT and colour conversion are paid
per pixel) and the chroma layout. So they come in ImageNet's usual shapes (mostly 500x375 and
375x500, some 500x333, 400x400, 500x500, a few larger up to 800x600 and a few small), saved by
libjpeg-turbo through PIL at a quality drawn from 90-96 with 4:2:0 chroma, and their content has
the statistics of photographs: a smooth colour field with sharp-edged shapes, texture whose
amplitude falls as 1/frequency (the spectrum of natural images), drawn with a strength that varies
from image to image (smooth skies to foliage), and a little sensor grain. The README states the
mean size and bytes this gives. The content carries no class signal: the tree is for measuring
throughput, not accuracy.
"""

from __future__ import annotations

import io
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

from cnns.runfolder.files import write_atomically

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
RECORDS_PER_SHARD = 256


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
def _write_one(job: tuple[str, int, int]) -> int:
    path, seed, index = job
    data = photo_like_jpeg(seed, index)
    write_atomically(path, data)  # an interrupted run or a full disk leaves no short JPEG
    return len(data)


def _write_shard(job: tuple[str, int, list[tuple[int, int]]]) -> int:
    from cnns.data.tfrecord import encode_imagenet_example, write_records

    path, seed, items = job
    records = [encode_imagenet_example(photo_like_jpeg(seed, index), label + 1) for index, label in items]
    write_records(path, records)  # 1-based labels, as in the ImageNet TFRecords
    return sum(map(len, records))


def _write_tar_shard(job: tuple[str, int, list[tuple[int, int]]]) -> int:
    from cnns.data.formats.webdataset import write_shard

    path, seed, items = job
    return write_shard(path, ((f"{index:08d}", photo_like_jpeg(seed, index), label) for index, label in items))


def _folder_jobs(root: Path, split: str, count: int, offset: int, classes: int, seed: int) -> list:
    jobs = []
    for index in range(count):
        path = root / split / f"n{index % classes:08d}" / f"{split}_{index:07d}.JPEG"
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            jobs.append((str(path), seed, offset + index))
    return jobs


def _shard_jobs(root: Path, split: str, count: int, offset: int, classes: int, seed: int) -> list:
    shards = max(1, -(-count // RECORDS_PER_SHARD))
    root.mkdir(parents=True, exist_ok=True)
    jobs = []
    for shard in range(shards):
        path = root / f"{split}-{shard:05d}-of-{shards:05d}"
        # Records are dealt to the shards in turn, so every shard mixes the classes, as in ImageNet's.
        items = [(offset + index, index % classes) for index in range(shard, count, shards)]
        if not path.exists():
            jobs.append((str(path), seed, items))
    return jobs


def _tar_shard_jobs(root: Path, split: str, count: int, offset: int, classes: int, seed: int) -> list:
    """timm/imagenet-1k-wds's names (imagenet1k-train-0000.tar), the classes mixed in every shard as there."""
    shards = max(1, -(-count // RECORDS_PER_SHARD))
    root.mkdir(parents=True, exist_ok=True)
    jobs = []
    for shard in range(shards):
        path = root / f"imagenet1k-{split}-{shard:04d}.tar"
        items = [(offset + index, index % classes) for index in range(shard, count, shards)]
        if not path.exists():
            jobs.append((str(path), seed, items))
    return jobs


# Each layout: (the jobs of a split, what writes one job, whether a job is one image rather than a shard).
LAYOUTS = {"folder": (_folder_jobs, _write_one, True), "tfrecord": (_shard_jobs, _write_shard, False),
           "webdataset": (_tar_shard_jobs, _write_tar_shard, False)}


def make_jpeg_tree(root: str | os.PathLike, images: int, classes: int = 10, validation_images: int | None = None,
                   seed: int = 0, processes: int | None = None, layout: str = "folder") -> dict[str, int]:
    """A synthetic ImageNet of `images` training and `validation_images` (default images // 10)
    validation JPEGs, dealt to `classes` classes in turn, in either layout:

    * "folder": root/train/<class>/<name>.JPEG and root/validation/<class>/<name>.JPEG, the classes
      named like ImageNet synsets (n00000000, ...);
    * "tfrecord": root/train-NNNNN-of-MMMMM and root/validation-NNNNN-of-MMMMM shards of up to
      RECORDS_PER_SHARD tf.train.Example records with 1-based labels, as in the ImageNet TFRecords
      Graphcore's application reads;
    * "webdataset": root/imagenet1k-train-NNNN.tar and root/imagenet1k-validation-NNNN.tar shards of up to
      RECORDS_PER_SHARD samples, each KEY.jpg + KEY.cls (0-based), as timm/imagenet-1k-wds.

    Files already present are kept, so a second call with the same arguments writes nothing.
    Returns {"train": count, "validation": count, "bytes": bytes written}."""
    if images < 1 or classes < 1:
        raise ValueError("images and classes must be at least 1")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    if validation_images is None:
        validation_images = max(classes, images // 10)
    make_jobs, write, per_image = LAYOUTS[layout]
    jobs = []
    for split, count, offset in (("train", images, 0), ("validation", validation_images, images)):
        jobs += make_jobs(Path(root), split, count, offset, classes, seed)
    work = len(jobs) if per_image else images + validation_images
    processes = processes or min(os.cpu_count() or 1, max(1, work // 50), len(jobs) or 1)
    if processes > 1:
        with ProcessPoolExecutor(processes) as pool:
            written = sum(pool.map(write, jobs, chunksize=16 if per_image else 1))
    else:
        written = sum(map(write, jobs))
    return {"train": images, "validation": validation_images, "bytes": written}
