"""ImageNet end to end through train.py, on TFRecords and a JPEG tree written here (the TFRecords
by test_tfrecord's writers, from the format definition, not by the reader under test), plus the
8-bit I/O equivalence and the evaluation cache."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import scripts
from test_tfrecord import imagenet_example, write_tfrecord
from test_training import read_csv, run_folder
from cnns.data.formats import records_in

pytestmark = pytest.mark.filterwarnings("ignore:The image decoding and encoding capabilities:DeprecationWarning")

VALIDATION_PER_CLASS = (5, 4, 4)  # 13 images: no batch size of 2 or more divides them
TRAIN_PER_CLASS = 4


def picture(index: int, mode: str = "RGB") -> Image.Image:
    """A small image whose colour depends on its class (index % 3), with noise on top."""
    rng = np.random.default_rng(index)
    base = np.array([(200, 40, 40), (40, 200, 40), (40, 40, 200)][index % 3], dtype=np.int16)
    pixels = np.clip(base + rng.integers(-40, 40, (40, 48, 3)), 0, 255).astype(np.uint8)
    return Image.fromarray(pixels).convert(mode)


def encoded(image: Image.Image, file_format: str = "JPEG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, file_format)
    return buffer.getvalue()


def odd_file(index: int) -> bytes:
    """Real ImageNet's awkward files, in turn: grayscale JPEG, CMYK JPEG, PNG bytes named .JPEG, RGB JPEG."""
    kind = index % 4
    if kind == 0:
        return encoded(picture(index, "L"))
    if kind == 1:
        return encoded(picture(index, "CMYK"))
    if kind == 2:
        return encoded(picture(index), "PNG")
    return encoded(picture(index))


