"""`cnns convert`: MNIST-style IDX files and scikit-learn's digits written as CIFAR-10 binaries that the CIFAR reader
and train.py take. The IDX files are written here from the format's definition (LeCun's MNIST page), not by cnns."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest

import scripts
from cnns.data.as_cifar import DEBIAN_FASHION_MNIST, as_cifar_images, idx_split, parse_idx
from cnns.data.cifar_records import load_cifar
from cnns.errors import DataError


def idx_bytes(array: np.ndarray) -> bytes:
    """An IDX file of unsigned bytes: 0, 0, type 0x08, the dimension count, each dimension as a big-endian uint32."""
    return bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape) + array.tobytes()


def write_idx_set(folder: Path, train: int, test: int, size: int = 28, compress: bool = True) -> dict:
    """An MNIST-like set: image k of class c is c's brightness in a square that moves with k, so each is distinct."""
    folder.mkdir(parents=True, exist_ok=True)
    made = {}
    for split, count, stem in (("train", train, "train"), ("test", test, "t10k")):
        labels = (np.arange(count) % 10).astype(np.uint8)
        images = np.zeros((count, size, size), dtype=np.uint8)
        for k, label in enumerate(labels):
            top = k % (size - 4)
            images[k, top:top + 4, 2:6 + label] = 25 * (label + 1)
        for kind, array in (("images-idx3", images), ("labels-idx1", labels)):
            data = idx_bytes(array)
            name = f"{stem}-{kind}-ubyte"
            if compress:
                (folder / f"{name}.gz").write_bytes(gzip.compress(data))
            else:
                (folder / name).write_bytes(data)
        made[split] = (images, labels)
    return made


def test_an_idx_file_reads_back_as_the_array_its_header_describes():
    array = np.arange(2 * 3 * 5, dtype=np.uint8).reshape(2, 3, 5)
    assert np.array_equal(parse_idx(idx_bytes(array), "x"), array)
    with pytest.raises(DataError, match="not an IDX file"):
        parse_idx(b"\x01\x00\x08\x01" + struct.pack(">I", 1) + b"\x00", "x")
    with pytest.raises(DataError, match="type 0x0d"):  # floats
        parse_idx(b"\x00\x00\x0d\x01" + struct.pack(">I", 1) + b"\x00\x00\x00\x00", "x")
    with pytest.raises(DataError, match="has 45 bytes; its IDX header \\(2, 3, 5\\) needs 46"):  # one byte short
        parse_idx(idx_bytes(array)[:-1], "x")


def test_grey_images_become_centred_cifar_images_enlarged_by_whole_factors():
    rng = np.random.default_rng(0)
    mnist = rng.integers(1, 256, size=(3, 28, 28), dtype=np.uint8)
    out = as_cifar_images(mnist)
    assert out.shape == (3, 32, 32, 3) and out.dtype == np.uint8
    assert all(np.array_equal(out[..., c], out[..., 0]) for c in (1, 2))  # grey in every colour plane
    assert np.array_equal(out[:, 2:30, 2:30, 0], mnist)  # 28 px fits once: a 2-pixel black border
    assert out[:, :2].max() == out[:, 30:].max() == out[:, :, :2].max() == out[:, :, 30:].max() == 0
    digits = rng.integers(0, 256, size=(2, 8, 8), dtype=np.uint8)
    enlarged = as_cifar_images(digits)[..., 0]
    assert np.array_equal(enlarged, np.kron(digits, np.ones((1, 4, 4), dtype=np.uint8)))  # 8 px: each a 4x4 block
    with pytest.raises(DataError, match="do not fit"):
        as_cifar_images(np.zeros((1, 33, 20), dtype=np.uint8))


