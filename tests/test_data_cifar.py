"""CIFAR binary files (reader checked against hand-made bytes) and the built-in dataset."""

from __future__ import annotations

import struct

import pytest
import torch

from cnns.data import drawn_shapes
from cnns.data.drawn_shapes import BUILTIN_CLASSES, draw_shapes, ensure_builtin_dataset
from cnns.data.cifar_records import (
    NUM_CLASSES,
    detect_cifar,
    load_cifar,
    write_cifar10,
    write_cifar100,
)
from cnns.errors import DataError


def random_split(count: int, num_classes: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (count, 32, 32, 3), dtype=torch.uint8, generator=generator)
    labels = torch.randint(0, num_classes, (count,), generator=generator)
    return images, labels


def hand_made_record(label_bytes: bytes, pixel) -> bytes:
    """One record built pixel by pixel from a function pixel(channel, row, col) -> 0..255,
    in the documented layout: label bytes, then the R plane, G plane, B plane, each row-major."""
    planes = bytes(pixel(channel, row, col) for channel in range(3) for row in range(32) for col in range(32))
    return label_bytes + planes


def pattern(seed: int):
    return lambda channel, row, col: (seed * 31 + channel * 97 + row * 7 + col * 3) % 256


# --- reading against bytes made by hand -------------------------------------------------------


def test_cifar10_reader_puts_every_byte_at_its_nhwc_position(tmp_path):
    labels = [3, 9, 0]
    for name in [f"data_batch_{i}.bin" for i in range(1, 6)]:
        # Each training file holds one record; file i's record has label labels[i % 3].
        index = int(name[11]) - 1
        record = hand_made_record(struct.pack("B", labels[index % 3]), pattern(index))
        (tmp_path / name).write_bytes(record)
    (tmp_path / "test_batch.bin").write_bytes(
        hand_made_record(b"\x07", pattern(10)) + hand_made_record(b"\x01", pattern(11))
    )

    images, targets = load_cifar(tmp_path, "cifar-10", train=True)
    assert images.shape == (5, 32, 32, 3) and images.dtype == torch.uint8 and images.is_contiguous()
    assert targets.dtype == torch.int64 and targets.tolist() == [3, 9, 0, 3, 9]
    for index in range(5):
        for row, col, channel in [(0, 0, 0), (0, 1, 0), (1, 0, 1), (31, 30, 2), (17, 5, 1)]:
            assert images[index, row, col, channel].item() == pattern(index)(channel, row, col)

    images, targets = load_cifar(tmp_path, "cifar-10", train=False)
    assert targets.tolist() == [7, 1]
    expected = torch.tensor(
        [[[[pattern(seed)(c, r, k) for c in range(3)] for k in range(32)] for r in range(32)] for seed in (10, 11)],
        dtype=torch.uint8,
    )
    assert torch.equal(images, expected)


def test_cifar100_reader_uses_the_fine_label(tmp_path):
    records = hand_made_record(bytes([4, 87]), pattern(1)) + hand_made_record(bytes([19, 99]), pattern(2))
    (tmp_path / "train.bin").write_bytes(records)
    (tmp_path / "test.bin").write_bytes(hand_made_record(bytes([0, 2]), pattern(3)))

    images, labels = load_cifar(tmp_path, "cifar-100", train=True)
    assert labels.tolist() == [87, 99]
    assert images[1, 4, 9, 2].item() == pattern(2)(2, 4, 9)
    assert load_cifar(tmp_path, "cifar-100", train=False)[1].tolist() == [2]


# --- writer round trips and layouts --------------------------------------------------------------


def test_cifar10_writer_round_trip_and_file_sizes(tmp_path):
    train, test = random_split(23, 10, seed=0), random_split(7, 10, seed=1)
    write_cifar10(tmp_path, train, test)
    sizes = [(tmp_path / f"data_batch_{i}.bin").stat().st_size for i in range(1, 6)]
    assert sum(sizes) == 23 * 3073 and all(size % 3073 == 0 for size in sizes)
    assert (tmp_path / "test_batch.bin").stat().st_size == 7 * 3073
    for split, (images, labels) in ((True, train), (False, test)):
        loaded_images, loaded_labels = load_cifar(tmp_path, "cifar-10", train=split)
        assert torch.equal(loaded_images, images) and torch.equal(loaded_labels, labels)


