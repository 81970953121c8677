"""Hugging Face image datasets as `datasets` itself writes them (issue 71): the Hub's Parquet layout
(``data/train-00000-of-00002.parquet``: an ``image`` struct {bytes, path}, a ``label`` ClassLabel, the features in the
schema's ``huggingface`` metadata) and a ``save_to_disk`` folder (Arrow streams, dataset_info.json, state.json).
Read back row for row, the class names from the features, the order a function of (seed, epoch), a resumed epoch
continuing at the same sample, replicas and workers disjoint and covering, a run trained, validated and restored, and
bad data named in one line before a run folder is written."""

from __future__ import annotations

import io
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import scripts
from cnns.data.formats import TrainingBatch, check_data, class_names, find_format, format_of_folder, records_in
from cnns.data.formats import huggingface_parquet
from cnns.data.formats.huggingface_arrow import HF_ARROW
from cnns.data.formats.huggingface_parquet import HF_PARQUET
from cnns.data.image_loader import ImageNetBatches
from cnns.errors import ConfigError, DataError
from test_training import read_csv, run_folder

datasets = pytest.importorskip("datasets")
pq = pytest.importorskip("pyarrow.parquet")

pytestmark = pytest.mark.filterwarnings("ignore:The image decoding and encoding capabilities:DeprecationWarning")

TRAIN, VALIDATION = 22, 9  # no multiple of any batch here
NAMES = [f"class{i:02d}" for i in range(40)]  # more names than labels used: the count is the features'


def noise_jpeg(index: int) -> bytes:
    array = np.random.default_rng(index).integers(0, 256, (20, 24, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def hf_dataset(indices: range):
    """Each row its own class (its index), so that a batch's labels name its rows."""
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=NAMES)})
    return datasets.Dataset.from_dict({"image": [{"bytes": noise_jpeg(i), "path": f"{i}.jpg"} for i in indices],
                                       "label": list(indices)}, features=features)


def write_hub_parquet(root: Path, split: str, indices: range, shards: int = 2) -> None:
    """As `push_to_hub` lays a split out: data/<split>-0000k-of-0000n.parquet, rows in row groups of 4."""
    (root / "data").mkdir(parents=True, exist_ok=True)
    dataset = hf_dataset(indices)
    for shard in range(shards):
        dataset.shard(shards, shard, contiguous=True).to_parquet(
            str(root / "data" / f"{split}-{shard:05d}-of-{shards:05d}.parquet"), batch_size=4)


@pytest.fixture(scope="module")
def layouts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    write_hub_parquet(root / "parquet", "train", range(TRAIN))
    write_hub_parquet(root / "parquet", "validation", range(TRAIN, TRAIN + VALIDATION), shards=1)
    datasets.DatasetDict({"train": hf_dataset(range(TRAIN)),
                          "validation": hf_dataset(range(TRAIN, TRAIN + VALIDATION))}).save_to_disk(
        str(root / "saved"), max_shard_size="40KB")  # a few Arrow files per split
    return {"parquet": root / "parquet", "saved": root / "saved"}


FORMAT = {"parquet": HF_PARQUET, "saved": HF_ARROW}


@pytest.mark.parametrize("layout", ["parquet", "saved"])
def test_what_datasets_wrote_is_read_back_row_for_row(layouts, layout):
    folder = layouts[layout]
    assert format_of_folder(folder) is FORMAT[layout] and find_format(None, folder)[0] is FORMAT[layout]
    assert pq.ParquetFile(next((layouts["parquet"] / "data").glob("train-*"))).metadata.num_row_groups == 3
    for split, indices in (("train", range(TRAIN)), ("validation", range(TRAIN, TRAIN + VALIDATION))):
        records = records_in(folder, split)
        assert [records.read(i)[:2] for i in range(len(records))] == [(noise_jpeg(i), i) for i in indices]
        assert records.num_classes == len(NAMES)  # the ClassLabel's names, not the labels seen (0..30)
    names, source = class_names("imagenet", folder)
    assert names == NAMES and "ClassLabel" in source


def batches(folder: Path, *, train=True, seed=5, epoch=0, start=0, **options) -> list[list[int]]:
    options = {"batch_size": 2, "image_size": 16, "workers": 0, "seed": seed, **options}
    source = ImageNetBatches(records_in(folder, "train" if train else "validation"), train=train, **options)
    return [labels.tolist() for _, labels in source.epoch(epoch, start)]


