"""ImageNet TFRecord shards (Graphcore's application's format) read without TensorFlow, by random access.

A TFRecord file is a sequence of records, each framed as::

    uint64 length (little-endian) | uint32 masked CRC32C of those 8 bytes | data | uint32 masked CRC32C of data

and each record's data is a serialised ``tf.train.Example`` protocol buffer holding the JPEG bytes
(``image/encoded``) and the 1-based class (``image/class/label``).

Written by hand here, because no library we depend on does it: the record framing and a minimal
protobuf wire-format parser for ``tf.train.Example``. The CRC32C check is ``google-crc32c``'s (a declared
dependency); decoding and augmentation use torchvision.
"""

from __future__ import annotations

import os
import re
import struct
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np
import torch
from torch.utils.data import Dataset

from cnns.bounded_reads import FILE_SIZE_OPTION, UnreadableFile, describe_size, file_size_limit, open_regular_file
from cnns.data.batches import shuffled
from cnns.errors import DataError
from cnns.safe_writes import write_atomically

SPLITS = ("train", "validation")
IMAGENET_CLASSES = 1000

_HEADER = struct.Struct("<QI")  # length, masked CRC32C of the length
_FOOTER = struct.Struct("<I")  # masked CRC32C of the data
_FRAMING_BYTES = _HEADER.size + _FOOTER.size
SHARD_SIZE_UNLIMITED = 1 << 62  # a shard is opened as a regular file whatever its size: only records are read


# ----------------------------------------------------------------------------------------------
# Shard discovery
# ----------------------------------------------------------------------------------------------


def find_shards(folder: str | os.PathLike, split: str) -> list[Path]:
    """The TFRecord shards ``<split>-NNNNN-of-MMMMM`` of `split` in `folder` or `folder`/imagenet-data,
    sorted by shard number. Any shard count is accepted. DataError if there are none."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    pattern = re.compile(rf"{split}-(\d{{5}})-of-(\d{{5}})")
    root = Path(folder)
    for candidate in (root, root / "imagenet-data"):
        if not candidate.is_dir():
            continue
        # Whatever each is: one that is not a regular file is named when it is indexed (cnns.bounded_reads).
        shards = [p for p in candidate.iterdir() if pattern.fullmatch(p.name)]
        if shards:
            return sorted(shards, key=lambda p: int(pattern.fullmatch(p.name).group(1)))
    raise DataError(
        f"{root}: no TFRecord shards named {split}-00000-of-NNNNN in the folder or its imagenet-data/ subfolder"
    )


# ----------------------------------------------------------------------------------------------
# CRC32C (Castagnoli)
# ----------------------------------------------------------------------------------------------


@lru_cache(maxsize=1)
def _crc32c_value() -> Callable[[bytes], int]:
    """google-crc32c's CRC32C (SSE4.2 / ARM CRC instructions), imported on first use so that a missing
    package is one line when a TFRecord is read, not an ImportError for every command."""
    try:
        import google_crc32c
    except ImportError:
        raise DataError("reading TFRecords needs the google-crc32c package: pip install google-crc32c") from None
    return google_crc32c.value


def crc32c(data: bytes | memoryview) -> int:
    """CRC32C (Castagnoli) of `data`, as TFRecord uses it."""
    return _crc32c_value()(bytes(data))


def masked_crc32c(data: bytes | memoryview) -> int:
    """TFRecord's masked CRC: rotate right by 15 bits and add a constant, mod 2**32."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


# ----------------------------------------------------------------------------------------------
# Record framing
# ----------------------------------------------------------------------------------------------


def index_records(path: str | os.PathLike) -> list[tuple[int, int]]:
    """(offset, length) of every record in a TFRecord file: offset is where the record's header
    starts, length the size of its data. Reads only the 12-byte headers (verifying each length's
    CRC), so indexing a shard costs one small read per record, not a read of the whole file. A shard
    is never read whole, so its size has no limit; each record's has (`read_record`)."""
    path = Path(path)
    records = []
    with open_regular_file(path, SHARD_SIZE_UNLIMITED) as file:
        file_size = os.fstat(file.fileno()).st_size
        if hasattr(os, "posix_fadvise"):
            # Headers are ~110 KB apart: read-ahead would pull in every JPEG for nothing.
            os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
        offset = 0
        while offset < file_size:
            file.seek(offset)
            header = file.read(_HEADER.size)
            if len(header) < _HEADER.size:
                raise DataError(f"{path}: truncated TFRecord at byte offset {offset} (incomplete header)")
            length = _record_length(header)
            if length is None:
                raise DataError(f"{path}: corrupt TFRecord at byte offset {offset} (length CRC mismatch)")
            end = offset + _FRAMING_BYTES + length
            if end > file_size:
                raise DataError(
                    f"{path}: truncated TFRecord at byte offset {offset} "
                    f"(record of {length} bytes runs past the end of the {file_size}-byte file)"
                )
            records.append((offset, length))
            offset = end
    return records


