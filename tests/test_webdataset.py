"""ImageNet as WebDataset tar shards, made here by GNU tar (a tool cnns does not contain), in both member layouts
(timm/imagenet-1k-wds's ``n01440764_00003.jpg`` + ``.cls`` + ``.json``, and plain ``0003.jpg`` + ``0003.cls``):
read with the same transforms and decoder as the other layouts, a fixed seed giving the same batches, a resumed
epoch continuing at the same sample, replicas and workers taking disjoint samples that cover the epoch, and every
damaged shard named in one line before a run folder is written."""

from __future__ import annotations

import io
import shutil
import subprocess
import tarfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import scripts
from cnns.data.formats import WEBDATASET, find_format, format_of_folder, records_in
from cnns.data.formats import webdataset as wds
from cnns.data.image_loader import ImageNetBatches
from cnns.errors import DataError
from test_training import read_csv, run_folder

pytestmark = [pytest.mark.filterwarnings("ignore:The image decoding and encoding capabilities:DeprecationWarning"),
              pytest.mark.skipif(shutil.which("tar") is None, reason="GNU tar makes the shards")]

TRAIN, VALIDATION = 26, 11  # no multiple of any batch here
PER_SHARD = 8  # 26 = 8 + 8 + 8 + 2: the last shard short, as real shard sets end


def noise_jpeg(index: int) -> bytes:
    """A JPEG whose pixels are a function of `index` alone (its sample's identity, with its label)."""
    array = np.random.default_rng(index).integers(0, 256, (20, 24, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, "JPEG", quality=95)
    return buffer.getvalue()


def gnu_tar(shard: Path, members: dict[str, bytes]) -> None:
    """A shard holding `members` in the given order, written by GNU tar from a scratch folder."""
    scratch = shard.parent / f".{shard.name}.members"
    scratch.mkdir()
    for name, data in members.items():
        (scratch / name).write_bytes(data)
    subprocess.run(["tar", "--format=gnu", "-cf", str(shard), "-C", str(scratch), *members], check=True, timeout=60)
    shutil.rmtree(scratch)


def sample_members(index: int, label: int, timm_names: bool) -> dict[str, bytes]:
    if timm_names:  # timm/imagenet-1k-wds: the synset and image number as the key, with metadata beside
        key = f"n{label:08d}_{index:05d}"
        return {f"{key}.cls": b"%d" % label, f"{key}.jpg": noise_jpeg(index),
                f"{key}.json": b'{"filename": "%s.JPEG"}' % key.encode()}
    key = f"{index:04d}"
    return {f"{key}.jpg": noise_jpeg(index), f"{key}.cls": b"%d\n" % label}


def write_shards(root: Path, split: str, count: int, first: int = 0, prefix: str = "imagenet1k-",
                 timm_names: bool = True, label=lambda index: index) -> None:
    """`count` samples from index `first`, PER_SHARD to a shard; label `label(index)` (by default the index
    itself, so that a batch's labels name its samples)."""
    root.mkdir(parents=True, exist_ok=True)
    for shard, start in enumerate(range(first, first + count, PER_SHARD)):
        members: dict[str, bytes] = {}
        for index in range(start, min(start + PER_SHARD, first + count)):
            members.update(sample_members(index, label(index), timm_names))
        gnu_tar(root / f"{prefix}{split}-{shard:04d}.tar", members)


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("imagenet-wds")
    write_shards(root, "train", TRAIN)
    write_shards(root, "validation", VALIDATION, first=TRAIN, timm_names=False)  # plain NNNN.jpg + NNNN.cls
    return root


def batches(root: Path, *, train: bool = True, seed: int = 5, epoch: int = 0, start: int = 0, **options) -> list:
    options = {"batch_size": 4, "image_size": 16, "workers": 0, "seed": seed, **options}
    source = ImageNetBatches(records_in(root, "train" if train else "validation"), train=train, **options)
    return [(images.clone(), labels.clone()) for images, labels in source.epoch(epoch, start)]


def labels_of(found: list) -> list[int]:
    return [int(label) for _, labels in found for label in labels]


def test_gnu_tar_shards_are_recognised_and_read_as_written(shards):
    assert format_of_folder(shards) is WEBDATASET and find_format("imagenet", shards)[0] is WEBDATASET
    train, validation = records_in(shards, "train"), records_in(shards, "validation")
    # the classes the labels hold: here each sample its own, 0..36
    assert (len(train), len(validation), train.num_classes) == (TRAIN, VALIDATION, TRAIN + VALIDATION)
    data, label, source = train.read(9)  # the second shard's second sample
    assert (data, label) == (noise_jpeg(9), 9)
    assert source == f"{shards / 'imagenet1k-train-0001.tar'}: member n00000009_00009.jpg"
    assert [validation.read(i)[:2] for i in (0, 10)] == [(noise_jpeg(TRAIN), TRAIN), (noise_jpeg(36), 36)]


def test_a_fixed_seed_gives_the_same_batches_and_each_epoch_every_sample_once(shards):
    first, again = batches(shards), batches(shards)
    assert len(first) == TRAIN // 4
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(first, again, strict=True))
    seen = labels_of(first)
    assert len(set(seen)) == len(seen) == TRAIN - TRAIN % 4  # whole batches: a remainder of 2 left out
    other_epoch, other_seed = labels_of(batches(shards, epoch=1)), labels_of(batches(shards, seed=6))
    assert seen != other_epoch and seen != other_seed and sorted(seen) != seen


