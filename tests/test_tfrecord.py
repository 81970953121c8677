"""TFRecord reading, checked against files written here from the format definition alone: struct
framing, a bitwise CRC32C and hand-encoded tf.train.Example protobuf bytes."""

from __future__ import annotations

import io
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from cnns.data import tfrecord_reader
from cnns.errors import DataError

pytestmark = pytest.mark.filterwarnings("ignore:The image decoding and encoding capabilities:DeprecationWarning")

# ---------------------------------------------------------------------------------------------
# Writers, independent of the reader under test (also imported by test_imagenet_data.py)
# ---------------------------------------------------------------------------------------------


def reference_crc32c(data: bytes) -> int:
    """Bit-by-bit CRC32C (reflected polynomial 0x82F63B78), straight from the definition."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
    return crc ^ 0xFFFFFFFF


def reference_masked_crc(data: bytes) -> int:
    crc = reference_crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) % 2**32


def varint(value: int) -> bytes:
    value %= 2**64  # negative int64 values are 10-byte two's complement varints
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def length_delimited(field_number: int, payload: bytes) -> bytes:
    return varint(field_number << 3 | 2) + varint(len(payload)) + payload


def bytes_feature(*values: bytes) -> bytes:  # Feature { BytesList bytes_list = 1 { repeated bytes value = 1 } }
    return length_delimited(1, b"".join(length_delimited(1, v) for v in values))


def int64_feature(*values: int, packed: bool = True) -> bytes:  # Feature { Int64List int64_list = 3 }
    if packed:
        body = length_delimited(1, b"".join(varint(v) for v in values))
    else:
        body = b"".join(varint(1 << 3 | 0) + varint(v) for v in values)
    return length_delimited(3, body)


def float_feature(*values: float) -> bytes:  # Feature { FloatList float_list = 2 { packed float value = 1 } }
    return length_delimited(2, length_delimited(1, struct.pack(f"<{len(values)}f", *values)))


def example(features: dict[str, bytes]) -> bytes:
    """Example { Features features = 1 { map<string, Feature> feature = 1 } }: map entries are
    messages { string key = 1; Feature value = 2; }."""
    entries = b"".join(
        length_delimited(1, length_delimited(1, key.encode()) + length_delimited(2, feature))
        for key, feature in features.items()
    )
    return length_delimited(1, entries)


def imagenet_example(jpeg: bytes, label: int, packed: bool = True) -> bytes:
    return example({
        "image/height": int64_feature(8),
        "image/encoded": bytes_feature(jpeg),
        "image/class/label": int64_feature(label, packed=packed),
        "image/class/text": bytes_feature(b"some class"),
        "image/object/bbox/xmin": float_feature(0.1, 0.2),
    })


def frame(data: bytes) -> bytes:
    length = struct.pack("<Q", len(data))
    header = length + struct.pack("<I", reference_masked_crc(length))
    return header + data + struct.pack("<I", reference_masked_crc(data))


def write_tfrecord(path: Path, records: list[bytes]) -> list[int]:
    """Write framed records; returns the byte offset of each record."""
    offsets, blob = [], b""
    for record in records:
        offsets.append(len(blob))
        blob += frame(record)
    path.write_bytes(blob)
    return offsets


def colour_jpeg(colour: tuple[int, int, int], size: tuple[int, int] = (24, 16)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, "JPEG", quality=95)
    return buffer.getvalue()


def colour_of(index: int) -> tuple[int, int, int]:
    return (index * 37 % 256, index * 91 % 256, 255 - index * 53 % 256)


def write_imagenet_shards(folder: Path, split: str, labels_per_shard: list[list[int]]) -> list[tuple[int, int]]:
    """Shards <split>-0000i-of-0000n of small solid-colour JPEGs; record k of the whole split has
    colour_of(k). Returns (colour index, 1-based label) in reading order."""
    folder.mkdir(parents=True, exist_ok=True)
    written, count = [], len(labels_per_shard)
    for shard, labels in enumerate(labels_per_shard):
        records = []
        for label in labels:
            jpeg = colour_jpeg(colour_of(len(written)))
            records.append(imagenet_example(jpeg, label, packed=len(written) % 2 == 0))
            written.append((len(written), label))
        write_tfrecord(folder / f"{split}-{shard:05d}-of-{count:05d}", records)
    return written


# ---------------------------------------------------------------------------------------------
# CRC32C
# ---------------------------------------------------------------------------------------------


def test_crc32c_check_value_and_masking():
    assert reference_crc32c(b"123456789") == 0xE3069283  # the published CRC-32C check value
    assert tfrecord_reader.crc32c(b"123456789") == 0xE3069283
    assert tfrecord_reader.masked_crc32c(b"123456789") == reference_masked_crc(b"123456789")


@pytest.mark.parametrize("size", [0, 1, 3, 4, 15, 16, 17, 1000, 3001])
def test_crc32c_matches_bitwise_reference(size):
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    assert tfrecord_reader.crc32c(data) == reference_crc32c(data)
    assert tfrecord_reader.crc32c(memoryview(data)) == reference_crc32c(data)  # what the reader hands it


def test_without_google_crc32c_reading_a_tfrecord_is_one_line_naming_the_package(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "google_crc32c", None)  # import raises ImportError
    tfrecord_reader._crc32c_value.cache_clear()
    try:
        with pytest.raises(DataError, match=r"^reading TFRecords needs the google-crc32c package: "
                                            r"pip install google-crc32c$"):
            tfrecord_reader.crc32c(b"123456789")
    finally:
        tfrecord_reader._crc32c_value.cache_clear()
    monkeypatch.undo()
    assert tfrecord_reader.crc32c(b"123456789") == 0xE3069283


# ---------------------------------------------------------------------------------------------
# Shards, framing, protobuf
# ---------------------------------------------------------------------------------------------


def test_find_shards_any_count_sorted_and_in_imagenet_data(tmp_path):
    for name in ["train-00002-of-00003", "train-00000-of-00003", "train-00001-of-00003",
                 "validation-00000-of-00001", "train-00000-of-00003.idx", "README"]:
        (tmp_path / name).write_bytes(b"")
    assert [p.name for p in tfrecord_reader.find_shards(tmp_path, "train")] == [
        "train-00000-of-00003", "train-00001-of-00003", "train-00002-of-00003"]
    assert [p.name for p in tfrecord_reader.find_shards(tmp_path, "validation")] == ["validation-00000-of-00001"]

    nested = tmp_path / "other" / "imagenet-data"
    nested.mkdir(parents=True)
    (nested / "validation-00000-of-00128").write_bytes(b"")
    assert tfrecord_reader.find_shards(tmp_path / "other", "validation") == [nested / "validation-00000-of-00128"]
    with pytest.raises(DataError, match="other.*no TFRecord shards"):
        tfrecord_reader.find_shards(tmp_path / "other", "train")


def test_index_and_read_records(tmp_path):
    records = [b"", b"x", b"hello world" * 100, bytes(range(256))]
    path = tmp_path / "train-00000-of-00001"
    offsets = write_tfrecord(path, records)
    index = tfrecord_reader.index_records(path)
    assert index == [(offset, len(record)) for offset, record in zip(offsets, records)]
    assert [tfrecord_reader.read_record(path, offset, length) for offset, length in index] == records


def test_parse_example_features():
    record = example({
        "image/encoded": bytes_feature(b"\xff\xd8jpeg"),
        "image/class/label": int64_feature(615, -3, packed=False),
        "packed": int64_feature(1, 2**40, -1),
        "floats": float_feature(0.5, -2.0),
    })
    features = tfrecord_reader.parse_example(record)
    assert features == {"image/encoded": [b"\xff\xd8jpeg"], "image/class/label": [615, -3],
                        "packed": [1, 2**40, -1], "floats": [0.5, -2.0]}
    assert tfrecord_reader.parse_example(record, keys=("packed",)) == {"packed": [1, 2**40, -1]}
    with pytest.raises(ValueError):
        tfrecord_reader.parse_example(record[:-3])


def test_dataset_reads_images_and_zero_based_labels(tmp_path):
    written = write_imagenet_shards(tmp_path, "train", [[1, 5, 1000], [2], [7, 3]])
    dataset = tfrecord_reader.TFRecordDataset(tmp_path, "train", transform=None)
    assert len(dataset) == len(written) == 6
    for index, (colour_index, label) in enumerate(written):
        image, target = dataset[index]
        assert target == label - 1
        assert image.dtype == torch.uint8 and image.shape == (3, 16, 24)
        mean = image.float().mean(dim=(1, 2))
        assert torch.allclose(mean, torch.tensor(colour_of(colour_index), dtype=torch.float32), atol=3)


def test_flipped_data_byte_names_file_and_offset(tmp_path):
    path = tmp_path / "validation-00000-of-00001"
    records = [imagenet_example(colour_jpeg(colour_of(i)), i + 1) for i in range(3)]
    offsets = write_tfrecord(path, records)
    blob = bytearray(path.read_bytes())
    blob[offsets[1] + 12 + 40] ^= 0x01  # one bit in the data of the second record
    path.write_bytes(bytes(blob))

    dataset = tfrecord_reader.TFRecordDataset(tmp_path, "validation")  # headers are intact: indexing works
    dataset[0]
    with pytest.raises(DataError) as error:
        dataset[1]
    message = str(error.value)
    assert str(path) in message
    assert f"corrupt TFRecord at byte offset {offsets[1]} (data CRC mismatch)" in message


def test_corrupt_length_and_truncation_are_data_errors(tmp_path):
    path = tmp_path / "train-00000-of-00001"
    offsets = write_tfrecord(path, [b"a" * 50, b"b" * 50])
    blob = bytearray(path.read_bytes())
    blob[offsets[1]] ^= 0x04  # the second record's length
    path.write_bytes(bytes(blob))
    with pytest.raises(DataError, match=rf"{path.name}: corrupt TFRecord at byte offset {offsets[1]} \(length CRC"):
        tfrecord_reader.index_records(path)

    write_tfrecord(path, [b"a" * 50, b"b" * 50])
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(DataError, match=rf"{path.name}: truncated TFRecord at byte offset {offsets[1]}"):
        tfrecord_reader.index_records(path)


def test_first_record_reads_a_shard_s_first_record_with_both_crcs_checked(tmp_path):
    """What the checks before a run read of each shard (cnns.data.formats.tfrecord), framed and checked here, in the
    TFRecord reader: the first record's data, and None for an empty shard."""
    path = tmp_path / "train-00000-of-00001"
    write_tfrecord(path, [b"first" * 10, b"second"])
    assert tfrecord_reader.first_record(path) == b"first" * 10
    path.write_bytes(b"")
    assert tfrecord_reader.first_record(path) is None

    jpeg = colour_jpeg((10, 20, 30))
    write_tfrecord(path, [imagenet_example(jpeg, 7)])
    assert tfrecord_reader.first_example(path) == (jpeg, f"{path} (record at byte offset 0)")