def read_record(path: str | os.PathLike, offset: int, length: int, limit: int | None = None) -> bytes:
    """The data of the record whose header starts at `offset` (as index_records gives it),
    after checking its data CRC. A record longer than `limit` bytes (--max-file-size: a record holds one
    image) is refused before it is read."""
    limit = file_size_limit(limit)
    if length > limit:
        raise UnreadableFile(f"{path} (record at byte offset {offset})",
                             f"a record of {describe_size(length)}, more than the {describe_size(limit)} "
                             f"{FILE_SIZE_OPTION} allows (corrupt, or give a larger {FILE_SIZE_OPTION})")
    with open_regular_file(path, SHARD_SIZE_UNLIMITED) as file:
        file.seek(offset)
        framed = file.read(_FRAMING_BYTES + length)
    if len(framed) < _FRAMING_BYTES + length:
        raise DataError(f"{path}: truncated TFRecord at byte offset {offset}")
    data = framed[_HEADER.size:_HEADER.size + length]
    (data_crc,) = _FOOTER.unpack_from(framed, _HEADER.size + length)
    if masked_crc32c(data) != data_crc:
        raise DataError(f"{path}: corrupt TFRecord at byte offset {offset} (data CRC mismatch)")
    return data


def _record_length(header: bytes) -> int | None:
    """The data length a record's header gives, or None where the header's CRC does not match it."""
    length, length_crc = _HEADER.unpack(header)
    return length if masked_crc32c(header[:8]) == length_crc else None


def first_record(path: str | os.PathLike, size_limit: int | None = None) -> bytes | None:
    """The data of a shard's first record, its framing and both CRCs checked; None for an empty file (a shard
    with no records, which the reader accepts). Only a regular file is opened, and a record longer than
    `size_limit` (--max-file-size) is not read. What the checks before a run read of each shard: a first record
    that does not frame is said as "not a TFRecord file", where `index_records` names the byte offset."""
    with open_regular_file(path, SHARD_SIZE_UNLIMITED) as file:
        size = os.fstat(file.fileno()).st_size
        try:
            header = file.read(_HEADER.size)
        except OSError as error:
            raise UnreadableFile(path, error.strerror or str(error)) from None
    if size == 0:
        return None
    if len(header) < _HEADER.size:
        raise DataError(f"{path}: not a TFRecord file ({size} bytes, less than a record's "
                        f"{_HEADER.size}-byte header)")
    length = _record_length(header)
    if length is None:
        raise DataError(f"{path}: not a TFRecord file (the first record's length CRC does not match: "
                        "another format, or corrupt from its first byte)")
    if _FRAMING_BYTES + length > size:
        raise DataError(f"{path}: truncated TFRecord at byte offset 0 (record of {length} bytes runs past the "
                        f"end of the {size}-byte file)")
    return read_record(path, 0, length, size_limit)


# ----------------------------------------------------------------------------------------------
# tf.train.Example, protobuf wire format
#   Example  { Features features = 1; }
#   Features { map<string, Feature> feature = 1; }  -- map entries: { string key = 1; Feature value = 2; }
#   Feature  { oneof { BytesList bytes_list = 1; FloatList float_list = 2; Int64List int64_list = 3; } }
#   BytesList { repeated bytes value = 1; }  FloatList { repeated float value = 1 [packed]; }
#   Int64List { repeated int64 value = 1 [packed]; }
# ----------------------------------------------------------------------------------------------

_VARINT, _FIXED64, _LENGTH_DELIMITED, _FIXED32 = 0, 1, 2, 5


class _WireError(ValueError):
    """Malformed protobuf bytes (turned into a DataError naming the file by the caller)."""