def test_the_shuffle_buffer_keeps_reads_near_the_stream(shards, monkeypatch):
    """With a buffer smaller than the set, a sample comes out at most buffer + its shard's place in the stream
    ahead of where it went in: reads stay within a few shards instead of anywhere."""
    monkeypatch.setattr(wds, "SHUFFLE_BUFFER", 4)
    records = records_in(shards, "train")
    order = records.training_order(np.arange(TRAIN), seed=5, epoch=0)
    assert sorted(order.tolist()) == list(range(TRAIN))  # a permutation: every sample once
    shard_of = records.shard_ids[order]
    # the first 8 come from at most the first two shards of the epoch's shard order (a buffer of 4 spans them)
    assert len(set(shard_of[:PER_SHARD - 4].tolist())) == 1 and len(set(shard_of[:PER_SHARD].tolist())) <= 2
    assert order.tolist() == records.training_order(np.arange(TRAIN), seed=5, epoch=0).tolist()


def test_a_resumed_epoch_continues_at_the_same_sample(shards, monkeypatch):
    monkeypatch.setattr(wds, "SHUFFLE_BUFFER", 4)
    whole = batches(shards, epoch=2)
    for start in (1, 3):
        resumed = batches(shards, epoch=2, start=start)
        assert labels_of(resumed) == labels_of(whole[start:])
        assert all(torch.equal(a[0], b[0]) for a, b in zip(resumed, whole[start:], strict=True))


def test_replicas_and_workers_take_disjoint_samples_that_cover_the_epoch(shards, monkeypatch):
    monkeypatch.setattr(wds, "SHUFFLE_BUFFER", 4)
    one = labels_of(batches(shards, global_batch_size=8))  # 3 updates of 8: 24 of the 26
    parts = [labels_of(batches(shards, shard=(rank, 2), global_batch_size=8)) for rank in range(2)]
    assert not set(parts[0]) & set(parts[1]) and Counter(parts[0] + parts[1]) == Counter(one)
    for update in range(3):  # each update's samples over both replicas are the one process's
        assert sorted(parts[0][update * 4:][:4] + parts[1][update * 4:][:4]) == sorted(one[update * 8:][:8])
    with_workers = batches(shards, workers=2)  # each worker makes whole batches: the same batches, in order
    assert [labels.tolist() for _, labels in with_workers] == [labels.tolist() for _, labels in batches(shards)]
    evaluation = [labels_of(batches(shards, train=False, shard=(rank, 3), workers=1)) for rank in range(3)]
    assert sorted(sum(evaluation, [])) == list(range(TRAIN, TRAIN + VALIDATION))  # every image once


def test_make_jpeg_tree_writes_shards_the_format_reads(tmp_path):
    from cnns.data.jpegtree import make_jpeg_tree

    made = make_jpeg_tree(tmp_path, images=6, classes=3, validation_images=3, processes=1, layout="webdataset")
    assert (made["train"], made["validation"]) == (6, 3)
    records = records_in(tmp_path, "train")
    assert sorted(records.read(i)[1] for i in range(len(records))) == [0, 0, 1, 1, 2, 2]
    with tarfile.open(next(tmp_path.glob("*-train-*.tar"))) as tar:  # the standard layout, member by member
        assert [member.name.rpartition(".")[2] for member in tar][:2] == ["jpg", "cls"]


RESNET18 = ["--model", "resnet", "--model-size", "18", "--dataset", "imagenet", "--image-size", "48",
            "--micro-batch-size", "4", "--seed", "3", "--warmup-epochs", "0", "--device-iterations", "1"]