@pytest.mark.parametrize("layout", ["parquet", "saved"])
def test_order_restore_replicas_and_workers(layouts, layout, monkeypatch):
    monkeypatch.setattr(huggingface_parquet, "WINDOW_GROUPS", 2)
    folder = layouts[layout]
    whole = batches(folder, global_batch_size=4)
    assert whole == batches(folder, global_batch_size=4) and whole != batches(folder, global_batch_size=4, epoch=1)
    seen = sum(whole, [])
    assert len(set(seen)) == len(seen) == TRAIN - TRAIN % 4 and seen != sorted(seen)
    assert batches(folder, global_batch_size=4, start=3) == whole[3:]
    parts = [sum(batches(folder, shard=(rank, 2), global_batch_size=4), []) for rank in range(2)]
    assert not set(parts[0]) & set(parts[1]) and Counter(parts[0] + parts[1]) == Counter(seen)
    for update in range(len(whole) // 2):  # each update's rows over both replicas are the one process's
        assert sorted(parts[0][update * 2:][:2] + parts[1][update * 2:][:2]) == sorted(seen[update * 4:][:4])
    assert batches(folder, workers=2) == batches(folder)
    evaluation = [sum(batches(folder, train=False, shard=(rank, 3), workers=1), []) for rank in range(3)]
    assert sorted(sum(evaluation, [])) == list(range(TRAIN, TRAIN + VALIDATION))


def test_parquet_training_reads_a_few_row_groups_at_a_time(layouts, monkeypatch):
    """The windowed order: with windows of 2 row groups (of 4 rows), each row group's rows lie within 8
    consecutive places of the epoch's order, so a worker reads each row group once, not once per row."""
    monkeypatch.setattr(huggingface_parquet, "WINDOW_GROUPS", 2)
    records = records_in(layouts["parquet"], "train")
    assert records.index.piece_count == 6  # 11 rows a file: groups of 4, 4 and 3
    for epoch in (0, 1):
        order = records.training_order(np.arange(TRAIN), seed=5, epoch=epoch)
        assert sorted(order.tolist()) == list(range(TRAIN)) and order.tolist() != list(range(TRAIN))
        groups = records.index.piece_ids[order]
        for group in range(6):
            places = np.flatnonzero(groups == group)
            assert places.max() - places.min() < 8, (epoch, group, places)
    assert not np.array_equal(records.training_order(np.arange(TRAIN), 5, 0), records.training_order(np.arange(TRAIN), 5, 1))


RESNET18 = ["--model", "resnet", "--model-size", "18", "--image-size", "48", "--micro-batch-size", "4", "--seed", "3",
            "--warmup-epochs", "0", "--device-iterations", "1", "--pipeline-num-parallel", "1"]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["parquet", "saved"])
def test_train_validate_and_restore(layouts, layout, tmp_path, capfd):
    """A run over what datasets wrote trains (40 outputs: the features' classes), validates every image once, and
    restored from its middle checkpoint ends bitwise where the whole run did."""
    whole = tmp_path / "whole"
    out = scripts.run_here(capfd, "train.py", *RESNET18, "--data-dir", str(layouts[layout]), "--epochs", "1",
                           "--ckpts-per-epoch", "2", "--logs-per-epoch", "5", "--logs-path", str(whole), cwd=tmp_path)
    assert run_folder(out.stdout) == whole
    validation = read_csv(whole / "validation.csv")
    assert [row["name"] for row in validation] == ["ckpt-2", "ckpt-5"]
    assert all(int(row["val_size"]) == VALIDATION for row in validation)
    assert torch.load(whole / "ckpt-5.pt", weights_only=True)["model"]["fc.weight"].shape[0] == len(NAMES)
    parted = tmp_path / "parted"
    shutil.copytree(whole, parted)
    for later in ("ckpt-5.pt", "validation.csv"):
        (parted / later).unlink()
    scripts.run_here(capfd, "restore.py", "--restore-path", str(parted), cwd=tmp_path)
    final = [torch.load(folder / "ckpt-5.pt", weights_only=True)["model"] for folder in (whole, parted)]
    assert final[0].keys() == final[1].keys() and all(torch.equal(final[0][k], final[1][k]) for k in final[0])


def one_batch(folder: Path, outputs: int = 1000, splits=("train", "validation")) -> None:
    check_data(None, str(folder), list(splits), TrainingBatch.of(2, 1, 1, 100), outputs=outputs, decode=True,
               size_limit=None)


def test_bad_parquet_is_one_line_before_the_run(tmp_path, layouts, capfd):
    import pyarrow as pa

    # A Hub test split without labels (-1) standing in for validation.
    unlabelled = tmp_path / "unlabelled"
    write_hub_parquet(unlabelled, "train", range(6), shards=1)
    test = hf_dataset(range(6, 9)).map(lambda row: {"label": -1})
    test.to_parquet(str(unlabelled / "data" / "test-00000-of-00001.parquet"))
    with pytest.raises(DataError, match=r"test-00000-of-00001.parquet: row 0 has label -1: no class"):
        one_batch(unlabelled)
    one_batch(unlabelled, splits=["train"])  # training alone needs no validation labels
    # A table written by pyarrow alone, without datasets' metadata: columns named image and label serve.
    plain = tmp_path / "plain"
    (plain / "data").mkdir(parents=True)
    table = pa.table({"image": [{"bytes": noise_jpeg(i), "path": None} for i in range(4)], "label": [0, 1, 2, 1]})
    pq.write_table(table, plain / "data" / "train-00000-of-00001.parquet")
    records = records_in(plain, "train")
    assert records.num_classes == 3 and records.read(2)[:2] == (noise_jpeg(2), 2)
    with pytest.raises(ConfigError, match="has 3 classes, more than the model's 2 outputs"):
        one_batch(plain, outputs=2, splits=["train"])
    pq.write_table(table.rename_columns(["picture", "label"]), plain / "data" / "train-00000-of-00001.parquet")
    with pytest.raises(DataError, match=r"no Image feature or 'image' column among its columns \(picture, label\)"):
        records_in(plain, "train")
    # A cut-short shard, through train.py: one line naming it, no run folder.
    cut = tmp_path / "cut"
    shutil.copytree(layouts["parquet"], cut)
    shard = cut / "data" / "train-00001-of-00002.parquet"
    shard.write_bytes(shard.read_bytes()[:-100])
    out = scripts.run_here(capfd, "train.py", *RESNET18, "--data-dir", str(cut), "--iterations", "1",
                           "--log-dir", str(tmp_path / "logs"), cwd=tmp_path, expect=2)
    lines = [line for line in (out.stdout + out.stderr).splitlines() if line.strip()]
    assert len(lines) == 1 and f"{shard}: not a readable Parquet file" in lines[0], lines
    assert not (tmp_path / "logs").exists()
