"""Bad input through the real root scripts (SPEC 8): each ends with exit code 2 and exactly one line on
stderr naming the problem and the file, option or value, never a traceback; a run folder given to
validation.py or restore.py is left byte for byte as it was.

Cases that tests/test_cli.py, test_validation.py and test_data_cifar.py already run are not repeated
here (an unknown config name, a missing CIFAR folder, a truncated or pickled checkpoint run in-process,
another model's checkpoint to validation.py).

A new interpreter is slow to start (train.py imports torch and the engine before parsing), so the cases
run the script's command in this process (tests/scripts.py: through cnns.cli.run_script, what the root scripts
call), with stdout and stderr captured at the file-descriptor level, so that a C library's message, or one from
a DataLoader worker (forked from this process, it writes to the same descriptors), would still show. Only the
read-only folder runs the root script in a subprocess: as root, that process is started without the capability
to write anywhere.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import processes
import scripts
import torch

from cnns.data.formats import records_in
from cnns.errors import DataError

from test_tfrecord import bytes_feature, colour_jpeg, colour_of, example, frame, imagenet_example

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 180
CIFAR_RUN = ["--dataset", "cifar-10", "--model-size", "8", "--micro-batch-size", "4", "--iterations", "1",
             "--no-validation"]
# 64 px: at 32 px and below the models take their CIFAR form, which has no ResNet-18.
IMAGENET_RUN = ["--dataset", "imagenet", "--model-size", "18", "--image-size", "64", "--micro-batch-size", "2",
                "--iterations", "1", "--pipeline-num-parallel", "1", "--seed", "1"]


def assert_one_line_error(out: subprocess.CompletedProcess, *fragments: str) -> str:
    """Exit code 2 and one stderr line `error: ...` (`<script>: error: ...` from the argument parser)
    holding every fragment."""
    shown = f"exit {out.returncode}\nstdout: {out.stdout[-1500:]}\nstderr: {out.stderr[-3000:]}"
    assert out.returncode == 2, shown
    assert "Traceback" not in out.stderr, shown
    lines = out.stderr.splitlines()
    assert len(lines) == 1, shown
    line = lines[0]
    assert line.startswith("error: ") or line.split(": ", 1)[-1].startswith("error: "), shown
    for fragment in fragments:
        assert fragment in line, shown
    return line


def digest(folder: Path) -> dict[str, str]:
    """Every file under a folder, by relative path, with a hash of its bytes."""
    return {str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(folder.rglob("*")) if path.is_file()}


# ---------------------------------------------------------------------------------------------
# CIFAR files and data folders
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cifar(shapes_cifar10) -> Path:
    return shapes_cifar10("bad-input", train=30, test=10, seed=3)


def copy_of(folder: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(folder, tmp_path / folder.name))


def test_truncated_cifar_file(cifar, tmp_path, capfd):
    data = copy_of(cifar, tmp_path)
    path = data / "data_batch_3.bin"
    path.write_bytes(path.read_bytes()[:-1000])
    out = scripts.run_here(capfd, "train.py", *CIFAR_RUN, "--data-dir", str(data), cwd=tmp_path, expect=2)
    assert_one_line_error(out, str(path), "truncated", "3073-byte record")


def test_cifar_file_of_the_wrong_record_size(cifar, tmp_path, capfd):
    data = copy_of(cifar, tmp_path)
    path = data / "data_batch_2.bin"
    path.write_bytes(bytes(3074 * 6))  # six CIFAR-100 records in a CIFAR-10 folder
    out = scripts.run_here(capfd, "train.py", *CIFAR_RUN, "--data-dir", str(data), cwd=tmp_path, expect=2)
    assert_one_line_error(out, str(path), "not a multiple of the 3073-byte record")


@pytest.mark.parametrize("dataset, message", [
    (None, "cannot infer the dataset in {folder}; name it with --dataset"),
    ("cifar-10", "no cifar-10 binary files found in {folder}"),
    ("imagenet", "no imagenet files found in {folder}: expected TFRecords (train-*-of-*), WebDataset shards "
                 "(*.tar), Hugging Face Parquet shards (data/train-*.parquet), a Hugging Face save_to_disk folder "
                 "(dataset_dict.json, train/state.json) or JPEG folders (train/<class>/)"),
])
def test_empty_data_folder(tmp_path, capfd, dataset, message):
    folder = tmp_path / "empty"
    folder.mkdir()
    out = scripts.run_here(capfd, "train.py", "--data-dir", str(folder), *(["--dataset", dataset] if dataset else []),
                           "--iterations", "1", cwd=tmp_path, expect=2)
    assert_one_line_error(out, message.format(folder=folder))
    assert not (tmp_path / "logs").exists()


@pytest.mark.parametrize("dataset", [None, "imagenet"])
def test_missing_data_folder(tmp_path, capfd, dataset):
    folder = tmp_path / "no-such-folder"
    out = scripts.run_here(capfd, "train.py", "--data-dir", str(folder), *(["--dataset", dataset] if dataset else []),
                           "--iterations", "1", cwd=tmp_path, expect=2)
    assert_one_line_error(out, f"data folder not found: {folder}")
    assert not (tmp_path / "logs").exists()


# ---------------------------------------------------------------------------------------------
# Unknown names and contradictory options
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, fragments", [
    (["--dataset", "cifar-11"], ["--dataset", "'cifar-11'"]),
    (["--model", "vgg"], ["--model", "'vgg'"]),
    (["--dataset", "cifar-10", "--model-size", "7"], ["7"]),
    (["--dataset", "imagenet", "--model", "efficientnet", "--model-size", "B9"], ["B9"]),
    (["--optimiser", "adam"], ["--optimiser", "'adam'"]),
    # Two spellings of one option, two ways of giving one length or one checkpoint interval.
    (["--dataset", "cifar-10", "--batch-size", "8", "--micro-batch-size", "16"], ["--batch-size", "--micro-batch-size"]),
    (["--dataset", "cifar-10", "--batch-size", "8", "--micro-batch-size", "8"], ["--batch-size", "--micro-batch-size"]),
    (["--dataset", "cifar-10", "--epochs", "1", "--iterations", "5"], ["--epochs", "--iterations"]),
    (["--dataset", "cifar-10", "--epoch", "1", "--iterations", "5"], ["--epoch", "--iterations"]),
    (["--dataset", "cifar-10", "--epochs-per-ckpt", "2", "--ckpts-per-epoch", "4"],
     ["--epochs-per-ckpt", "--ckpts-per-epoch"]),
    (["--dataset", "cifar-10", "--epochs-per-ckpt", "2", "--ckpts-per-epoch", "1"],
     ["--epochs-per-ckpt", "--ckpts-per-epoch"]),
    (["--dataset", "cifar-10", "--epochs", "nan"], ["--epochs must be a finite number, got nan"]),
    (["--dataset", "cifar-10", "--abs-learning-rate", "0"], ["--abs-learning-rate must be positive"]),
    (["--dataset", "cifar-10", "--base-learning-rate-exponent", "5000"], ["--base-learning-rate-exponent 5000"]),
    # Found as the options resolve, before the run folder: Interleaved needs a micro-batch in every stage.
    (["--dataset", "cifar-10", "--model-size", "8", "--shards", "2", "--pipeline", "--pipeline-splits",
      "stage2/unit1/relu", "--pipeline-schedule", "Interleaved", "--gradient-accumulation-count", "1"],
     ["--pipeline-schedule Interleaved needs at least as many micro-batches per update as stages: "
      "--gradient-accumulation-count 1 < --shards 2"]),
])
def test_unknown_names_and_contradictory_options(cifar, tmp_path, capfd, argv, fragments):
    out = scripts.run_here(capfd, "train.py", "--data-dir", str(cifar), *argv, cwd=tmp_path, expect=2)
    assert_one_line_error(out, *fragments)
    assert not (tmp_path / "logs").exists()


def test_unknown_config_in_a_given_configs_file(tmp_path, capfd):
    path = tmp_path / "mine.yml"
    path.write_text("small:\n  model_size: 8\n")
    out = scripts.run_here(capfd, "train.py", "--config", "large", "--config-path", str(path), cwd=tmp_path, expect=2)
    assert_one_line_error(out, "unknown config 'large'", str(path), "available configs: small")


def test_config_with_an_option_of_the_wrong_type(tmp_path, capfd):
    path = tmp_path / "mine.yml"
    path.write_text("small:\n  model_size: 8\n  micro_batch_size: [8, 16]\n")
    out = scripts.run_here(capfd, "train.py", "--config", "small", "--config-path", str(path), cwd=tmp_path, expect=2)
    assert_one_line_error(out, "config 'small'", str(path), "micro_batch_size must be a single value, got [8, 16]")


# ---------------------------------------------------------------------------------------------
# TFRecords and JPEG trees (ImageNet layouts)
# ---------------------------------------------------------------------------------------------


def shard(path: Path, first: int, count: int) -> list[int]:
    """A TFRecord shard of `count` 24x16 JPEG records (labels 1..3); the offset of each record."""
    offsets, blob = [], b""
    for index in range(first, first + count):
        offsets.append(len(blob))
        blob += frame(imagenet_example(colour_jpeg(colour_of(index)), index % 3 + 1))
    path.write_bytes(blob)
    return offsets


@pytest.fixture
def tfrecords(tmp_path) -> Path:
    root = tmp_path / "imagenet"
    root.mkdir()
    shard(root / "train-00000-of-00001", 0, 4)
    shard(root / "validation-00000-of-00001", 4, 4)
    return root


def test_tfrecord_with_a_bad_data_crc_met_while_training(tfrecords, tmp_path, capfd):
    path = tfrecords / "train-00000-of-00001"
    offsets = shard(path, 0, 4)
    blob = bytearray(path.read_bytes())
    blob[offsets[1] + 12 + 100] ^= 0xFF  # inside the second record's data: found when it is read
    path.write_bytes(bytes(blob))
    out = scripts.run_here(capfd, "train.py", *IMAGENET_RUN, "--micro-batch-size", "4", "--data-dir", str(tfrecords),
                           cwd=tmp_path, expect=2)
    assert_one_line_error(out, f"{path}: corrupt TFRecord at byte offset {offsets[1]} (data CRC mismatch)")


def test_tfrecord_with_a_bad_length_crc(tfrecords, tmp_path, capfd):
    path = tfrecords / "train-00000-of-00001"
    offsets = shard(path, 0, 4)
    blob = bytearray(path.read_bytes())
    blob[offsets[2] + 1] ^= 0x01  # the third record's length: found when the shard is indexed
    path.write_bytes(bytes(blob))
    out = scripts.run_here(capfd, "train.py", *IMAGENET_RUN, "--data-dir", str(tfrecords), cwd=tmp_path, expect=2)
    assert_one_line_error(out, f"{path}: corrupt TFRecord at byte offset {offsets[2]} (length CRC mismatch)")


def test_truncated_tfrecord(tfrecords, tmp_path, capfd):
    path = tfrecords / "train-00000-of-00001"
    offsets = shard(path, 0, 4)
    path.write_bytes(path.read_bytes()[:-30])
    out = scripts.run_here(capfd, "train.py", *IMAGENET_RUN, "--data-dir", str(tfrecords), cwd=tmp_path, expect=2)
    assert_one_line_error(out, f"{path}: truncated TFRecord at byte offset {offsets[3]}")


def test_corrupt_validation_tfrecord_read_in_a_worker_process_is_one_line(tfrecords, tmp_path, capfd):
    """The error is raised in a DataLoader worker; torch re-raises it with the worker's traceback in
    its message, which must reach the user as the worker's own one line."""
    path = tfrecords / "validation-00000-of-00001"
    offsets = shard(path, 4, 4)
    blob = bytearray(path.read_bytes())
    middle = offsets[2] + 12 + 200  # four bytes in the middle of the file, inside the third record's JPEG
    blob[middle:middle + 4] = b"\x00\x01\x02\x03"
    path.write_bytes(bytes(blob))
    out = scripts.run_here(capfd, "train.py", *IMAGENET_RUN, "--data-dir", str(tfrecords), cwd=tmp_path, expect=2)
    assert_one_line_error(out, f"{path}: corrupt TFRecord at byte offset {offsets[2]} (data CRC mismatch)")
    assert "Caught DataError" not in out.stderr