def test_cifar100_writer_round_trip_and_coarse_byte(tmp_path):
    train, test = random_split(9, 100, seed=2), random_split(4, 100, seed=3)
    write_cifar100(tmp_path, train, test)
    raw = (tmp_path / "train.bin").read_bytes()
    assert len(raw) == 9 * 3074
    assert raw[0] == train[1][0].item() // 5 and raw[1] == train[1][0].item()
    for split, (images, labels) in ((True, train), (False, test)):
        loaded_images, loaded_labels = load_cifar(tmp_path, "cifar-100", train=split)
        assert torch.equal(loaded_images, images) and torch.equal(loaded_labels, labels)


def test_archive_subfolders_are_found_and_detected(tmp_path):
    write_cifar10(tmp_path / "c10" / "cifar-10-batches-bin", random_split(5, 10, 0), random_split(2, 10, 1))
    write_cifar100(tmp_path / "c100" / "cifar-100-binary", random_split(3, 100, 0), random_split(2, 100, 1))
    assert detect_cifar(tmp_path / "c10") == "cifar-10"
    assert detect_cifar(tmp_path / "c100") == "cifar-100"
    assert detect_cifar(tmp_path / "c100" / "cifar-100-binary") == "cifar-100"
    assert len(load_cifar(tmp_path / "c10", "cifar-10", train=True)[1]) == 5
    assert len(load_cifar(tmp_path / "c100", "cifar-100", train=False)[1]) == 2


def test_detect_returns_none_without_cifar_files(tmp_path):
    (tmp_path / "readme.txt").write_text("nothing here")
    assert detect_cifar(tmp_path) is None
    assert detect_cifar(tmp_path / "missing") is None
    assert NUM_CLASSES == {"cifar-10": 10, "cifar-100": 100}


# --- bad input ------------------------------------------------------------------------------------


def test_truncated_file_is_named(tmp_path):
    write_cifar10(tmp_path, random_split(5, 10, 0), random_split(2, 10, 1))
    path = tmp_path / "data_batch_3.bin"
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(DataError, match="data_batch_3.bin.*3073"):
        load_cifar(tmp_path, "cifar-10", train=True)


def test_empty_file_is_named(tmp_path):
    write_cifar100(tmp_path, random_split(3, 100, 0), random_split(2, 100, 1))
    (tmp_path / "test.bin").write_bytes(b"")
    with pytest.raises(DataError, match="empty.*test.bin"):
        load_cifar(tmp_path, "cifar-100", train=False)


def test_missing_file_is_named(tmp_path):
    write_cifar10(tmp_path, random_split(5, 10, 0), random_split(2, 10, 1))
    (tmp_path / "data_batch_5.bin").unlink()
    with pytest.raises(DataError, match="missing.*data_batch_5.bin"):
        load_cifar(tmp_path, "cifar-10", train=True)
    load_cifar(tmp_path, "cifar-10", train=False)  # the test split is complete


def test_empty_folder_and_missing_folder(tmp_path):
    with pytest.raises(DataError, match="test_batch.bin"):
        load_cifar(tmp_path, "cifar-10", train=False)
    with pytest.raises(DataError, match="folder missing.*nowhere"):
        load_cifar(tmp_path / "nowhere", "cifar-100", train=True)


def test_label_out_of_range_is_named(tmp_path):
    (tmp_path / "test_batch.bin").write_bytes(hand_made_record(b"\x0a", pattern(0)))
    with pytest.raises(DataError, match="label 10.*test_batch.bin"):
        load_cifar(tmp_path, "cifar-10", train=False)


# --- the built-in dataset ------------------------------------------------------------------------


