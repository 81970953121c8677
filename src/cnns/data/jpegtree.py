"""A synthetic ImageNet-like set of JPEGs, as a folder tree, TFRecord shards, WebDataset shards or a Hugging Face
layout (Parquet shards, a save_to_disk folder), for benchmarking
the input pipeline without a download.

The images are `cnns.data.photos`'s photo-like JPEGs, which cost what real ImageNet JPEGs cost to decode. The
bench-data section of docs/performance.md states the mean size and bytes this gives. The content carries no class signal: the tree is for
measuring throughput, not accuracy.
"""

from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor
from functools import partial
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


ROWS_PER_FILE = 4 * RECORDS_PER_SHARD
ROWS_PER_GROUP = 100  # datasets' row groups for image datasets (config.PARQUET_ROW_GROUP_SIZE_FOR_IMAGE_DATASETS)


def _table_jobs(root: Path, split: str, count: int, offset: int, classes: int, seed: int, *, arrow: bool) -> list:
    """Hugging Face's names: data/<split>-0000k-of-0000n.parquet (the Hub's), or <split>/data-0000k-of-0000n.arrow
    (save_to_disk's), the classes mixed in every file."""
    files = max(1, -(-count // ROWS_PER_FILE))
    folder = root / split if arrow else root / "data"
    folder.mkdir(parents=True, exist_ok=True)
    jobs = []
    for number in range(files):
        name = f"data-{number:05d}-of-{files:05d}.arrow" if arrow else f"{split}-{number:05d}-of-{files:05d}.parquet"
        items = [(offset + index, index % classes) for index in range(number, count, files)]
        if not (folder / name).exists():
            jobs.append((str(folder / name), seed, items, classes))
    return jobs


def _write_table(job: tuple[str, int, list[tuple[int, int]], int]) -> int:
    """One file as `datasets` writes it: an image struct {bytes, path}, an int64 label, the features (Image,
    ClassLabel with the synset-like names) in the schema's "huggingface" metadata; Parquet in row groups of
    ROWS_PER_GROUP, Arrow as an IPC stream."""
    import io
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    path, seed, items, classes = job
    features = {"image": {"_type": "Image"},
                "label": {"names": [f"n{label:08d}" for label in range(classes)], "_type": "ClassLabel"}}
    images = [photo_like_jpeg(seed, index) for index, _ in items]
    table = pa.table({"image": [{"bytes": data, "path": f"{index:08d}.JPEG"} for data, (index, _) in zip(images, items)],
                      "label": pa.array([label for _, label in items], pa.int64())})
    table = table.replace_schema_metadata({"huggingface": json.dumps({"info": {"features": features}})})
    buffer = io.BytesIO()
    if path.endswith(".parquet"):
        # datasets' own choice for image columns: JPEG bytes stored plain, uncompressed
        pq.write_table(table, buffer, row_group_size=ROWS_PER_GROUP, compression="none", use_dictionary=False)
    else:
        with pa.ipc.new_stream(buffer, table.schema) as stream:
            stream.write_table(table, max_chunksize=1000)
    write_atomically(path, buffer.getvalue())
    return buffer.tell()


def _write_saved_metadata(root: Path, classes: int) -> None:
    """save_to_disk's JSON files beside the Arrow files (dataset_dict.json, each split's state.json and
    dataset_info.json), kept where they are there already."""
    import json

    features = {"image": {"_type": "Image"},
                "label": {"names": [f"n{label:08d}" for label in range(classes)], "_type": "ClassLabel"}}
    files = {root / "dataset_dict.json": {"splits": ["train", "validation"]}}
    for split in ("train", "validation"):
        names = sorted(path.name for path in (root / split).glob("data-*.arrow"))
        files[root / split / "state.json"] = {"_data_files": [{"filename": name} for name in names], "_split": split}
        files[root / split / "dataset_info.json"] = {"features": features}
    for path, content in files.items():
        if not path.exists():
            write_atomically(path, json.dumps(content, indent=2).encode())


# Each layout: (the jobs of a split, what writes one job, whether a job is one image rather than a shard).
LAYOUTS = {"folder": (_folder_jobs, _write_one, True), "tfrecord": (_shard_jobs, _write_shard, False),
           "webdataset": (_tar_shard_jobs, _write_tar_shard, False),
           "huggingface-parquet": (partial(_table_jobs, arrow=False), _write_table, False),
           "huggingface-arrow": (partial(_table_jobs, arrow=True), _write_table, False)}


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
      RECORDS_PER_SHARD samples, each KEY.jpg + KEY.cls (0-based), as timm/imagenet-1k-wds, with the _info.json
      timm's wds reader reads;
    * "huggingface-parquet": root/data/train-0000k-of-0000n.parquet (the Hub's layout, row groups of 100 rows, the
      features in the schema's metadata), "huggingface-arrow": a save_to_disk folder (root/train/data-*.arrow with
      state.json and dataset_info.json, root/dataset_dict.json), written with pyarrow as `datasets` writes them.

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
    if layout == "webdataset":
        _write_tar_info(Path(root), images, validation_images, classes)
    if layout == "huggingface-arrow":
        _write_saved_metadata(Path(root), classes)
    return {"train": images, "validation": validation_images, "bytes": written}


def _write_tar_info(root: Path, images: int, validation_images: int, classes: int) -> None:
    """The _info.json timm's wds reader needs (`timm.data.create_dataset("wds/...", root=...)`): each split's
    shards and their sample counts, as `_tar_shard_jobs` dealt them."""
    from cnns.data.formats.webdataset import write_info

    splits = {}
    for split, count in (("train", images), ("validation", validation_images)):
        shards = max(1, -(-count // RECORDS_PER_SHARD))
        splits[split] = [(f"imagenet1k-{split}-{shard:04d}.tar", len(range(shard, count, shards)))
                         for shard in range(shards)]
    write_info(root, "cnns-jpeg-tree", splits, classes)