@pytest.fixture(scope="module")
def jpeg_tree(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("imagenet-tree")
    index = 0
    for split, per_class in (("train", (TRAIN_PER_CLASS,) * 3), ("validation", VALIDATION_PER_CLASS)):
        for label, count in enumerate(per_class):
            folder = root / split / f"n{label:08d}"
            folder.mkdir(parents=True)
            for item in range(count):
                (folder / f"{split}_{item}.JPEG").write_bytes(odd_file(index))
                index += 1
    return root


@pytest.fixture(scope="module")
def tfrecords(tmp_path_factory) -> Path:
    """Two training shards of 6 records and two validation shards of 7 and 6 (1-based labels)."""
    root = tmp_path_factory.mktemp("imagenet-tfrecords")
    records = [imagenet_example(encoded(picture(i)), i % 3 + 1) for i in range(25)]
    write_tfrecord(root / "train-00000-of-00002", records[:6])
    write_tfrecord(root / "train-00001-of-00002", records[6:12])
    write_tfrecord(root / "validation-00000-of-00002", records[12:19])
    write_tfrecord(root / "validation-00001-of-00002", records[19:])
    return root


RESNET18_64PX = ["--model", "resnet", "--model-size", "18", "--dataset", "imagenet", "--image-size", "64",
                 "--iterations", "3", "--micro-batch-size", "4", "--log-freq", "1", "--seed", "3"]


def test_train_from_tfrecords_validates_every_checkpoint_on_all_13_images(tfrecords, tmp_path, capfd):
    # 12 training images in batches of 4: one epoch is 3 iterations, so 3 checkpoints per epoch
    # puts one after every update; their validations after the first come from the dataset cache.
    out = scripts.run_here(capfd, "train.py", *RESNET18_64PX, "--data-dir", str(tfrecords), "--ckpts-per-epoch", "3",
                           "--hostside-norm", "--normalise-input", "--log-dir", str(tmp_path / "logs"), cwd=tmp_path)
    folder = run_folder(out.stdout)
    assert [int(r["iteration"]) for r in read_csv(folder / "training.csv")] == [1, 2, 3]
    validation = read_csv(folder / "validation.csv")
    assert [r["name"] for r in validation] == ["ckpt-1", "ckpt-2", "ckpt-3"]
    assert all(int(r["val_size"]) == 13 for r in validation)
    options = json.loads((folder / "arguments.json").read_text())
    assert options["hostside_norm"] and options["normalise_input"]


def test_train_from_a_jpeg_tree_with_the_data_options(jpeg_tree, tmp_path, capfd):
    out = scripts.run_here(capfd, "train.py", *RESNET18_64PX, "--data-dir", str(jpeg_tree), "--eight-bit-io",
                           "--dataset-percentage-to-use", "50", "--no-dataset-cache", "--pipeline-num-parallel", "1",
                           "--log-dir", str(tmp_path / "logs"), cwd=tmp_path)
    folder = run_folder(out.stdout)
    rows = read_csv(folder / "training.csv")
    # 50 % of each class: 2 x 3 = 6 images, so 3 updates of 4 are 2 epochs.
    assert int(rows[-1]["iteration"]) == 3 and float(rows[-1]["epoch"]) == pytest.approx(2.0)
    validation = read_csv(folder / "validation.csv")
    assert validation and all(int(r["val_size"]) == sum(VALIDATION_PER_CLASS) for r in validation)
    options = json.loads((folder / "arguments.json").read_text())
    assert options["eight_bit_io"] and options["dataset_cache"] is False
    assert options["pipeline_num_parallel"] == 1


@pytest.mark.parametrize("workers", [0, 2])
def test_pipeline_num_parallel_is_the_number_of_processes_that_decode(jpeg_tree, tmp_path, monkeypatch, workers):
    import os

    from cnns.cli import run_script as run_command
    from cnns.data.image_loader import ImageNetTransform

    # Every decode appends its process id to a file; DataLoader workers are forked, so they run the
    # patched transform too (a one-line append is atomic between processes).
    decoders = tmp_path / "decoders.txt"
    into = ImageNetTransform.into

    def decode(self, data, source, key, out):
        with open(decoders, "a") as f:
            f.write(f"{os.getpid()}\n")
        return into(self, data, source, key, out)

    monkeypatch.setattr(ImageNetTransform, "into", decode)
    assert run_command("train", [*RESNET18_64PX, "--data-dir", str(jpeg_tree), "--micro-batch-size", "2",
                                 "--iterations", "6", "--pipeline-num-parallel", str(workers), "--no-validation",
                                 "--logs-path", str(tmp_path / "run")]) == 0
    pids = decoders.read_text().split()
    assert len(pids) == 6 * 2  # every training image of the 6 updates decoded once
    if workers == 0:
        assert set(pids) == {str(os.getpid())}  # in the training process itself
    else:
        assert len(set(pids)) == workers and str(os.getpid()) not in pids  # shared by the workers


def test_dataset_benchmark_runs_the_pipeline_alone(jpeg_tree, tmp_path, capfd):
    out = scripts.run_here(capfd, "train.py", "--dataset", "imagenet", "--data-dir", str(jpeg_tree), "--image-size",
                           "48", "--micro-batch-size", "2", "--iterations", "5", "--pipeline-num-parallel", "0",
                           "--dataset-benchmark", cwd=tmp_path)
    assert "Dataset benchmark: " in out.stdout and " images/sec (" in out.stdout
    assert "Total Parameters" not in out.stdout  # no model
    assert not (tmp_path / "logs").exists()  # no run folder


# ---------------------------------------------------------------------------------------------
# 8-bit I/O and the evaluation cache
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, dict(atol=1 / 255, rtol=0)),
                                               (torch.bfloat16, dict(atol=1e-6, rtol=4e-3))])