def test_worker_errors_are_given_back_as_raised(tfrecords):
    """In-process, with a worker: the same error type and the worker's one-line message."""
    from cnns.data.image_loader import ImageNetBatches

    path = tfrecords / "validation-00000-of-00001"
    offsets = shard(path, 4, 4)
    blob = bytearray(path.read_bytes())
    blob[offsets[1] + 12 + 200] ^= 0xFF
    path.write_bytes(bytes(blob))
    batches = ImageNetBatches(records_in(tfrecords, "validation"), train=False, batch_size=2, image_size=16, workers=1)
    with pytest.raises(DataError) as error:
        list(batches.epoch(0))
    message = str(error.value)
    assert message.startswith(f"{path}: corrupt TFRecord at byte offset ") and "\n" not in message


def test_corrupt_jpeg_in_a_folder_tree_is_named(tmp_path, capfd):
    root = tmp_path / "imagenet-tree"
    for split, count in (("train", 4), ("validation", 2)):
        for index in range(count):
            path = root / split / f"n0000000{index % 2}" / f"{split}_{index}.JPEG"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(colour_jpeg(colour_of(index)))
    bad = root / "train" / "n00000001" / "train_3.JPEG"
    bad.write_bytes(bad.read_bytes()[:50])
    out = scripts.run_here(capfd, "train.py", *IMAGENET_RUN, "--micro-batch-size", "4", "--data-dir", str(root),
                           "--no-validation", cwd=tmp_path, expect=2)
    assert_one_line_error(out, f"{bad}: cannot decode image")
    # --skip-corrupt-images: the run goes on without it and says how many were dropped.
    out = scripts.run_here(capfd, "train.py", *IMAGENET_RUN, "--micro-batch-size", "2", "--data-dir", str(root),
                           "--no-validation", "--skip-corrupt-images", "--iterations", "2", cwd=tmp_path, expect=None)
    assert out.returncode == 0, out.stderr[-2000:]
    # ... and names it (once, however often the run met it).
    assert re.search(rf"^Skipped (1 image|2 images) that could not be decoded \(--skip-corrupt-images\); first: {re.escape(str(bad))}$",
                     out.stdout, re.MULTILINE), out.stdout[-2000:]


