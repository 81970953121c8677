"""WebDataset shard sets as the `webdataset` library's own ShardWriter writes them, in the layouts users keep
(issue 71): webdataset's ImageNet example's ``-val-`` names, ``train/`` and ``val/`` folders of ``shard-%06d.tar``,
unsplit sets, a brace pattern, a glob, a ``::`` list or a single shard given as --data-dir, labels in ``.cls``,
``.json``, ``.txt`` or ``.idx``; the class count the labels hold; a member name twice in one sample refused in one
line; and the shards cnns writes read by timm's own wds reader and by the webdataset library."""

from __future__ import annotations

import io
import json
import tarfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import scripts
from cnns.data.formats import WEBDATASET, find_format, format_of_folder, records_in
from cnns.data.formats import webdataset as wds_format
from cnns.data.image_loader import ImageNetBatches
from cnns.errors import ConfigError, DataError

wds = pytest.importorskip("webdataset")

pytestmark = pytest.mark.filterwarnings("ignore:The image decoding and encoding capabilities:DeprecationWarning")

CLASSES = 4


def noise_jpeg(index: int) -> bytes:
    """A small JPEG whose pixels are a function of `index` alone."""
    array = np.random.default_rng(index).integers(0, 256, (20, 24, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def label_of(index: int) -> int:
    return index * 7 % CLASSES


def sample(index: int, label_as: str) -> dict:
    """A sample as a user hands it to ShardWriter: the label in the member `label_as` names."""
    label = label_of(index)
    item = {"__key__": f"sample{index:06d}", "jpg": noise_jpeg(index)}
    if label_as == "json":
        item["json"] = {"label": label, "filename": f"{index}.JPEG"}
    elif label_as == "txt":
        item["txt"] = str(label)
    elif label_as == "idx":
        item["idx"] = b"%d" % label  # ShardWriter has no encoder of its own for .idx: bytes go as they are
    else:
        item["cls"] = label  # ShardWriter writes an int .cls as its ASCII digits
    return item


def shard_writer(pattern: Path, indices: range, label_as: str = "cls", per_shard: int = 5) -> list[Path]:
    """Shards written by webdataset's own ShardWriter (`pattern` with a %06d)."""
    pattern.parent.mkdir(parents=True, exist_ok=True)
    with wds.ShardWriter(str(pattern), maxcount=per_shard, verbose=0) as sink:
        for index in indices:
            sink.write(sample(index, label_as))
    return sorted(pattern.parent.glob(pattern.name.replace("%06d", "*")))


TRAIN, VALIDATION = range(0, 13), range(100, 106)


def read_all(records) -> list[tuple[bytes, int]]:
    return [records.read(i)[:2] for i in range(len(records))]


def expected(indices: range) -> list[tuple[bytes, int]]:
    return [(noise_jpeg(i), label_of(i)) for i in indices]


@pytest.mark.parametrize("layout", ["val names", "split folders", "brace pattern", "glob", "list", "single shard",
                                    "unsplit folder"])
def test_shard_writer_sets_are_found_by_the_usual_conventions(tmp_path, layout):
    """Each layout's training and validation samples read back as ShardWriter wrote them, in order, and the
    classes are the labels' (4 here, not ImageNet's 1,000)."""
    root = tmp_path / "set"
    label_as = {"val names": "cls", "split folders": "json", "brace pattern": "txt", "glob": "idx"}.get(layout, "cls")
    if layout == "split folders":
        train = shard_writer(root / "train" / "shard-%06d.tar", TRAIN, label_as)
        validation = shard_writer(root / "val" / "shard-%06d.tar", VALIDATION, label_as)
    elif layout == "unsplit folder":
        train = shard_writer(root / "shards" / "shard-%06d.tar", TRAIN, label_as)
    else:
        train = shard_writer(root / "imagenet-train-%06d.tar", TRAIN, label_as)
        validation = shard_writer(root / "imagenet-val-%06d.tar", VALIDATION, label_as)
    spec, splits = str(root), {"train": TRAIN, "validation": VALIDATION}
    if layout == "brace pattern":
        assert (len(train), len(validation)) == (3, 2)  # 13 and 6 samples, 5 to a shard
        spec = f"{root}/imagenet-train-{{000000..000002}}.tar::{root}/imagenet-val-{{000000..000001}}.tar"
    elif layout == "glob":
        spec = str(root / "imagenet-*.tar")
    elif layout == "list":
        spec = "::".join(str(path) for path in train + validation)
    elif layout == "single shard":
        spec = str(train[0])
        splits = {"train": range(0, 5)}
    elif layout == "unsplit folder":  # no split word or folder: the set is whichever split is asked for
        spec = str(root / "shards")
        splits = {"train": TRAIN, "validation": TRAIN}
    assert format_of_folder(spec) is WEBDATASET and find_format(None, spec)[0] is WEBDATASET
    for split, indices in splits.items():
        assert read_all(records_in(spec, split)) == expected(indices), split
    assert WEBDATASET.classes(Path(spec)) == CLASSES
    if layout == "single shard":
        with pytest.raises(DataError, match="no WebDataset validation shards"):
            records_in(spec, "validation")


def test_a_json_label_key_other_than_label_is_the_one_info_json_declares(tmp_path):
    """timm's convention: the split's "alt_label" in the set's _info.json names the JSON key."""
    root = tmp_path / "set"
    root.mkdir()
    with wds.ShardWriter(str(root / "mine-train-%04d.tar"), maxcount=10, verbose=0) as sink:
        for index in range(6):
            sink.write({"__key__": f"{index:04d}", "jpg": noise_jpeg(index),
                        "json": {"fine": index % 3, "label": 99}})
    with pytest.raises(ConfigError):  # the default key: 99 is a class the 3-class model has not
        check(root, outputs=3)
    (root / "_info.json").write_text(json.dumps({"splits": {"train": {"alt_label": "fine"}}}))
    wds_format._cached_split.cache_clear()
    assert [label for _, label in read_all(records_in(root, "train"))] == [0, 1, 2, 0, 1, 2]
    assert WEBDATASET.classes(root) == 3


def check(spec, outputs: int, splits=("train",)) -> None:
    from cnns.data.formats import TrainingBatch, check_data

    check_data(None, str(spec), list(splits), TrainingBatch.of(2, 1, 1, 100), outputs=outputs, decode=True,
               size_limit=None)


def test_the_class_count_is_the_labels_and_num_classes_is_accepted_at_or_above_it(tmp_path):
    from cnns.cli.parsing import resolve_command_line
    from cnns.commands.checks import check_data_before_writing

    root = tmp_path / "set"
    shard_writer(root / "imagenet-train-%06d.tar", TRAIN)
    shard_writer(root / "imagenet-val-%06d.tar", VALIDATION)
    common = ["--data-dir", str(root), "--iterations", "1", "--micro-batch-size", "2"]
    run = resolve_command_line("train", common)
    assert run.config.model.num_classes == CLASSES
    check_data_before_writing(run.config)
    wider = resolve_command_line("train", [*common, "--num-classes", "10"])
    assert wider.config.model.num_classes == 10
    check_data_before_writing(wider.config)
    narrower = resolve_command_line("train", [*common, "--num-classes", "3"])
    with pytest.raises(ConfigError, match="has 4 classes, more than the model's 3 outputs"):
        check_data_before_writing(narrower.config)


def tar_of(path: Path, members: list[tuple[str, bytes]]) -> None:
    """A shard with exactly these members (ShardWriter cannot write a name twice in a sample: it takes a dict)."""
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


@pytest.mark.parametrize("twice", ["jpg", "cls"])
def test_a_member_name_twice_in_a_sample_is_one_line_naming_the_sample(tmp_path, capfd, twice):
    """webdataset's group_by_keys refuses it; so does cnns, before the run folder, in one line."""
    root = tmp_path / "set"
    root.mkdir()
    members = [(f"{i:04d}.{ext}", noise_jpeg(i) if ext == "jpg" else b"%d" % (i % 2)) for i in range(6)
               for ext in ("jpg", "cls")]
    members.insert(7, ("0003.jpg", noise_jpeg(50)) if twice == "jpg" else ("0003.cls", b"1"))
    tar_of(root / "x-train-0000.tar", members)
    with pytest.raises(ValueError, match="duplicate file name"):  # the webdataset library's own verdict
        list(wds.WebDataset(str(root / "x-train-0000.tar"), shardshuffle=False))
    out = scripts.run_here(capfd, "train.py", "--data-dir", str(root), "--iterations", "1", "--micro-batch-size",
                           "2", "--image-size", "32", "--no-validation", "--log-dir", str(tmp_path / "logs"),
                           cwd=tmp_path, expect=2)
    lines = [line for line in (out.stdout + out.stderr).splitlines() if line.strip()]
    assert len(lines) == 1 and f"x-train-0000.tar: sample 0003 holds 0003.{twice} twice" in lines[0], lines
    assert not (tmp_path / "logs").exists()


def batches(spec, *, train=True, seed=5, epoch=0, start=0, **options) -> list:
    options = {"batch_size": 2, "image_size": 16, "workers": 0, "seed": seed, **options}
    source = ImageNetBatches(records_in(spec, "train" if train else "validation"), train=train, **options)
    return [labels.clone() for _, labels in source.epoch(epoch, start)]


def test_order_restore_replicas_and_workers_over_a_brace_pattern(tmp_path, monkeypatch):
    """Over ShardWriter's shards named by a brace pattern: the order a function of (seed, epoch), a resumed epoch
    continuing at the same sample, replicas disjoint and covering one process's samples, workers the same batches."""
    monkeypatch.setattr(wds_format, "SHUFFLE_BUFFER", 4)
    root = tmp_path / "set"
    root.mkdir()
    with wds.ShardWriter(str(root / "x-train-%04d.tar"), maxcount=5, verbose=0) as sink:
        for index in range(17):  # each sample its own class, so the labels name the samples
            sink.write({"__key__": f"{index:04d}", "jpg": noise_jpeg(index), "cls": index})
    spec = str(root / "x-train-{0000..0003}.tar")
    whole = batches(spec, global_batch_size=4)
    assert [b.tolist() for b in whole] == [b.tolist() for b in batches(spec, global_batch_size=4)]
    assert [b.tolist() for b in whole] != [b.tolist() for b in batches(spec, global_batch_size=4, epoch=1)]
    assert [b.tolist() for b in batches(spec, global_batch_size=4, start=3)] == [b.tolist() for b in whole[3:]]
    one = [int(x) for b in whole for x in b]
    parts = [[int(x) for b in batches(spec, shard=(rank, 2), batch_size=2, global_batch_size=4) for x in b]
             for rank in range(2)]
    assert not set(parts[0]) & set(parts[1]) and Counter(parts[0] + parts[1]) == Counter(one)
    assert [b.tolist() for b in batches(spec, workers=2)] == [b.tolist() for b in batches(spec)]


def test_shards_cnns_writes_are_read_by_timm_and_the_webdataset_library(tmp_path):
    from timm.data import create_dataset

    from cnns.data.jpegtree import make_jpeg_tree

    make_jpeg_tree(tmp_path, images=7, classes=3, validation_images=4, processes=1, layout="webdataset")
    for split in ("train", "validation"):
        ours = read_all(records_in(tmp_path, split))
        by_timm = create_dataset("wds/cnns", root=str(tmp_path), split=split, is_training=False, batch_size=1)
        assert [int(target) for _, target in by_timm] == [label for _, label in ours]
        by_wds = wds.WebDataset(str(tmp_path / f"imagenet1k-{split}-0000.tar"), shardshuffle=False)
        assert [(item["jpg"], int(item["cls"])) for item in by_wds] == ours
    info = json.loads((tmp_path / "_info.json").read_text())
    assert info["splits"]["train"]["num_samples"] == 7 and info["num_classes"] == 3
    assert torch.equal(torch.tensor(info["splits"]["validation"]["shard_lengths"]), torch.tensor([4]))