@pytest.mark.parametrize("damage, message", [
    (lambda blob: blob[:5], "not a TFRecord file (5 bytes, less than a record's 12-byte header)"),
    (lambda blob: b"GIF89a" + blob[6:], "not a TFRecord file (the first record's length CRC does not match: "
                                        "another format, or corrupt from its first byte)"),
    (lambda blob: blob[:-1], "truncated TFRecord at byte offset 0 (record of 50 bytes runs past the end of the "
                             "65-byte file)"),
    (lambda blob: blob[:12] + blob[12:-1] + bytes([blob[-1] ^ 1]), "corrupt TFRecord at byte offset 0 (data CRC"),
])
def test_a_first_record_that_does_not_frame_is_one_line_naming_the_file(tmp_path, damage, message):
    path = tmp_path / "train-00000-of-00001"
    write_tfrecord(path, [b"a" * 50])
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(DataError) as raised:
        tfrecord_reader.first_record(path)
    assert str(raised.value).startswith(f"{path}: {message}")


def test_missing_label_is_a_data_error(tmp_path):
    path = tmp_path / "train-00000-of-00001"
    write_tfrecord(path, [example({"image/encoded": bytes_feature(colour_jpeg((1, 2, 3)))})])
    with pytest.raises(DataError, match="image/class/label"):
        tfrecord_reader.TFRecordDataset(tmp_path, "train")[0]