# ---------------------------------------------------------------------------------------------
# Data errors found before the run folder is made: no new folder under --log-dir
# ---------------------------------------------------------------------------------------------


def listing(folder: Path) -> list[str]:
    return sorted(str(path.relative_to(folder)) for path in folder.rglob("*"))


def class_folders(root: Path, images: int = 0) -> Path:
    """A folder tree train/ and validation/, two class folders each, `images` JPEGs in every class folder."""
    for split in ("train", "validation"):
        for name in ("n01", "n02"):
            (root / split / name).mkdir(parents=True)
            for index in range(images):
                (root / split / name / f"{index}.JPEG").write_bytes(colour_jpeg(colour_of(index)))
    return root


def shards(root: Path, train: bytes | None = None, validation: bytes | None = None) -> Path:
    """One training and one validation shard of 4 good records, or the bytes given instead."""
    root.mkdir()
    for split, data, first in (("train", train, 0), ("validation", validation, 4)):
        path = root / f"{split}-00000-of-00001"
        if data is None:
            shard(path, first, 4)
        else:
            path.write_bytes(data)
    return root


def empty_class_folders(tmp: Path) -> tuple[list[str], list[str]]:
    root = class_folders(tmp / "tree")
    return ["--data-dir", str(root)], [f"{root / 'train'}: no image files in its 2 class folders"]