def test_train_validate_and_restore_over_shards(shards, tmp_path, capfd, monkeypatch):
    """A run over GNU tar's shards trains and validates every image once; restored from its middle checkpoint,
    it ends bitwise where the whole run did (the restored epoch continues at the same sample)."""
    monkeypatch.setattr(wds, "SHUFFLE_BUFFER", 4)
    whole = tmp_path / "whole"
    out = scripts.run_here(capfd, "train.py", *RESNET18, "--data-dir", str(shards), "--epochs", "1",
                           "--ckpts-per-epoch", "3", "--logs-per-epoch", "6", "--pipeline-num-parallel", "1",
                           "--logs-path", str(whole), cwd=tmp_path)
    assert run_folder(out.stdout) == whole
    assert [int(row["iteration"]) for row in read_csv(whole / "training.csv")] == [1, 2, 3, 4, 5, 6]
    validation = read_csv(whole / "validation.csv")
    assert [row["name"] for row in validation] == ["ckpt-2", "ckpt-4", "ckpt-6"]
    assert all(int(row["val_size"]) == VALIDATION for row in validation)

    parted = tmp_path / "parted"
    shutil.copytree(whole, parted)
    for later in ("ckpt-4.pt", "ckpt-6.pt", "validation.csv"):
        (parted / later).unlink()
    scripts.run_here(capfd, "restore.py", "--restore-path", str(parted), cwd=tmp_path)
    final = [torch.load(folder / "ckpt-6.pt", weights_only=True)["model"] for folder in (whole, parted)]
    assert final[0].keys() == final[1].keys() and all(torch.equal(final[0][k], final[1][k]) for k in final[0])


def damaged(root: Path, damage: str) -> str:
    """A copy of a small shard set with one kind of damage in its second training shard; the member named."""
    write_shards(root, "train", 16)
    write_shards(root, "validation", 4, first=16, timm_names=False)
    shard = root / "imagenet1k-train-0001.tar"
    if damage == "cut short":
        data = shard.read_bytes()
        shard.write_bytes(data[:data.index(noise_jpeg(10)) + 100])  # in the middle of sample 10's image
        return f"{shard}: cut short: member n00000010_00010.jpg runs past the end"
    if damage == "no label":
        members = {name: data for i in range(8, 16) for name, data in sample_members(i, i, True).items()}
        del members["n00000012_00012.cls"]
        shard.unlink()
        gnu_tar(shard, members)
        return (f"{shard}: member n00000012_00012.jpg has no label (n00000012_00012.cls, n00000012_00012.json's "
                "'label', n00000012_00012.txt or n00000012_00012.idx)")
    if damage == "negative label":  # timm's sets mark a sample without a class -1
        shard.unlink()
        write_shards(root, "train", 8, first=8, label=lambda index: -1 if index == 13 else index)
        (root / "imagenet1k-train-0000.tar").rename(shard)
        write_shards(root, "train", 8)  # the first shard again, as it was
        return f"{shard}: member n-0000001_00013.cls holds class -1: classes are numbered from 0"
    assert damage == "corrupt header"
    data = bytearray(shard.read_bytes())
    header = data.index(b"n00000011_00011.cls")  # the checksum no longer matches the header
    data[header + 1] ^= 0xFF
    shard.write_bytes(bytes(data))
    return f"{shard}: not a readable tar file"


@pytest.mark.parametrize("damage", ["cut short", "no label", "negative label", "corrupt header"])
def test_a_damaged_shard_is_one_line_naming_it_and_no_run_folder(tmp_path, capfd, damage):
    expected = damaged(tmp_path / "data", damage)
    out = scripts.run_here(capfd, "train.py", *RESNET18, "--data-dir", str(tmp_path / "data"), "--iterations", "1",
                           "--log-dir", str(tmp_path / "logs"), cwd=tmp_path, expect=2)
    lines = [line for line in (out.stdout + out.stderr).splitlines() if line.strip()]
    assert len(lines) == 1 and expected in lines[0], out.stdout + out.stderr
    assert not (tmp_path / "logs").exists()


def test_indexing_processes_give_the_threads_index_and_their_errors_one_line(tmp_path, monkeypatch):
    """A large set is indexed by processes: the same index, and a damaged shard's line crosses back whole."""
    root = tmp_path / "data"
    write_shards(root, "train", 20)
    shards = wds.find_shards(root, "train")
    by_threads = wds._index_each([str(path) for path in shards])
    monkeypatch.setattr(wds, "INDEX_PROCESSES_FROM", 1)
    monkeypatch.setattr(wds.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    by_processes = wds._index_each([str(path) for path in shards])
    assert len(by_processes) == 3 and all(
        np.array_equal(getattr(a, field), getattr(b, field)) for a, b in zip(by_threads, by_processes, strict=True)
        for field in wds.INDEX_FIELDS)
    expected = damaged(tmp_path / "bad", "no label")
    with pytest.raises(DataError) as error:
        wds._index_each([str(path) for path in wds.find_shards(tmp_path / "bad", "train")])
    assert str(error.value) == expected