def test_builtin_drawing_is_deterministic_balanced_and_varied():
    images, labels = draw_shapes(400, seed=5)
    again_images, again_labels = draw_shapes(400, seed=5)
    assert torch.equal(images, again_images) and torch.equal(labels, again_labels)
    assert images.shape == (400, 32, 32, 3) and images.dtype == torch.uint8
    assert torch.bincount(labels, minlength=10).tolist() == [40] * 10
    assert len(BUILTIN_CLASSES) == 10
    assert not torch.equal(draw_shapes(400, seed=6)[0], images)
    # Not solvable from one pixel: the class mean images differ far less than the images vary.
    means = torch.stack([images[labels == c].float().mean(0) for c in range(10)])
    assert (means.max(0).values - means.min(0).values).max() < images.float().std() * 2


def test_builtin_dataset_files_are_cifar10_and_identical_across_generations(tmp_path):
    first = ensure_builtin_dataset(tmp_path / "a")
    second = ensure_builtin_dataset(tmp_path / "b")
    names = [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]
    for name in names:
        assert (first / name).stat().st_size == 1000 * 3073
        assert (first / name).read_bytes() == (second / name).read_bytes()
    assert not [path.name for path in first.iterdir() if path.name not in names]  # no temporary files left
    images, labels = load_cifar(first, "cifar-10", train=True)
    assert images.shape == (5000, 32, 32, 3)
    assert torch.bincount(labels, minlength=10).tolist() == [500] * 10
    assert torch.bincount(load_cifar(first, "cifar-10", train=False)[1], minlength=10).tolist() == [100] * 10
    assert detect_cifar(first) == "cifar-10"


def test_builtin_dataset_is_not_regenerated_when_present(tmp_path, monkeypatch):
    ensure_builtin_dataset(tmp_path)

    def fail(*args, **kwargs):
        raise AssertionError("regenerated although the files were present")

    monkeypatch.setattr(drawn_shapes, "draw_shapes", fail)
    ensure_builtin_dataset(tmp_path)

    # A file of the wrong size is rewritten.
    monkeypatch.undo()
    damaged = tmp_path / "data_batch_2.bin"
    damaged.write_bytes(b"\x00" * 100)
    ensure_builtin_dataset(tmp_path)
    assert damaged.stat().st_size == 1000 * 3073


def test_commands_preparing_the_builtin_set_at_once_keep_each_others_files(tmp_path, monkeypatch):
    """Two commands start on a missing built-in set; the other writes every file while this one draws. This one
    keeps them (the same bytes) instead of stopping at "data_batch_1.bin exists and this command did not make it",
    which two test workers met on one checkout's data/builtin."""
    from cnns.safe_writes import command_scope

    real = drawn_shapes.cifar10_file_contents
    draws = []

    def drawn_while_another_command_writes(*args):
        draws.append(args)
        if len(draws) == 1:
            with command_scope():  # the other command, start to end
                ensure_builtin_dataset(tmp_path)
        return real(*args)

    monkeypatch.setattr(drawn_shapes, "cifar10_file_contents", drawn_while_another_command_writes)
    with command_scope():
        assert ensure_builtin_dataset(tmp_path) == tmp_path
    assert len(draws) == 2  # both drew: neither found the files complete before it began
    names = [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(names)  # no temporary file left
    fresh = real(*draws[0])
    assert all((tmp_path / name).read_bytes() == fresh[name] for name in names)


def test_write_once_never_replaces_or_writes_through_what_is_there(tmp_path, monkeypatch):
    import errno
    import os

    from cnns.safe_writes import write_once

    assert write_once(tmp_path / "a.bin", b"first") and (tmp_path / "a.bin").read_bytes() == b"first"
    assert not write_once(tmp_path / "a.bin", b"second") and (tmp_path / "a.bin").read_bytes() == b"first"
    (tmp_path / "link.bin").symlink_to(tmp_path / "target.bin")  # a dangling link: not followed, not replaced
    assert not write_once(tmp_path / "link.bin", b"x") and not (tmp_path / "target.bin").exists()

    def no_hard_links(source, destination):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_hard_links)  # a file system without hard links renames instead
    assert write_once(tmp_path / "b.bin", b"b") and (tmp_path / "b.bin").read_bytes() == b"b"
    assert not write_once(tmp_path / "b.bin", b"c") and (tmp_path / "b.bin").read_bytes() == b"b"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["a.bin", "b.bin", "link.bin"]