def undecodable_first_image(tmp: Path) -> tuple[list[str], list[str]]:
    root = class_folders(tmp / "tree", images=2)
    first = root / "train" / "n01" / "0.JPEG"
    first.write_bytes(first.read_bytes()[:40])
    return ["--data-dir", str(root), "--micro-batch-size", "4"], [f"{first}: cannot decode image"]


def text_as_training_shard(tmp: Path) -> tuple[list[str], list[str]]:
    root = shards(tmp / "records", train=b"image_id,label\n1,cat\n2,dog\n" * 4)
    return ["--data-dir", str(root)], [f"{root / 'train-00000-of-00001'}: not a TFRecord file"]


def text_as_validation_shard(tmp: Path) -> tuple[list[str], list[str]]:
    root = shards(tmp / "records", validation=bytes(range(256)))
    return ["--data-dir", str(root)], [f"{root / 'validation-00000-of-00001'}: not a TFRecord file"]


def record_without_an_image(tmp: Path) -> tuple[list[str], list[str]]:
    root = shards(tmp / "records", train=frame(example({"image/format": bytes_feature(b"JPEG")})))
    return ["--data-dir", str(root)], [f"{root / 'train-00000-of-00001'} (record at byte offset 0)",
                                       "has no bytes feature 'image/encoded'"]


