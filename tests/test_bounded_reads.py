"""Bounded reads (cnns.bounded_reads): an image or data file is read only if it is a regular file no larger than
--max-file-size, and no further. A FIFO (which would block for ever), a symlink to /dev/zero (read until the kernel
kills the process), a directory named x.jpg and a sparse file far larger than any photograph are each one line in
`cnns predict`, the ImageNet readers (dropped and named with --skip-corrupt-images), the TFRecord and CIFAR readers
and the checks made before a run.

Every test that puts a FIFO where a file is read has a time limit (a child process's, or pytest-timeout's in this
process), so a reader that opened it would fail the test instead of hanging the suite."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
from torchvision.io import encode_png

import processes
import scripts
from cnns.bounded_reads import DEFAULT_FILE_SIZE_LIMIT, UnreadableFile, read_bounded
from cnns.errors import CnnsError, DataError
from cnns.data.formats import records_in

# torchvision 0.29 deprecates its image codecs (used here to write the test images), warning per call.
pytestmark = pytest.mark.filterwarnings("ignore:The image decoding and encoding capabilities:DeprecationWarning")
FIFO_LIMIT_S = 60  # far above what reading a few small files takes; a reader blocked on a FIFO fails here
SPARSE_SIZE = 20 << 30  # the 20 GB .jpg: sparse, so it takes no disk space


def fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def dev_zero(path: Path) -> Path:
    path.symlink_to("/dev/zero")
    return path


def sparse(path: Path, size: int = SPARSE_SIZE) -> Path:
    with open(path, "wb") as file:
        file.truncate(size)
    return path


def png(path: Path, seed: int = 3) -> Path:
    from cnns.data.drawn_shapes import draw_shapes

    images, _ = draw_shapes(1, seed=seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(encode_png(images[0].permute(2, 0, 1).contiguous()).numpy())
    return path


# ----------------------------------------------------------------------------------------------
# The rule


@pytest.mark.timeout(FIFO_LIMIT_S)
@pytest.mark.parametrize("make, reason", [
    (fifo, "not a regular file but a FIFO (named pipe)"),
    (dev_zero, "not a regular file but a character device (/dev/zero)"),
    (Path.mkdir, "not a regular file but a directory"),
    (sparse, f"20 GiB, more than the 1 GiB --max-file-size allows"),
])
def test_only_a_regular_file_within_the_limit_is_read(tmp_path, make, reason):
    path = tmp_path / "photo.jpg"
    make(path)
    with pytest.raises(UnreadableFile) as raised:
        read_bounded(path)
    message = str(raised.value)
    assert message.startswith(f"{path}: cannot read: {reason}") and "\n" not in message, message


def test_a_file_is_read_whole_within_the_limit_and_refused_past_it(tmp_path):
    path = tmp_path / "data.bin"
    path.write_bytes(b"x" * 1000)
    assert read_bounded(path, 1000) == b"x" * 1000
    with pytest.raises(UnreadableFile, match="1000 bytes, more than the 999 bytes --max-file-size allows"):
        read_bounded(path, 999)
    with pytest.raises(UnreadableFile, match="No such file or directory"):
        read_bounded(tmp_path / "missing.jpg")


def test_the_size_the_file_system_reports_is_not_trusted(tmp_path):
    """/proc files are regular files whose stat size is 0 whatever they hold: the read itself stops at the limit."""
    status = Path("/proc/self/status")
    if not status.is_file() or status.stat().st_size != 0:
        pytest.skip("needs Linux's /proc, whose files report size 0")
    with pytest.raises(UnreadableFile, match="more than the 10 bytes --max-file-size allows \\(it grew while it was"):
        read_bounded(status, 10)
    assert b"Name:" in read_bounded(status)


def test_the_default_limit_is_far_above_a_photograph_and_every_cifar_file():
    largest_decoded = 13_400 * 13_400 * 3  # the decoders' pixel limit, as uncompressed RGB
    cifar100_train = 50_000 * 3074
    assert DEFAULT_FILE_SIZE_LIMIT > 1.5 * max(largest_decoded, cifar100_train)


def test_the_option_is_a_size_with_units_and_reaches_the_data_configuration():
    from cnns.cli.parsing import resolve_command_line

    argv = ["--synthetic-data", "--dataset", "cifar-10", "--model-size", "8"]
    assert resolve_command_line("train", argv).config.data.max_file_size == DEFAULT_FILE_SIZE_LIMIT  # the reader's
    for given, size in (("2G", 2 << 30), ("512M", 512 << 20), ("1.5K", 1536), ("1000", 1000)):
        config = resolve_command_line("train", [*argv, "--max-file-size", given]).config
        assert config.data.max_file_size == size


# ----------------------------------------------------------------------------------------------
# cnns predict


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory) -> Path:
    """A ResNet-8 run folder after one update on synthetic data: what predict reads, quickly made."""
    folder = tmp_path_factory.mktemp("run") / "run"
    scripts.train_here("--synthetic-data", "--dataset", "cifar-10", "--model-size", "8", "--iterations", "1",
                       "--micro-batch-size", "4", "--precision", "32.32", "--no-validation", "--seed", "3",
                       "--logs-path", str(folder))
    return folder


def predict_child(run_folder: Path, *argv: str) -> tuple[int, list[str], list[str]]:
    """`python -m cnns predict` in a child that is killed if it has not finished within FIFO_LIMIT_S x 3 (its
    imports take seconds): (exit code, stdout lines, stderr lines)."""
    out = processes.run([sys.executable, "-m", "cnns", "predict", "--restore-path", str(run_folder), *argv],
                        text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=3 * FIFO_LIMIT_S)
    return out.returncode, out.stdout.splitlines(), out.stderr.splitlines()


def test_predict_on_a_fifo_is_one_line_and_exit_2_without_waiting_for_a_writer(run_folder, tmp_path):
    image = fifo(tmp_path / "photo.jpg")
    code, out, err = predict_child(run_folder, str(image))
    assert code == 2 and out == [], (code, out, err)
    assert err == [f"error: {image}: cannot read: not a regular file but a FIFO (named pipe)"], err


@pytest.mark.parametrize("make, reason", [
    (dev_zero, "not a regular file but a character device (/dev/zero)"),
    (sparse, "20 GiB, more than the 1 GiB --max-file-size allows"),
])
def test_predict_on_a_device_or_a_huge_file_is_one_line_and_exit_2(run_folder, tmp_path, capfd, make, reason):
    image = make(tmp_path / "photo.jpg")
    done = scripts.run_here(capfd, "predict", "--restore-path", str(run_folder), str(image), expect=2)
    (line,) = done.stderr.splitlines()
    assert done.stdout == "" and line.startswith(f"error: {image}: cannot read: {reason}"), line


def test_predict_honours_a_smaller_max_file_size(run_folder, tmp_path, capfd):
    image = png(tmp_path / "small.png")
    size = image.stat().st_size
    done = scripts.run_here(capfd, "predict", "--restore-path", str(run_folder), "--max-file-size", str(size - 1),
                            str(image), expect=2)
    assert done.stderr.splitlines() == [
        f"error: {image}: cannot read: {size} bytes, more than the {size - 1} bytes --max-file-size allows "
        "(a corrupt or foreign file, or give a larger --max-file-size)"]
    scripts.run_here(capfd, "predict", "--restore-path", str(run_folder), "--max-file-size", str(size), str(image))


def test_predict_on_a_directory_named_like_an_image_is_one_line_and_exit_2(run_folder, tmp_path, capfd):
    folder = tmp_path / "photo.jpg"
    folder.mkdir()
    done = scripts.run_here(capfd, "predict", "--restore-path", str(run_folder), str(folder), expect=2)
    assert len(done.stderr.splitlines()) == 1 and done.stderr.startswith(f"error: {folder}: no image files"), done


def test_unreadable_files_in_a_folder_are_named_and_the_others_still_predicted(run_folder, tmp_path):
    """As a corrupt image in a folder is: one line each, the rest predicted, exit 1."""
    folder = tmp_path / "photos"
    good = png(folder / "good.png")
    bad = {fifo(folder / "pipe.png"): "not a regular file but a FIFO (named pipe)",
           dev_zero(folder / "zero.png"): "not a regular file but a character device (/dev/zero)",
           sparse(folder / "huge.png", 2 << 20): "2 MiB, more than the 1 MiB --max-file-size allows"}
    png(folder / "nested.jpg" / "inner.png", seed=4)  # a folder named like an image is a folder: searched
    code, out, err = predict_child(run_folder, "--max-file-size", "1M", str(folder))
    assert code == 1, (out, err)
    assert sorted(line.split(": ")[0] for line in out) == sorted([str(good), str(folder / "nested.jpg" / "inner.png")])
    errors = [line for line in err if line.startswith("error:")]
    assert len(errors) == len(bad), err
    for path, reason in bad.items():
        assert any(line.startswith(f"error: cannot read {path}: {reason}") for line in errors), (path, err)


# ----------------------------------------------------------------------------------------------
# The dataset readers and the checks before a run


def image_tree(root: Path) -> dict[Path, str]:
    """An ImageNet folder tree whose validation split holds two images and, among them, a FIFO and a symlink to
    /dev/zero named as images: {unreadable file: why}."""
    for index, name in enumerate(("a", "b")):
        png(root / "validation" / name / "good.JPEG", seed=index)
    return {fifo(root / "validation" / "a" / "pipe.JPEG"): "not a regular file but a FIFO (named pipe)",
            dev_zero(root / "validation" / "b" / "zero.JPEG"): "not a regular file but a character device"}


@pytest.mark.timeout(FIFO_LIMIT_S)
def test_the_imagenet_folder_reader_names_such_files_or_drops_them_as_corrupt_images(tmp_path):
    from cnns.data.image_loader import ImageNetBatches

    unreadable = image_tree(tmp_path)
    source = ImageNetBatches(records_in(tmp_path, "validation"), train=False, batch_size=4, image_size=8, workers=0)
    assert source.num_samples == 4  # listed as images, not silently left out
    with pytest.raises(DataError, match=f"^{re.escape(str(next(iter(unreadable))))}: cannot read: not a regular"):
        list(source.epoch(0))
    source = ImageNetBatches(records_in(tmp_path, "validation"), train=False, batch_size=4, image_size=8, workers=0,
                             skip_corrupt=True)
    assert [labels.tolist() for _, labels in source.epoch(0)] == [[0, 1]]
    assert source.skipped_images == 2 and sorted(source.skipped_names) == sorted(map(str, unreadable))


@pytest.mark.timeout(FIFO_LIMIT_S)
def test_the_checks_before_a_run_name_an_unreadable_first_image(tmp_path):
    from cnns.data.formats import FOLDER_TREE, TrainingBatch

    one = TrainingBatch.of(1, 1, 1, 100)
    image_tree(tmp_path)
    first = tmp_path / "validation" / "a" / "good.JPEG"
    first.unlink()
    fifo(first)
    with pytest.raises(DataError, match=f"^{re.escape(str(first))}: cannot read: not a regular file but a FIFO"):
        FOLDER_TREE.check(tmp_path, ["validation"], one, decode=True, size_limit=None)
    FOLDER_TREE.check(tmp_path, ["validation"], one, decode=False, size_limit=None)  # --skip-corrupt-images: left to training


@pytest.mark.timeout(FIFO_LIMIT_S)
def test_a_tfrecord_shard_that_is_not_a_file_and_a_record_over_the_limit_are_one_line(tmp_path):
    from cnns.data.formats.tfrecord import check_tfrecord_split
    from cnns.data.tfrecord_reader import TFRecordDataset
    from test_tfrecord import write_imagenet_shards

    write_imagenet_shards(tmp_path, "validation", [[1, 2]])
    (shard,) = tmp_path.glob("validation-*")
    with pytest.raises(UnreadableFile, match="record at byte offset 0\\): cannot read: a record of"):
        TFRecordDataset(tmp_path, "validation", size_limit=10).read(0)
    with pytest.raises(UnreadableFile, match="cannot read: a record of"):
        check_tfrecord_split(tmp_path, "validation", None, size_limit=10)
    shard.unlink()
    fifo(shard)
    for read in (lambda: TFRecordDataset(tmp_path, "validation"), lambda: check_tfrecord_split(tmp_path, "validation", None)):
        with pytest.raises(UnreadableFile, match=f"^{re.escape(str(shard))}: cannot read: not a regular file but a FIFO"):
            read()


@pytest.mark.timeout(FIFO_LIMIT_S)
@pytest.mark.parametrize("make, reason", [
    (fifo, "not a regular file but a FIFO"),
    (dev_zero, "not a regular file but a character device"),
    (lambda path: sparse(path, 3073 * 400_000), "1.14 GiB, more than the 1 GiB --max-file-size allows"),
])
def test_a_cifar_file_that_is_not_a_file_or_is_too_large_is_one_line(tmp_path, make, reason):
    from cnns.data.formats import CIFAR_10_BINARY, TrainingBatch
    from cnns.data.drawn_shapes import draw_shapes
    from cnns.data.cifar_records import load_cifar, write_cifar10

    images, labels = draw_shapes(20, seed=1)
    write_cifar10(tmp_path, (images[:10], labels[:10]), (images[10:], labels[10:]))
    test_batch = tmp_path / "test_batch.bin"
    test_batch.unlink()
    make(test_batch)
    message = f"^{re.escape(str(test_batch))}: cannot read: {re.escape(reason)}"
    with pytest.raises(DataError, match=message):
        load_cifar(tmp_path, "cifar-10", train=False)
    with pytest.raises(DataError, match=message):
        CIFAR_10_BINARY.check(tmp_path, ["validation"], TrainingBatch.of(1, 1, 1, 100), decode=True, size_limit=None)


def test_a_bad_data_file_before_a_run_is_one_line_exit_2_and_no_run_folder(tmp_path, capfd):
    from cnns.data.drawn_shapes import draw_shapes
    from cnns.data.cifar_records import write_cifar10

    data = tmp_path / "cifar-10-data"
    images, labels = draw_shapes(40, seed=1)
    write_cifar10(data, (images[:30], labels[:30]), (images[30:], labels[30:]))
    (data / "data_batch_2.bin").unlink()
    dev_zero(data / "data_batch_2.bin")
    done = scripts.run_here(capfd, "train.py", "--dataset", "cifar-10", "--data-dir", str(data), "--model-size", "8",
                            "--iterations", "1", "--micro-batch-size", "4", "--log-dir", str(tmp_path / "logs"),
                            expect=2)
    assert done.stderr.strip().splitlines() == [
        f"error: {data / 'data_batch_2.bin'}: cannot read: not a regular file but a character device (/dev/zero)"]
    assert not (tmp_path / "logs").exists()


def test_every_read_error_is_a_cnns_error():
    assert issubclass(UnreadableFile, DataError) and issubclass(DataError, CnnsError)