@pytest.mark.parametrize("imagenet_std", [False, True])
def test_uint8_normalised_on_device_equals_float_normalised_on_host(dtype, tolerance, imagenet_std):
    from torchvision.transforms import v2

    from cnns.data.augment import IMAGENET_MEAN, IMAGENET_STD
    from cnns.engine.feed import DeviceFeed

    images = torch.randint(0, 256, (3, 20, 24, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([1, 2, 3])
    # The float pipeline a user of Graphcore's application would write: scale to [0, 1], then torchvision's Normalize.
    std = IMAGENET_STD if imagenet_std else (1.0, 1.0, 1.0)
    reference = v2.Normalize(IMAGENET_MEAN, std)(images.permute(0, 3, 1, 2).float() / 255)
    outputs = {}
    for host in (False, True):
        feed = DeviceFeed(torch.device("cpu"), dtype, imagenet_normalisation=imagenet_std, host_normalisation=host)
        outputs[host], out_labels = feed.to_device(images, labels)
        assert outputs[host].dtype == dtype and outputs[host].shape == (3, 3, 20, 24)
        assert outputs[host].is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(out_labels, labels)
        torch.testing.assert_close(outputs[host].float(), reference, **tolerance)
    torch.testing.assert_close(outputs[False].float(), outputs[True].float(), **tolerance)


@pytest.mark.parametrize("cache", [True, False])
def test_evaluation_cache_replays_the_first_complete_pass(jpeg_tree, cache):
    from cnns.data.image_loader import ImageNetBatches

    source = ImageNetBatches(records_in(jpeg_tree, "validation"), train=False, batch_size=4, image_size=16, workers=0, cache=cache)
    partial = next(source.epoch(0))  # an interrupted pass is not kept
    first = [(images.clone(), labels.clone()) for images, labels in source.epoch(0)]
    assert sum(len(labels) for _, labels in first) == 13 and torch.equal(partial[0], first[0][0])
    reads = []
    source.loader.dataset.transform.into = lambda data, name, key, out: reads.append(name)
    again = list(source.epoch(0))
    resumed = list(source.epoch(0, start_batch=2))
    if cache:
        assert reads == []  # nothing decoded again
        assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(first, again))
        assert all(torch.equal(a[0], b[0]) for a, b in zip(first[2:], resumed))
    else:
        assert len(reads) == 13 + 13 - 8
    assert len(again) == len(first) == len(source) == 4 and len(resumed) == 2


def test_dataset_is_recognised_from_folder_contents_whatever_its_name(tmp_path):
    from cnns.cli import resolved_training_options

    folder = tmp_path / "my-photos"
    for cls in ("a", "b"):
        (folder / "train" / cls).mkdir(parents=True)
        (folder / "train" / cls / "x.JPEG").write_bytes(b"")
    options, _ = resolved_training_options("train", ["--data-dir", str(folder)])
    assert (options["dataset"], options["model_size"], options["group_norm"]) == ("imagenet", "18", True)


# ---------------------------------------------------------------------------------------------
# The class count from the data


RESNET18_3_CLASSES = 11_689_512 - 997 * (512 + 1)  # resnet18's classifier with 3 outputs instead of 1,000


def test_a_folder_tree_gives_the_model_as_many_outputs_as_it_has_classes(jpeg_tree, tmp_path, capfd):
    out = scripts.run_here(capfd, "train.py", *RESNET18_64PX, "--data-dir", str(jpeg_tree), "--log-dir",
                           str(tmp_path / "logs"), cwd=tmp_path)
    assert f"Total Parameters:{RESNET18_3_CLASSES}\n" in out.stdout
    folder = run_folder(out.stdout)
    assert json.loads((folder / "arguments.json").read_text())["num_classes"] == 3
    state = torch.load(folder / "ckpt-3.pt", weights_only=True)["model"]
    assert state["fc.weight"].shape == (3, 512)
    # Every later command rebuilds the same model from arguments.json (a 1,000-class model would not load).
    validation = read_csv(folder / "validation.csv")
    assert validation and int(validation[-1]["val_size"]) == sum(VALIDATION_PER_CLASS)
    again = scripts.run_here(capfd, "validation.py", "--restore-path", str(folder / "ckpt-3.pt"), cwd=tmp_path)
    assert f"Total Parameters:{RESNET18_3_CLASSES}\n" in again.stdout


def test_num_classes_overrides_the_data_and_may_not_fall_below_it(jpeg_tree, tmp_path, capsys):
    from cnns.cli import resolved_training_options
    from cnns.cli import run_script as run_command

    five = [*RESNET18_64PX, "--data-dir", str(jpeg_tree), "--num-classes", "5"]
    options, _ = resolved_training_options("train", five)
    assert options["num_classes"] == 5
    # More outputs than the data's classes train (mixup's soft targets have the model's 5 columns).
    assert run_command("train", [*five, "--mixup-alpha", "0.2", "--iterations", "1", "--no-validation",
                                 "--logs-path", str(tmp_path / "five")]) == 0
    assert torch.load(tmp_path / "five" / "ckpt-1.pt", weights_only=True)["model"]["fc.weight"].shape == (5, 512)
    capsys.readouterr()
    assert run_command("train", [*RESNET18_64PX, "--data-dir", str(jpeg_tree), "--num-classes", "2",
                                 "--logs-path", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err.strip() == (f"error: the data in {jpeg_tree} has 3 classes, more than the model's "
                                               "2 outputs (--num-classes 2)")
    assert not (tmp_path / "run").exists()  # nothing written


def test_a_validation_folder_with_other_classes_is_one_line_naming_them(jpeg_tree, tmp_path, capsys):
    import shutil

    from cnns.cli import run_script as run_command

    tree = tmp_path / "tree"
    shutil.copytree(jpeg_tree, tree)
    (tree / "validation" / "n00000002").rename(tree / "validation" / "n00000007")
    assert run_command("train", [*RESNET18_64PX, "--data-dir", str(tree), "--logs-path", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: {tree}: the validation folder's classes differ from the training folder's "
        "(n00000007 only in validation; n00000002 only in training)")
    assert not (tmp_path / "run").exists()