def first_record_cut_short(tmp: Path) -> tuple[list[str], list[str]]:
    whole = frame(imagenet_example(colour_jpeg(colour_of(0)), 1))
    root = shards(tmp / "records", train=whole[:len(whole) // 2])
    return ["--data-dir", str(root)], [f"{root / 'train-00000-of-00001'}: truncated TFRecord at byte offset 0"]


def micro_batch_above_the_shards(tmp: Path) -> tuple[list[str], list[str]]:
    root = shards(tmp / "records")
    return ["--data-dir", str(root), "--micro-batch-size", "8"], [
        f"the training set in {root} has 4 images, fewer than one batch of 8"]


def global_batch_above_the_tree(tmp: Path) -> tuple[list[str], list[str]]:
    root = class_folders(tmp / "tree", images=3)
    return ["--data-dir", str(root), "--micro-batch-size", "4", "--gradient-accumulation-count", "2"], [
        f"the training set in {root / 'train'} has 6 images, fewer than one global batch of 8 "
        "(micro-batch 4 x accumulation 2)"]


@pytest.mark.parametrize("make", [empty_class_folders, undecodable_first_image, text_as_training_shard,
                                  text_as_validation_shard, record_without_an_image, first_record_cut_short,
                                  micro_batch_above_the_shards, global_batch_above_the_tree],
                         ids=lambda make: make.__name__)
def test_an_imagenet_data_error_leaves_no_run_folder(tmp_path, capfd, make):
    """Found by the checks before the run folder (the first record of each shard, the first image of each
    split, class folders until one batch): one line, and --log-dir as it was."""
    args, fragments = make(tmp_path)
    logs = tmp_path / "logs"
    (logs / "an-earlier-run").mkdir(parents=True)
    before = listing(logs)
    out = scripts.run_here(capfd, "train.py", *IMAGENET_RUN, *args, "--log-dir", str(logs), cwd=tmp_path, expect=2)
    assert_one_line_error(out, *fragments)
    assert " Saving to" not in out.stdout
    assert listing(logs) == before


def test_skip_corrupt_images_lets_an_undecodable_first_image_pass_the_checks(tmp_path):
    from cnns.cli.parsing import resolve_command_line
    from cnns.commands.checks import check_data_before_writing

    args, _ = undecodable_first_image(tmp_path)
    config = resolve_command_line("train", [*IMAGENET_RUN, *args, "--skip-corrupt-images"]).config
    check_data_before_writing(config)  # the run drops it and counts it instead
    with pytest.raises(DataError, match="cannot decode image"):
        check_data_before_writing(resolve_command_line("train", [*IMAGENET_RUN, *args]).config)


@pytest.mark.parametrize("extra, fragment", [
    (["--micro-batch-size", "40"], "has 30 images, fewer than one batch of 40"),
    (["--micro-batch-size", "16", "--gradient-accumulation-count", "2"],
     "has 30 images, fewer than one global batch of 32 (micro-batch 16 x accumulation 2)"),
    (["--micro-batch-size", "8", "--dataset-percentage-to-use", "20"],
     "has 30 images (6 with --dataset-percentage-to-use 20), fewer than one batch of 8"),
])
def test_a_batch_larger_than_the_cifar_training_set_leaves_no_run_folder(cifar, tmp_path, capfd, extra, fragment):
    logs = tmp_path / "logs"
    logs.mkdir()
    out = scripts.run_here(capfd, "train.py", *CIFAR_RUN, "--data-dir", str(cifar), *extra, "--log-dir", str(logs),
                           cwd=tmp_path, expect=2)
    assert_one_line_error(out, f"the training set in {cifar} {fragment}")
    assert listing(logs) == []


def test_a_cifar_label_out_of_range_leaves_no_run_folder(cifar, tmp_path, capfd):
    data = copy_of(cifar, tmp_path)
    path = data / "data_batch_4.bin"
    records = bytearray(path.read_bytes())
    records[3073] = 12  # the second record's class
    path.write_bytes(bytes(records))
    logs = tmp_path / "logs"
    logs.mkdir()
    out = scripts.run_here(capfd, "train.py", *CIFAR_RUN, "--data-dir", str(data), "--log-dir", str(logs),
                           cwd=tmp_path, expect=2)
    assert_one_line_error(out, f"CIFAR file has class label 12, outside 0..9: {path}")
    assert listing(logs) == []


GENERATED_RUN = ["--generated-data", "--dataset", "cifar-10", "--model-size", "8", "--micro-batch-size", "2",
                 "--iterations", "1", "--no-validation"]


def test_a_log_dir_in_proc_is_one_line(tmp_path, capfd):
    """Only creating it shows that /proc takes no folders: the process that tries, not a traceback."""
    out = scripts.run_here(capfd, "train.py", *GENERATED_RUN, "--log-dir", "/proc/cnns-logs", cwd=tmp_path, expect=2)
    assert_one_line_error(out, "--log-dir /proc/cnns-logs: cannot create /proc/cnns-logs")
    assert not Path("/proc/cnns-logs").exists()


@pytest.mark.parametrize("option", ["--log-dir", "--logs-path"])
def test_a_log_dir_that_is_a_file_or_under_one_is_one_line(tmp_path, capfd, option):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("not a folder\n")
    out = scripts.run_here(capfd, "train.py", *GENERATED_RUN, option, str(a_file), cwd=tmp_path, expect=2)
    assert_one_line_error(out, f"{option} {a_file} is a file, not a folder")
    out = scripts.run_here(capfd, "train.py", *GENERATED_RUN, option, str(a_file / "logs"), cwd=tmp_path, expect=2)
    assert_one_line_error(out, f"{option} {a_file / 'logs'} cannot be made: {a_file} is a file, not a folder")
    assert a_file.read_text() == "not a folder\n" and listing(tmp_path) == ["notes.txt"]


def without_root_override() -> list[str]:
    """The start of a command line that runs the command without root's leave to write in any folder
    (CAP_DAC_OVERRIDE), so that a folder's mode bits hold for it too; nothing for another user."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")  # util-linux
    if setpriv is None:
        pytest.skip("running as root, and no setpriv to run a command without CAP_DAC_OVERRIDE")
    dropped = "-dac_override,-dac_read_search"
    return [setpriv, "--bounding-set", dropped, "--inh-caps", dropped]


@pytest.mark.parametrize("script", ["train.py", "restore.py", "validation.py"])
def test_a_read_only_folder_to_write_in_is_one_line_and_left_alone(trained_run, tmp_path, script):
    """train.py's --log-dir, or the run folder that restore.py continues and validation.py adds to."""
    if script == "train.py":
        folder = tmp_path / "logs"
        (folder / "an-earlier-run").mkdir(parents=True)
        args, fragment = [*GENERATED_RUN, "--log-dir", str(folder / "new")], f"--log-dir {folder / 'new'}"
    else:
        folder = copy_of(trained_run, tmp_path)
        args, fragment = ["--restore-path", str(folder)], f"--restore-path {folder}"
    before = digest(folder), listing(folder)
    folder.chmod(0o555)
    try:
        # A child: as root, only a process started without CAP_DAC_OVERRIDE meets the folder's mode bits.
        out = processes.run([*without_root_override(), sys.executable, str(ROOT / script), *args], text=True,
                            cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=TIMEOUT_S)
    finally:
        folder.chmod(0o755)
    assert_one_line_error(out, f"{fragment}: cannot write in {folder} (read-only, or no permission)")
    assert (digest(folder), listing(folder)) == before


def test_restore_py_with_a_training_set_now_smaller_than_a_batch_leaves_the_run_folder_alone(cifar, tmp_path, capfd):
    from cnns.data.drawn_shapes import draw_shapes
    from cnns.data.cifar_records import write_cifar10

    data = copy_of(cifar, tmp_path)
    folder = tmp_path / "run"
    scripts.train_here(*CIFAR_RUN, "--micro-batch-size", "8", "--iterations", "2", "--data-dir", str(data),
                       "--seed", "4", "--logs-path", str(folder))
    images, labels = draw_shapes(7, seed=5)
    write_cifar10(data, (images[:5], labels[:5]), (images[5:], labels[5:]))  # 5 training images, a batch is 8
    before = digest(folder)
    out = scripts.run_here(capfd, "restore.py", "--restore-path", str(folder), cwd=tmp_path, expect=2)
    assert_one_line_error(out, f"the training set in {data} has 5 images, fewer than one batch of 8")
    assert digest(folder) == before


def test_validation_py_checks_the_validation_files_only(cifar, trained_run, tmp_path, capfd):
    """With its training files gone the data still validates; a cut test file is one line, the run folder as it was."""
    data = copy_of(cifar, tmp_path)
    for path in data.glob("data_batch_*.bin"):
        path.unlink()
    test_file = data / "test_batch.bin"
    whole = test_file.read_bytes()
    test_file.write_bytes(whole[:-100])
    folder = copy_of(trained_run, tmp_path)
    before = digest(folder)
    out = scripts.run_here(capfd, "validation.py", "--restore-path", str(folder), "--data-dir", str(data), cwd=tmp_path,
                           expect=2)
    assert_one_line_error(out, str(test_file), "not a multiple of the 3073-byte record")
    assert digest(folder) == before

    test_file.write_bytes(whole)
    out = scripts.run_here(capfd, "validation.py", "--restore-path", str(folder), "--data-dir", str(data), cwd=tmp_path,
                           expect=None)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Validation top-1 accuracy" in out.stdout and (folder / "validation.csv").is_file()


# ---------------------------------------------------------------------------------------------
# Checkpoints and run folders given to validation.py and restore.py
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained_run(cifar, tmp_path_factory) -> Path:
    """Two updates of ResNet-8, a checkpoint after each, trained in this process (no interpreter start-up)."""
    folder = tmp_path_factory.mktemp("bad-input-runs") / "run"
    scripts.train_here(*CIFAR_RUN, "--iterations", "2", "--data-dir", str(cifar), "--seed", "4", "--ckpts-per-epoch",
                       "1000000", "--device-iterations", "1", "--logs-path", str(folder))
    assert (folder / "ckpt-2.pt").is_file() and (folder / "arguments.json").is_file()
    return folder


def corrupt(path: Path) -> None:
    """Four bytes overwritten in the middle of the file: the zip's record of the tensors no longer matches."""
    blob = bytearray(path.read_bytes())
    middle = len(blob) // 2
    blob[middle:middle + 4] = bytes(4)
    path.write_bytes(bytes(blob))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])