def test_parse_example_reads_bytes_from_a_real_protobuf_encoder():
    """Cross-check of the wire format with google.protobuf (present as tensorboard's dependency):
    tf.train.Example declared from its .proto definition at run time, filled and serialised."""
    pytest.importorskip("google.protobuf")
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    field = descriptor_pb2.FieldDescriptorProto
    proto = descriptor_pb2.FileDescriptorProto(name="example_test.proto", package="tftest", syntax="proto3")

    def add(message, name, number, kind, repeated=False, type_name=None):
        label = field.LABEL_REPEATED if repeated else field.LABEL_OPTIONAL
        message.field.add(name=name, number=number, type=kind, label=label, type_name=type_name)

    for list_name, kind in (("BytesList", field.TYPE_BYTES), ("FloatList", field.TYPE_FLOAT),
                            ("Int64List", field.TYPE_INT64)):
        add(proto.message_type.add(name=list_name), "value", 1, kind, repeated=True)
    feature = proto.message_type.add(name="Feature")  # a oneof in TensorFlow; the wire format is the same
    add(feature, "bytes_list", 1, field.TYPE_MESSAGE, type_name=".tftest.BytesList")
    add(feature, "float_list", 2, field.TYPE_MESSAGE, type_name=".tftest.FloatList")
    add(feature, "int64_list", 3, field.TYPE_MESSAGE, type_name=".tftest.Int64List")
    features = proto.message_type.add(name="Features")  # map<string, Feature> feature = 1
    entry = features.nested_type.add(name="FeatureEntry")
    entry.options.map_entry = True
    add(entry, "key", 1, field.TYPE_STRING)
    add(entry, "value", 2, field.TYPE_MESSAGE, type_name=".tftest.Feature")
    add(features, "feature", 1, field.TYPE_MESSAGE, repeated=True, type_name=".tftest.Features.FeatureEntry")
    add(proto.message_type.add(name="Example"), "features", 1, field.TYPE_MESSAGE, type_name=".tftest.Features")

    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    example_message = message_factory.GetMessageClass(pool.FindMessageTypeByName("tftest.Example"))()
    example_message.features.feature["image/encoded"].bytes_list.value.append(b"\xff\xd8 jpeg bytes")
    example_message.features.feature["image/class/label"].int64_list.value.extend([615, -2])
    example_message.features.feature["image/object/bbox/xmin"].float_list.value.extend([0.25, 0.5])
    parsed = tfrecord_reader.parse_example(example_message.SerializeToString())
    assert parsed == {"image/encoded": [b"\xff\xd8 jpeg bytes"], "image/class/label": [615, -2],
                      "image/object/bbox/xmin": [0.25, 0.5]}
