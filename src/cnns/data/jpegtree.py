"""A synthetic ImageNet-like set of JPEGs, as a folder tree, TFRecord shards or WebDataset shards, for benchmarking
the input pipeline without a download.

The images are `cnns.data.photos`'s photo-like JPEGs, which cost what real ImageNet JPEGs cost to decode. The
bench-data section of docs/performance.md states the mean size and bytes this gives. The content carries no class signal: the tree is for
measuring throughput, not accuracy.
"""

from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from cnns.data.photos import photo_like_jpeg
from cnns.safe_writes import write_atomically

RECORDS_PER_SHARD = 256


def _write_one(job: tuple[str, int, int]) -> int:
    path, seed, index = job
    data = photo_like_jpeg(seed, index)
    write_atomically(path, data)  # an interrupted run or a full disk leaves no short JPEG
    return len(data)


def _write_shard(job: tuple[str, int, list[tuple[int, int]]]) -> int:
    from cnns.data.tfrecord_reader import encode_imagenet_example, write_records

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