def foreign(path: Path) -> None:
    """Another program's weights: a plain state dict, not a cnns checkpoint."""
    torch.save({"conv1.weight": torch.zeros(8, 3, 3, 3), "fc.bias": torch.zeros(10)}, path)


def mistyped(path: Path) -> None:
    """A cnns checkpoint whose iteration is not a number."""
    state = torch.load(path, weights_only=True)
    torch.save({**state, "iteration": "two"}, path)


CORRUPT = ["cannot read checkpoint", "the file is corrupt", "does not match its CRC"]
TRUNCATED = ["cannot read checkpoint", "truncated"]
FOREIGN = ["is not a cnns checkpoint (no 'model' state dict)"]
MISTYPED = ["is not a cnns checkpoint: its 'iteration' entry is a str, not int"]


# (tests/test_validation.py runs validation.py on a truncated checkpoint.)
@pytest.mark.parametrize("script, damage, fragments", [
    ("validation.py", corrupt, CORRUPT),
    ("restore.py", corrupt, CORRUPT),
    ("validation.py", foreign, FOREIGN),
    ("restore.py", foreign, FOREIGN),
    ("restore.py", truncate, TRUNCATED),
    ("validation.py", mistyped, MISTYPED),
    ("restore.py", mistyped, MISTYPED),
], ids=lambda value: value.__name__ if callable(value) else value if isinstance(value, str) else "")
def test_damaged_checkpoint_is_one_line_and_leaves_the_run_folder_alone(trained_run, tmp_path, capfd, script, damage,
                                                                        fragments):
    """Every checkpoint of the run damaged alike: nothing readable to continue from or to validate. (With one
    damaged and others readable, restore.py and validation.py go on with the others: tests/test_validation.py.)"""
    folder = copy_of(trained_run, tmp_path)
    for path in folder.glob("ckpt-*.pt"):
        damage(path)
    before = digest(folder)
    args = ("--restore-path", str(folder))
    out = scripts.run_here(capfd, script, *args, cwd=tmp_path, expect=2)
    assert_one_line_error(out, f"no readable checkpoint in {folder}", str(folder / "ckpt-2.pt"), *fragments)
    assert digest(folder) == before