def test_convert_writes_cifar10_that_the_reader_reads_back_and_never_replaces_files_unasked(tmp_path, capfd):
    made = write_idx_set(tmp_path / "idx", train=50, test=20)
    out = tmp_path / "as-cifar"
    printed = scripts.run_here(capfd, "convert", "mnist", "--from", str(tmp_path / "idx"), "--out", str(out)).stdout
    assert "50 training and 20 test images" in printed
    for split, train in (("train", True), ("test", False)):
        images, labels = load_cifar(out, "cifar-10", train=train)
        assert np.array_equal(labels.numpy(), made[split][1])
        assert np.array_equal(images.numpy(), as_cifar_images(made[split][0]))
    assert (out / "batches.meta.txt").read_text().split() == [str(d) for d in range(10)]
    # Again without --overwrite: one line, exit 2, the files as they were.
    before = {path.name: path.read_bytes() for path in out.iterdir()}
    write_idx_set(tmp_path / "idx", train=30, test=10)
    refused = scripts.run_here(capfd, "convert", "mnist", "--from", str(tmp_path / "idx"), "--out", str(out), expect=2)
    assert refused.stderr.count("\n") == 1 and "--overwrite" in refused.stderr
    assert {path.name: path.read_bytes() for path in out.iterdir()} == before
    scripts.run_here(capfd, "convert", "mnist", "--from", str(tmp_path / "idx"), "--out", str(out), "--overwrite")
    assert len(load_cifar(out, "cifar-10", train=True)[1]) == 30


def test_bad_idx_folders_are_one_line_and_nothing_is_written(tmp_path, capfd):
    write_idx_set(tmp_path / "idx", train=20, test=10, compress=False)  # unpacked files read as well
    assert len(idx_split(tmp_path / "idx", "train").labels) == 20
    (tmp_path / "idx" / "t10k-labels-idx1-ubyte").write_bytes(idx_bytes(np.zeros(9, dtype=np.uint8)))
    out = tmp_path / "out"
    for argv, words in (((f"--from={tmp_path / 'idx'}",), "holds 10 images but"),
                        ((f"--from={tmp_path / 'nowhere'}",), "no such folder"),
                        ((), "needs --from")):
        failed = scripts.run_here(capfd, "convert", "mnist", *argv, "--out", str(out), expect=2)
        assert words in failed.stderr and failed.stderr.count("\n") == 1
    assert not out.exists()


def test_converted_digits_train_and_validate_as_cifar10(tmp_path, capfd):
    pytest.importorskip("sklearn")
    from sklearn.datasets import load_digits

    out = tmp_path / "digits"
    scripts.run_here(capfd, "convert", "digits", "--out", str(out))
    images, labels = load_cifar(out, "cifar-10", train=True)
    test_images, test_labels = load_cifar(out, "cifar-10", train=False)
    digits = load_digits()
    assert len(labels) == 1437 and len(test_labels) == 360
    assert np.array_equal(np.concatenate([labels.numpy(), test_labels.numpy()]), digits.target)
    # 0..16 as 0..255: a 16 is white, a 0 black, each pixel a 4 x 4 block.
    assert np.array_equal(images[0, ::4, ::4, 0].numpy(), np.rint(digits.images[0] * 255 / 16).astype(np.uint8))
    run = scripts.run_here(capfd, "train.py", "--data-dir", str(out), "--model-size", "8", "--iterations", "4",
                           "--micro-batch-size", "16", "--precision", "32.32", "--log-dir", str(tmp_path / "logs"))
    assert "on cifar-10" in run.stdout and "Validation top-1 accuracy" in run.stdout
    assert "[ckpt-4]" in run.stdout and "val_size" not in run.stderr


@pytest.mark.skipif(not DEBIAN_FASHION_MNIST.is_dir(), reason="Debian's dataset-fashion-mnist is not installed")
def test_debian_s_fashion_mnist_files_read_as_the_published_set():
    """Zalando's test split: 10,000 images of 28 x 28, 1,000 of each class."""
    test = idx_split(DEBIAN_FASHION_MNIST, "test")
    assert test.images.shape == (10_000, 28, 28)
    assert np.bincount(test.labels).tolist() == [1000] * 10
