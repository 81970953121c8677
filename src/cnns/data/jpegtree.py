"""A synthetic ImageNet-like set of JPEGs, as a folder tree or as TFRecord shards, for benchmarking
the input pipeline without a download.

The images imitate what makes real ImageNet JPEGs cost what they cost to decode: ImageNet's
typical sizes (mostly 500x375 and 375x500, some 500x333 and 500x500) and photo-like content
(a smooth colour field, blurred shapes, grain), saved with PIL at quality 90, which gives files of
about 85 KB (real ImageNet training JPEGs average about 110 KB). The content carries no class
signal: the tree is for measuring throughput, not accuracy.
"""

from __future__ import annotations

import io
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

# (width, height) and how often each occurs: roughly ImageNet's most common shapes.
IMAGENET_LIKE_SIZES = ((500, 375), (375, 500), (500, 333), (500, 500))
SIZE_WEIGHTS = (0.6, 0.2, 0.1, 0.1)
JPEG_QUALITY = 90
RECORDS_PER_SHARD = 256


def photo_like_image(rng: np.random.Generator, width: int, height: int) -> Image.Image:
    """An RGB image with photo-like statistics: low-frequency colour, edges, two scales of grain."""
    field = Image.fromarray(rng.integers(0, 256, (4, 5, 3), dtype=np.uint8)).resize((width, height), Image.BICUBIC)
    draw = ImageDraw.Draw(field)
    for _ in range(int(rng.integers(8, 20))):
        left, top = int(rng.integers(-50, width)), int(rng.integers(-50, height))
        box = [left, top, left + int(rng.integers(20, width // 2)), top + int(rng.integers(20, height // 2))]
        colour = tuple(int(c) for c in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=colour)
    pixels = np.asarray(field.filter(ImageFilter.GaussianBlur(1.5)), dtype=np.float32)
    coarse = rng.normal(0, 14, ((height + 1) // 2, (width + 1) // 2, 3)).repeat(2, 0).repeat(2, 1)
    fine = rng.normal(0, 6, (height, width, 3))
    return Image.fromarray(np.clip(pixels + coarse[:height, :width] + fine, 0, 255).astype(np.uint8))


def photo_like_jpeg(seed: int, index: int) -> bytes:
    """JPEG bytes of image `index` of the tree made with `seed` (a pure function of both)."""
    rng = np.random.default_rng([seed, index])
    width, height = IMAGENET_LIKE_SIZES[rng.choice(len(IMAGENET_LIKE_SIZES), p=SIZE_WEIGHTS)]
    buffer = io.BytesIO()
    photo_like_image(rng, width, height).save(buffer, "JPEG", quality=JPEG_QUALITY)
    return buffer.getvalue()


def _write_one(job: tuple[str, int, int]) -> int:
    path, seed, index = job
    data = photo_like_jpeg(seed, index)
    partial = Path(f"{path}.partial")  # renamed when complete: an interrupted run leaves no short JPEG
    partial.write_bytes(data)
    partial.replace(path)
    return len(data)


def _write_shard(job: tuple[str, int, list[tuple[int, int]]]) -> int:
    from cnns.data.tfrecord import encode_imagenet_example, write_records

    path, seed, items = job
    records = [encode_imagenet_example(photo_like_jpeg(seed, index), label + 1) for index, label in items]
    write_records(path, records)  # 1-based labels, as in the ImageNet TFRecords
    return sum(map(len, records))


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


def make_jpeg_tree(root: str | os.PathLike, images: int, classes: int = 10, validation_images: int | None = None,
                   seed: int = 0, processes: int | None = None, layout: str = "folder") -> dict[str, int]:
    """A synthetic ImageNet of `images` training and `validation_images` (default images // 10)
    validation JPEGs, dealt to `classes` classes in turn, in either layout:

    * "folder": root/train/<class>/<name>.JPEG and root/validation/<class>/<name>.JPEG, the classes
      named like ImageNet synsets (n00000000, ...);
    * "tfrecord": root/train-NNNNN-of-MMMMM and root/validation-NNNNN-of-MMMMM shards of up to
      RECORDS_PER_SHARD tf.train.Example records with 1-based labels, as the seed's ImageNet.

    Files already present are kept, so a second call with the same arguments writes nothing.
    Returns {"train": count, "validation": count, "bytes": bytes written}."""
    if images < 1 or classes < 1:
        raise ValueError("images and classes must be at least 1")
    if layout not in ("folder", "tfrecord"):
        raise ValueError(f"layout must be folder or tfrecord, got {layout!r}")
    if validation_images is None:
        validation_images = max(classes, images // 10)
    make_jobs, write = (_folder_jobs, _write_one) if layout == "folder" else (_shard_jobs, _write_shard)
    jobs = []
    for split, count, offset in (("train", images, 0), ("validation", validation_images, images)):
        jobs += make_jobs(Path(root), split, count, offset, classes, seed)
    work = len(jobs) if layout == "folder" else images + validation_images
    processes = processes or min(os.cpu_count() or 1, max(1, work // 50), len(jobs) or 1)
    if processes > 1:
        with ProcessPoolExecutor(processes) as pool:
            written = sum(pool.map(write, jobs, chunksize=16 if layout == "folder" else 1))
    else:
        written = sum(map(write, jobs))
    return {"train": images, "validation": validation_images, "bytes": written}