def test_damaged_checkpoint_file_given_to_validation_py(trained_run, tmp_path, capfd):
    folder = copy_of(trained_run, tmp_path)
    corrupt(folder / "ckpt-1.pt")
    before = digest(folder)
    out = scripts.run_here(capfd, "validation.py", "--restore-path", str(folder / "ckpt-1.pt"), cwd=tmp_path, expect=2)
    assert_one_line_error(out, str(folder / "ckpt-1.pt"), *CORRUPT)
    assert digest(folder) == before


@pytest.mark.parametrize("content, fragments", [
    (None, ["has no arguments.json: not a cnns run folder"]),
    (b"{\"model\": \"resnet\",", ["arguments.json is not valid JSON"]),
    (b"[1, 2]", ["arguments.json is not a JSON object of options"]),
    (b"{\"model\": \"resnet\"}", ["arguments.json lacks the option"]),
])
def test_run_folder_with_bad_arguments_json_given_to_restore_py(trained_run, tmp_path, capfd, content, fragments):
    folder = copy_of(trained_run, tmp_path)
    if content is None:
        (folder / "arguments.json").unlink()
    else:
        (folder / "arguments.json").write_bytes(content)
    before = digest(folder)
    args = ("--restore-path", str(folder))
    out = scripts.run_here(capfd, "restore.py", *args, cwd=tmp_path, expect=2)
    assert_one_line_error(out, str(folder), *fragments)
    assert digest(folder) == before