def _read_varint(buffer: memoryview, position: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if position >= len(buffer):
            raise _WireError("varint runs past the end of the message")
        byte = buffer[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, position
        shift += 7
        if shift >= 70:
            raise _WireError("varint longer than 10 bytes")


def _fields(buffer: memoryview) -> Iterator[tuple[int, int, int | memoryview]]:
    """(field number, wire type, value) of each field of one message; length-delimited values are
    zero-copy slices, fixed-width ones are returned as raw slices too."""
    position = 0
    while position < len(buffer):
        key, position = _read_varint(buffer, position)
        number, wire_type = key >> 3, key & 7
        if wire_type == _VARINT:
            value, position = _read_varint(buffer, position)
        elif wire_type == _LENGTH_DELIMITED:
            size, position = _read_varint(buffer, position)
            value = buffer[position:position + size]
            position += size
        elif wire_type in (_FIXED64, _FIXED32):
            size = 8 if wire_type == _FIXED64 else 4
            value = buffer[position:position + size]
            position += size
        else:
            raise _WireError(f"unsupported wire type {wire_type}")
        if position > len(buffer):
            raise _WireError("field runs past the end of the message")
        yield number, wire_type, value


def _signed64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _feature_values(feature: memoryview) -> list:
    """The values of one Feature: list of bytes, floats or ints."""
    for kind, _, payload in _fields(feature):
        if kind == 1:  # BytesList
            return [bytes(v) for number, wire, v in _fields(payload) if number == 1 and wire == _LENGTH_DELIMITED]
        if kind == 2:  # FloatList, packed or not
            values: list = []
            for number, wire, v in _fields(payload):
                if number == 1 and wire in (_LENGTH_DELIMITED, _FIXED32):
                    if len(v) % 4:
                        raise _WireError(f"packed float list of {len(v)} bytes, not a multiple of 4")
                    values.extend(np.frombuffer(v, dtype="<f4").tolist())
            return values
        if kind == 3:  # Int64List, packed or not
            values = []
            for number, wire, v in _fields(payload):
                if number == 1 and wire == _VARINT:
                    values.append(_signed64(v))
                elif number == 1 and wire == _LENGTH_DELIMITED:
                    position = 0
                    while position < len(v):
                        item, position = _read_varint(v, position)
                        values.append(_signed64(item))
            return values
    return []


def parse_example(record: bytes | memoryview, keys: tuple[str, ...] | None = None) -> dict[str, list]:
    """Features of a serialised tf.train.Example: {name: list of bytes | floats | ints}.
    With `keys`, only those features are decoded (the others are skipped without copying).
    Raises ValueError on malformed bytes."""
    features: dict[str, list] = {}
    for number, wire, features_message in _fields(memoryview(record)):
        if number != 1 or wire != _LENGTH_DELIMITED:
            continue
        for entry_number, entry_wire, entry in _fields(features_message):
            if entry_number != 1 or entry_wire != _LENGTH_DELIMITED:
                continue
            name, value = None, memoryview(b"")
            for field_number, field_wire, field in _fields(entry):
                if field_number == 1 and field_wire == _LENGTH_DELIMITED:
                    name = bytes(field).decode("utf-8", errors="replace")
                elif field_number == 2 and field_wire == _LENGTH_DELIMITED:
                    value = field
            if name is not None and (keys is None or name in keys):
                features[name] = _feature_values(value)
    return features


_IMAGE_KEY, _LABEL_KEY = "image/encoded", "image/class/label"


def parse_imagenet_example(record: bytes, source: str) -> tuple[bytes, int]:
    """(encoded image bytes, 0-based class) of one ImageNet record. The TFRecords store 1-based
    labels (0 was 'background' in the Inception-era scripts), so class = label - 1."""
    try:
        features = parse_example(record, keys=(_IMAGE_KEY, _LABEL_KEY))
    except ValueError as error:
        raise DataError(f"{source}: malformed tf.train.Example ({error})") from None
    images, labels = features.get(_IMAGE_KEY), features.get(_LABEL_KEY)
    if not images or not isinstance(images[0], bytes):
        raise DataError(f"{source}: tf.train.Example has no bytes feature {_IMAGE_KEY!r}")
    if not labels or not isinstance(labels[0], int):
        raise DataError(f"{source}: tf.train.Example has no int64 feature {_LABEL_KEY!r}")
    if not 1 <= labels[0] <= IMAGENET_CLASSES:
        raise DataError(f"{source}: {_LABEL_KEY} is {labels[0]}, expected a 1-based class label "
                        f"in 1..{IMAGENET_CLASSES}")
    return images[0], labels[0] - 1


def first_example(path: str | os.PathLike, size_limit: int | None = None) -> tuple[bytes, str] | None:
    """(image bytes, where they come from) of a shard's first record (`first_record`), parsed as an ImageNet
    tf.train.Example; None for an empty shard."""
    record = first_record(path, size_limit)
    if record is None:
        return None
    source = f"{path} (record at byte offset 0)"
    return parse_imagenet_example(record, source)[0], source


# ----------------------------------------------------------------------------------------------
# Writing (for synthetic data sets: cnns bench-data --make-jpeg-tree DIR --layout tfrecord)
# ----------------------------------------------------------------------------------------------


def _varint(value: int) -> bytes:
    value %= 1 << 64  # negative int64 values are ten-byte two's complement varints
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _length_delimited(field_number: int, payload: bytes) -> bytes:
    return _varint(field_number << 3 | _LENGTH_DELIMITED) + _varint(len(payload)) + payload


def encode_imagenet_example(encoded_image: bytes, label: int) -> bytes:
    """A serialised tf.train.Example holding `encoded_image` as image/encoded and the 1-based
    `label` as image/class/label (packed Int64List), as the ImageNet TFRecords do."""
    features = {
        _IMAGE_KEY: _length_delimited(1, _length_delimited(1, encoded_image)),  # Feature.bytes_list
        _LABEL_KEY: _length_delimited(3, _length_delimited(1, _varint(label))),  # Feature.int64_list
    }
    entries = b"".join(_length_delimited(1, _length_delimited(1, key.encode()) + _length_delimited(2, feature))
                       for key, feature in features.items())
    return _length_delimited(1, entries)


def frame_record(data: bytes) -> bytes:
    """One TFRecord: length, masked CRC of the length, data, masked CRC of the data."""
    length = struct.pack("<Q", len(data))
    return length + _FOOTER.pack(masked_crc32c(length)) + data + _FOOTER.pack(masked_crc32c(data))


def write_records(path: str | os.PathLike, records: Iterable[bytes]) -> None:
    """A TFRecord file of `records`, written under a temporary name and renamed when complete."""
    def write(file) -> None:
        for record in records:
            file.write(frame_record(record))

    write_atomically(path, write)


# ----------------------------------------------------------------------------------------------
# Dataset
# ----------------------------------------------------------------------------------------------


@lru_cache(maxsize=None)
def _cached_index(path: str, size: int, mtime_ns: int) -> np.ndarray:
    """index_records as an int64 [records, 2] array, cached per file version: numpy rows cost
    16 bytes a record, where tuples of ints would cost ~100 (1.3 M records in ImageNet)."""
    del size, mtime_ns  # part of the cache key only: a rewritten file is indexed again
    return np.asarray(index_records(path), dtype=np.int64).reshape(-1, 2)


def _shard_index(path: Path) -> np.ndarray:
    stat = path.stat()
    return _cached_index(str(path), stat.st_size, stat.st_mtime_ns)


def _default_decode(data: bytes, source: str) -> torch.Tensor:
    from cnns.data.imagefolder import decode_rgb  # import here: imagefolder is a sibling, not a base

    return decode_rgb(data, source)


ImageTransform = Callable[[bytes, str], torch.Tensor]


class TFRecordDataset(Dataset):
    """Map-style dataset over every record of every shard of one split, in shard order.

    item i -> (transform(encoded image bytes, source), class) where class is 0-based and
    source names the file and byte offset (for error messages). The default transform decodes
    to a uint8 [3, H, W] tensor; `read(i)` gives the encoded image undecoded, which imagenet.py's
    batch loader decodes straight into its batch.

    The shards are indexed once (headers only, in parallel threads since it is I/O-bound) and the
    index is cached per file, so a second dataset over the same files costs nothing.
    """

    def __init__(self, folder: str | os.PathLike, split: str, transform: ImageTransform | None = None,
                 size_limit: int | None = None) -> None:
        self.size_limit = size_limit  # the longest record read (--max-file-size)
        self.shards = find_shards(folder, split)
        self.transform = transform or _default_decode
        with ThreadPoolExecutor(max_workers=min(16, len(self.shards))) as pool:
            indexes = list(pool.map(_shard_index, self.shards))
        counts = [len(index) for index in indexes]
        self.shard_ids = np.repeat(np.arange(len(self.shards), dtype=np.int32), counts)
        joined = np.concatenate(indexes) if indexes else np.zeros((0, 2), dtype=np.int64)
        self.offsets = joined[:, 0].copy()
        self.lengths = joined[:, 1].copy()

    num_classes = IMAGENET_CLASSES

    def __len__(self) -> int:
        return len(self.offsets)

    @property
    def where(self) -> str:
        return str(self.shards[0].parent)

    def training_order(self, indices: np.ndarray, seed: int, epoch: int) -> np.ndarray:
        """Records are read by their offsets, any order as cheaply as another: a uniform shuffle."""
        return shuffled(indices, seed, epoch)

    def source(self, index: int) -> str:
        """Where record `index` is, for messages."""
        return f"{self.shards[self.shard_ids[index]]} (record at byte offset {int(self.offsets[index])})"

    def read(self, index: int) -> tuple[bytes, int, str]:
        """(the record's encoded image, its 0-based class, where it is for messages): what the batch
        loader decodes."""
        path = self.shards[self.shard_ids[index]]
        offset = int(self.offsets[index])
        source = self.source(index)
        record = read_record(path, offset, int(self.lengths[index]), self.size_limit)
        encoded, label = parse_imagenet_example(record, source)
        return encoded, label, source

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        encoded, label, source = self.read(index)
        return self.transform(encoded, source), label