def test_a_run_trained_with_epochs_per_ckpt_can_be_validated(cifar, tmp_path):
    """arguments.json then holds both --epochs-per-ckpt and the --ckpts-per-epoch derived from it; reading
    it back (validation.py resolves the run's options again) is not a contradiction."""
    from cnns.cli import resolved_training_options
    from cnns.runfolder.options import evaluation_options as _evaluation_options, open_run
    from cnns.runfolder.log import write_arguments

    options, _ = resolved_training_options("train", ["--dataset", "cifar-10", "--data-dir", str(cifar),
                                                     "--epochs-per-ckpt", "2"])
    assert options["ckpts_per_epoch"] == 0.5
    write_arguments(tmp_path, options)
    from cnns.cli import parse_options

    values, _ = parse_options("validate", ["--restore-path", str(tmp_path)])
    resolved, _ = _evaluation_options(values, open_run(values))
    assert resolved["ckpts_per_epoch"] == 0.5 and resolved["epochs_per_ckpt"] == 2.0
    np.testing.assert_equal(resolved["micro_batch_size"], options["micro_batch_size"])


def test_a_disk_that_fills_while_a_checkpoint_is_written_keeps_the_previous_one(tmp_path, monkeypatch):
    import errno

    import torch

    from cnns.runfolder.checkpoint import checkpoint_path, load_checkpoint, save_checkpoint
    from cnns.errors import CheckpointError

    previous = checkpoint_path(tmp_path, 5)
    save_checkpoint(previous, {"model": {"w": torch.ones(3)}, "iteration": 5})
    before = previous.read_bytes()

    def full_disk(state, file):
        file.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(CheckpointError, match=r"cannot write checkpoint .*ckpt-10\.pt: No space left on device"):
        save_checkpoint(checkpoint_path(tmp_path, 10), {"model": {"w": torch.zeros(3)}, "iteration": 10})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-5.pt"]  # no partial file, no temporary
    assert previous.read_bytes() == before
    monkeypatch.undo()
    assert load_checkpoint(previous)["iteration"] == 5
