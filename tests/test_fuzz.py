"""Fuzzing of every reader of user files (SPEC 8): CIFAR records, TFRecord framing and tf.train.Example
parsing, image decoding, configs.yml, checkpoints and a run folder's arguments.json.

The property is the same for each: any input either loads, or raises the project's own error (a
CnnsError subclass, which the command line prints as one line) with a non-empty one-line message.
Any other exception type fails the test. Bounded and derandomised (the same examples on every run,
so CI is reproducible), with example counts kept small enough for the file to stay among the quick ones.
"""

from __future__ import annotations

import contextlib
import io
import json
import struct
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from cnns.config import load_named_config
from cnns.data import cifar_records, tfrecord_reader
from cnns.data.imagefolder import decode_rgb
from cnns.errors import CnnsError
from cnns.runfolder.checkpoint import load_checkpoint, save_checkpoint
from cnns.runfolder.run_folder import read_run_options

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")


def fuzz(examples: int):
    return settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def loads_or_clean_error(function, *args, **kwargs):
    """function(*args) or None when it raised a CnnsError with a one-line message; anything else propagates."""
    try:
        return function(*args, **kwargs)
    except CnnsError as error:
        message = str(error)
        assert message.strip(), f"{type(error).__name__} with an empty message"
        assert "\n" not in message and "\r" not in message, f"a message of several lines: {message!r}"
        return None


def mutate(data: bytes, flips: list[tuple[int, int]], keep: int | None) -> bytes:
    """`data` with some bytes xor-ed (positions taken modulo the length), then cut to `keep` bytes."""
    blob = bytearray(data)
    for position, mask in flips:
        if blob:
            blob[position % len(blob)] ^= mask
    return bytes(blob if keep is None else blob[:keep])


flips = st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(1, 255)), max_size=4)
cut = st.one_of(st.none(), st.integers(0, 400))


def small_jpeg(seed: int = 0, size: tuple[int, int] = (12, 8)) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


JPEG = small_jpeg()


# ----------------------------------------------------------------------------------------------
# CIFAR binary records
# ----------------------------------------------------------------------------------------------


@st.composite
def cifar_file(draw, record: int, label_bytes: int) -> bytes:
    """Whole records, a few bytes more or fewer, random pixels and label bytes (some out of range)."""
    count = draw(st.integers(0, 2))
    size = max(0, count * record + draw(st.sampled_from([0, 0, 0, -1, 1, -record // 2, 7])))
    blob = np.random.default_rng(draw(st.integers(0, 2**32 - 1))).integers(0, 256, size, dtype=np.uint8)
    labels = draw(st.lists(st.integers(0, 255), min_size=count * label_bytes, max_size=count * label_bytes))
    for index, label in enumerate(labels):
        position = (index // label_bytes) * record + index % label_bytes
        if position < size:
            blob[position] = label
    return blob.tobytes()


def check_cifar(files: dict[str, bytes], dataset: str) -> None:
    with tempfile.TemporaryDirectory() as folder:
        for name, data in files.items():
            (Path(folder) / name).write_bytes(data)
        for train in (True, False):
            loaded = loads_or_clean_error(cifar_records.load_cifar, folder, dataset, train)
            if loaded is not None:
                images, labels = loaded
                assert images.dtype == torch.uint8 and images.shape[1:] == (32, 32, 3)
                assert len(images) == len(labels) > 0
                assert 0 <= int(labels.min()) and int(labels.max()) < cifar_records.NUM_CLASSES[dataset]


@fuzz(120)
@given(st.lists(cifar_file(3073, 1), min_size=6, max_size=6), st.integers(0, 6))
def test_cifar10_files_load_or_fail_cleanly(contents, missing):
    names = [*cifar_records.CIFAR10_FILES["train"], *cifar_records.CIFAR10_FILES["test"]]
    check_cifar({name: data for index, (name, data) in enumerate(zip(names, contents)) if index != missing},
                "cifar-10")


@fuzz(90)
@given(cifar_file(3074, 2), cifar_file(3074, 2))
def test_cifar100_files_load_or_fail_cleanly(train, test):
    check_cifar({"train.bin": train, "test.bin": test}, "cifar-100")


@fuzz(60)
@given(st.binary(max_size=64))
def test_cifar_random_bytes_fail_cleanly(data):
    check_cifar({"train.bin": data, "test.bin": data}, "cifar-100")


# ----------------------------------------------------------------------------------------------
# TFRecord framing and tf.train.Example
# ----------------------------------------------------------------------------------------------


def read_split(data: bytes) -> None:
    """Every record of a one-shard split holding `data`, decoded to an image as training would."""
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "train-00000-of-00001").write_bytes(data)
        dataset = loads_or_clean_error(tfrecord_reader.TFRecordDataset, folder, "train")
        if dataset is None:
            return
        for index in range(len(dataset)):
            item = loads_or_clean_error(dataset.__getitem__, index)
            if item is not None:
                image, label = item
                assert image.dtype == torch.uint8 and image.dim() == 3 and image.shape[0] == 3
                assert 0 <= label < tfrecord_reader.IMAGENET_CLASSES


VALID_SHARD = b"".join(tfrecord_reader.frame_record(tfrecord_reader.encode_imagenet_example(small_jpeg(seed), label))
                       for seed, label in ((1, 1), (2, 1000)))


@fuzz(75)
@given(st.binary(max_size=120))
def test_tfrecord_random_file_fails_cleanly(data):
    read_split(data)


@fuzz(120)
@given(flips, st.one_of(st.none(), st.integers(0, len(VALID_SHARD))))
def test_tfrecord_damaged_file_loads_or_fails_cleanly(byte_flips, keep):
    read_split(mutate(VALID_SHARD, byte_flips, keep))


@fuzz(90)
@given(st.lists(st.binary(max_size=60), min_size=1, max_size=3))
def test_tfrecord_well_framed_random_payloads_fail_cleanly(payloads):
    read_split(b"".join(tfrecord_reader.frame_record(payload) for payload in payloads))


EXAMPLE = tfrecord_reader.encode_imagenet_example(JPEG, 7)


def check_example(record: bytes) -> None:
    parsed = loads_or_clean_error(tfrecord_reader.parse_imagenet_example, record, "shard (record at byte offset 0)")
    if parsed is not None:
        encoded, label = parsed
        assert isinstance(encoded, bytes) and isinstance(label, int)
        assert 0 <= label < tfrecord_reader.IMAGENET_CLASSES


@fuzz(180)
@given(st.binary(max_size=80))
def test_example_random_bytes_parse_or_fail_cleanly(record):
    check_example(record)


@fuzz(180)
@given(flips, st.one_of(st.none(), st.integers(0, len(EXAMPLE))))
def test_example_damaged_bytes_parse_or_fail_cleanly(byte_flips, keep):
    check_example(mutate(EXAMPLE, byte_flips, keep))


@fuzz(120)
@given(st.binary(max_size=12), st.sampled_from(["image/encoded", "image/class/label"]),
       st.sampled_from([1, 2, 3, 7]), st.integers(-(1 << 63), (1 << 64) - 1))
def test_example_with_features_of_other_types_fails_cleanly(raw, key, kind, number):
    """A feature of the right name holding bytes, floats, int64 (any value) or an unknown kind."""
    if kind == 1:
        payload = tfrecord_reader._length_delimited(1, raw)
    elif kind == 2:
        payload = tfrecord_reader._length_delimited(1, raw)  # packed floats: any byte count
    else:
        payload = tfrecord_reader._length_delimited(1, tfrecord_reader._varint(number))
    feature = tfrecord_reader._length_delimited(kind, payload)
    other = "image/class/label" if key == "image/encoded" else "image/encoded"
    valid = {"image/encoded": tfrecord_reader._length_delimited(1, tfrecord_reader._length_delimited(1, JPEG)),
             "image/class/label": tfrecord_reader._length_delimited(3, tfrecord_reader._length_delimited(1, tfrecord_reader._varint(5)))}
    entries = b"".join(tfrecord_reader._length_delimited(1, tfrecord_reader._length_delimited(1, name.encode())
                                                  + tfrecord_reader._length_delimited(2, value))
                       for name, value in ((key, feature), (other, valid[other])))
    check_example(tfrecord_reader._length_delimited(1, entries))


# ----------------------------------------------------------------------------------------------
# Image decoding
# ----------------------------------------------------------------------------------------------


def check_decode(data: bytes) -> None:
    image = loads_or_clean_error(decode_rgb, data, "some/file.JPEG")
    if image is not None:
        assert image.dtype == torch.uint8 and image.dim() == 3 and image.shape[0] == 3


MAGIC = [b"", b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n", b"GIF89a", b"RIFF\x00\x00\x00\x00WEBPVP8 ", b"BM", b"P6\n"]


@fuzz(180)
@given(st.sampled_from(MAGIC), st.binary(max_size=100))
def test_decode_random_bytes_fails_cleanly(magic, data):
    check_decode(magic + data)


@fuzz(240)
@given(flips, st.one_of(st.none(), st.integers(0, len(JPEG))))
def test_decode_damaged_jpeg_loads_or_fails_cleanly(byte_flips, keep):
    check_decode(mutate(JPEG, byte_flips, keep))


@fuzz(60)
@given(st.integers(1, 65535), st.integers(1, 65535), st.sampled_from(["JPEG", "PNG"]))
def test_decode_image_declaring_any_size_loads_or_fails_cleanly(width, height, kind):
    """A small image whose header claims another size (up to 65535 x 65535, 12.9 GB of pixels):
    never a multi-gigabyte allocation, a clean error past the size limit."""
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), (10, 200, 30)).save(buffer, kind)
    blob = bytearray(buffer.getvalue())
    if kind == "JPEG":
        at = blob.index(b"\xff\xc0") + 5
        blob[at:at + 4] = struct.pack(">HH", height, width)
    else:
        blob[16:24] = struct.pack(">II", width, height)  # IHDR (its CRC is now wrong too)
    check_decode(bytes(blob))


# ----------------------------------------------------------------------------------------------
# configs.yml
# ----------------------------------------------------------------------------------------------


def check_config(text: str | bytes, name: str = "fuzzed") -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "configs.yml"
        path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass"))
        values = loads_or_clean_error(load_named_config, name, path)
        if values is not None:
            assert isinstance(values, dict) and all(isinstance(key, str) for key in values)


@fuzz(180)
@given(st.text(alphabet=st.sampled_from(list("fuzed:- \n\t[]{},&*<!|>'\"#%@`?12.x")), max_size=60))
def test_configs_yml_random_text_loads_or_fails_cleanly(text):
    check_config(text)
    check_config("fuzzed:\n  " + text)


@fuzz(60)
@given(st.binary(max_size=40))
def test_configs_yml_random_bytes_fail_cleanly(data):
    check_config(data)


scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 300), st.floats(allow_nan=True),
                    st.text(max_size=6))
values = st.one_of(scalars, st.lists(scalars, max_size=3), st.dictionaries(st.text(max_size=4), scalars, max_size=2))
OPTION_NAMES = ["model", "model_size", "micro_batch_size", "batch_size", "epochs", "iterations", "dataset",
                "optimiser", "precision", "validation", "pipeline_splits", "learning_rate_schedule",
                "weight_avg_N", "label_smoothing", "abs_learning_rate", "base_learning_rate_exponent",
                "gradient_accumulation_count", "replicas", "BN_decay", "epochs_per_ckpt", "ckpts_per_epoch",
                "stochastic_rounding", "warmup_epochs", "available_memory_proportion", "unknown_key"]


@fuzz(180)
@given(st.one_of(values, st.dictionaries(st.sampled_from(OPTION_NAMES), values, max_size=4)))
def test_configs_yml_with_values_of_unexpected_types_loads_or_fails_cleanly(config):
    """A config that is a list, a number, null, or a mapping of options holding values of any type."""
    check_config(yaml.safe_dump({"fuzzed": config, "other": {"model": "resnet"}}))


@fuzz(120)
@given(st.dictionaries(st.sampled_from(OPTION_NAMES), values, min_size=1, max_size=3))
def test_training_options_from_configs_yml_resolve_or_fail_cleanly(config):
    """Past load_named_config: the config's values become option defaults and are resolved; values of
    the wrong type stop there with one line (an argparse error is one line and exit 2 too)."""
    from cnns.cli import resolved_training_options

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "configs.yml"
        path.write_text(yaml.safe_dump({"fuzzed": config}))
        argv = ["--config", "fuzzed", "--config-path", str(path), "--data-dir", "/nonexistent/cifar-10"]
        try:
            loads_or_clean_error(resolved_training_options, "train", argv)
        except SystemExit as exit_:
            assert exit_.code == 2


# ----------------------------------------------------------------------------------------------
# Checkpoints
# ----------------------------------------------------------------------------------------------


def valid_checkpoint() -> bytes:
    buffer = io.BytesIO()
    torch.save({"model": {"conv.weight": torch.arange(6.0).reshape(2, 3), "bn.num_batches_tracked": torch.tensor(3)},
                "iteration": 4, "epoch": 0.5, "seed": 1, "optimiser": {"state": {}, "param_groups": []}}, buffer)
    return buffer.getvalue()


CHECKPOINT = valid_checkpoint()


def check_checkpoint(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "ckpt-4.pt"
        path.write_bytes(data)
        for mmap in (False, True):
            state = loads_or_clean_error(load_checkpoint, path, mmap=mmap)
            if state is not None:
                assert isinstance(state, dict) and isinstance(state["model"], dict)


@fuzz(75)
@given(st.binary(max_size=200))
def test_checkpoint_random_bytes_fail_cleanly(data):
    check_checkpoint(data)


@fuzz(120)
@given(flips, st.one_of(st.none(), st.integers(0, len(CHECKPOINT))))
def test_checkpoint_damaged_file_loads_or_fails_cleanly(byte_flips, keep):
    check_checkpoint(mutate(CHECKPOINT, byte_flips, keep))


tensors = st.builds(lambda n: torch.zeros(n), st.integers(0, 3))
saveable = st.recursive(st.one_of(scalars, tensors),
                        lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                st.dictionaries(st.one_of(st.text(max_size=5), st.integers(0, 3)),
                                                                inner, max_size=3)),
                        max_leaves=6)


@fuzz(120)
@given(st.one_of(saveable, st.dictionaries(st.sampled_from(["model", "iteration", "epoch", "seed", "optimiser",
                                                            "ema", "rng", "loss_scaler"]), saveable, max_size=4)))
def test_checkpoint_of_foreign_content_loads_or_fails_cleanly(content):
    """torch.save of a non-dict, of a dict without "model", of one whose "model" is not a state dict,
    of entries of the wrong types."""
    buffer = io.BytesIO()
    torch.save(content, buffer)
    check_checkpoint(buffer.getvalue())


def test_checkpoint_of_a_pickled_object_is_refused_cleanly(tmp_path):
    path = tmp_path / "ckpt-1.pt"
    torch.save({"model": {"w": torch.zeros(1)}, "iteration": 1, "object": Path("x")}, path)
    with pytest.raises(CnnsError, match="other than tensors"):
        load_checkpoint(path)


def test_a_saved_checkpoint_loads(tmp_path):
    path = tmp_path / "ckpt-4.pt"
    save_checkpoint(path, torch.load(io.BytesIO(CHECKPOINT), weights_only=True))
    assert load_checkpoint(path)["iteration"] == 4


# ----------------------------------------------------------------------------------------------
# arguments.json
# ----------------------------------------------------------------------------------------------


def check_arguments(data: bytes) -> None:
    """read_run_options gives a dict or fails cleanly; a dict it gives then works for restore.py
    (RunConfig.from_options) and validation.py (options resolved again over the run's)."""
    from cnns.cli.runs import validate_main
    from cnns.config import RunConfig

    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "arguments.json").write_bytes(data)
        options = loads_or_clean_error(read_run_options, Path(folder))
        if options is not None:
            assert isinstance(options, dict)
            RunConfig.from_options(options)
            with contextlib.redirect_stdout(io.StringIO()):
                loads_or_clean_error(validate_main, ["--restore-path", folder, "--print-config"])


def arguments_of_a_run() -> dict:
    from cnns.cli import resolved_training_options

    options, _ = resolved_training_options("train", ["--dataset", "cifar-10", "--data-dir", "/x", "--seed", "1"])
    return json.loads(json.dumps(options, default=str))


ARGUMENTS = arguments_of_a_run()
json_values = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
                                     st.text(max_size=5)),
                           lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                   st.dictionaries(st.text(max_size=5), inner, max_size=3)),
                           max_leaves=5)


@fuzz(90)
@given(st.binary(max_size=60))
def test_arguments_json_random_bytes_fail_cleanly(data):
    check_arguments(data)


@fuzz(120)
@given(json_values)
def test_arguments_json_of_any_json_value_loads_or_fails_cleanly(value):
    check_arguments(json.dumps(value).encode())


@fuzz(120)
@given(st.sampled_from(sorted(ARGUMENTS)), json_values, st.booleans())
def test_arguments_json_with_a_damaged_option_loads_or_fails_cleanly(key, value, drop):
    arguments = dict(ARGUMENTS)
    if drop:
        del arguments[key]
    else:
        arguments[key] = value
    check_arguments(json.dumps(arguments).encode())


def test_arguments_json_deeply_nested_fails_cleanly(tmp_path):
    check_arguments(b"[" * 100_000 + b"]" * 100_000)
    check_arguments(b'{"a": ' * 100_000 + b"1" + b"}" * 100_000)


def test_arguments_json_of_a_run_loads(tmp_path):
    (tmp_path / "arguments.json").write_text(json.dumps(ARGUMENTS))
    assert read_run_options(tmp_path) == ARGUMENTS


# ----------------------------------------------------------------------------------------------
# What the fuzzing found, as plain regression tests
# ----------------------------------------------------------------------------------------------


def test_label_past_the_last_imagenet_class_is_a_data_error():
    with pytest.raises(CnnsError, match="image/class/label is 1001, expected a 1-based class label in 1..1000"):
        tfrecord_reader.parse_imagenet_example(tfrecord_reader.encode_imagenet_example(JPEG, 1001), "shard")
    assert tfrecord_reader.parse_imagenet_example(tfrecord_reader.encode_imagenet_example(JPEG, 1000), "shard")[1] == 999


def test_packed_floats_of_a_wrong_length_are_a_data_error():
    feature = tfrecord_reader._length_delimited(2, tfrecord_reader._length_delimited(1, b"12345"))
    entry = tfrecord_reader._length_delimited(1, tfrecord_reader._length_delimited(1, b"image/encoded")
                                       + tfrecord_reader._length_delimited(2, feature))
    with pytest.raises(CnnsError, match="malformed tf.train.Example \\(packed float list of 5 bytes"):
        tfrecord_reader.parse_imagenet_example(tfrecord_reader._length_delimited(1, entry), "shard")


def test_an_image_header_declaring_a_huge_size_is_refused_before_decoding():
    blob = bytearray(JPEG)
    at = blob.index(b"\xff\xc0") + 5
    blob[at:at + 4] = struct.pack(">HH", 65500, 2733)  # PIL raised DecompressionBombError here
    with pytest.raises(CnnsError, match="some.JPEG: cannot decode image \\(its header declares 2733 x 65500 pixels"):
        decode_rgb(bytes(blob), "some.JPEG")


def test_decoder_messages_are_short():
    with pytest.raises(CnnsError) as error:
        decode_rgb(JPEG[:100], "a.JPEG")
    assert str(error.value) == "a.JPEG: cannot decode image (Image is incomplete or truncated; PIL: Truncated File Read)"


def test_a_16_bit_png_decodes_to_8_bits():
    buffer = io.BytesIO()
    Image.fromarray(np.full((3, 5), 0x8123, dtype=np.uint16)).save(buffer, "PNG")
    image = decode_rgb(buffer.getvalue(), "deep.png")
    assert image.dtype == torch.uint8 and image.shape == (3, 3, 5) and int(image[0, 0, 0]) == 0x81


@pytest.mark.parametrize("text, message", [
    (b"\x80", "is not UTF-8 text"),
    (b"", "does not map configuration names to options"),
    (b"- a\n- b\n", "does not map configuration names to options"),
    (b"fuzzed:\n", "config 'fuzzed' in .* is not a mapping of option names to values"),
    (b"fuzzed: 5\n", "is not a mapping of option names to values"),
    (b"fuzzed: [model, resnet]\n", "is not a mapping of option names to values"),
    (b"fuzzed: {1: 2}\n", "is not a mapping of option names to values"),
    (b"1: {}\nb: {}\n", "unknown config 'fuzzed' .*available configs: 1, b"),
    (b"fuzzed: {epochs: 2001-13-45}\n", "is not valid YAML: month must be in 1..12"),
    (b"fuzzed: " + b"[" * 5000, "is not valid YAML"),
    (b"fuzzed: {micro_batch_size: [8]}\n", "micro_batch_size must be a single value, got \\[8\\]"),
    (b"fuzzed: {pipeline_splits: true}\n", "pipeline_splits must be a list"),
    (b"fuzzed: {batch_size: []}\n", "batch_size must be a single value"),
    (b"fuzzed: {epochs: {a: 1}}\n", "epochs must be a single value"),
    (b"fuzzed: {validation: 'no'}\n", "validation must be true or false"),
    (b"fuzzed: {precision: 16.16}\n", "precision must be one of '16.16', '16.32', '32.32', got 16.16"),
    (b"fuzzed: {weight_avg_N: [1, x]}\n", "weight_avg_N must be a list of integers"),
    (b"fuzzed: {batch_size: 4, micro_batch_size: 8}\n", "gives both batch_size and micro_batch_size"),
    (b"fuzzed: {epochs: 4, iterations: 8}\n", "gives both epochs and iterations"),
])
def test_bad_configs_yml_is_a_config_error(tmp_path, text, message):
    path = tmp_path / "configs.yml"
    path.write_bytes(text)
    with pytest.raises(CnnsError, match=message):
        load_named_config("fuzzed", path)


def test_every_configuration_of_the_repository_loads():
    from cnns.config import default_configs_path

    names = yaml.safe_load(default_configs_path().read_text())
    for name in names:
        assert isinstance(load_named_config(name), dict)


@pytest.mark.parametrize("data, message", [
    (b"\x80", r"is not UTF-8 text \(invalid start byte at byte 0\)"),
    (b"[]", "is not a JSON object of options"),
    (b"5", "is not a JSON object of options"),
    (b"{}", "lacks the option"),
    (b"[" * 100_000 + b"]" * 100_000, "is not valid JSON: maximum recursion depth exceeded"),
])
def test_bad_arguments_json_is_a_checkpoint_error(tmp_path, data, message):
    (tmp_path / "arguments.json").write_bytes(data)
    with pytest.raises(CnnsError, match=message):
        read_run_options(tmp_path)


def test_arguments_json_with_an_option_of_the_wrong_type_is_a_checkpoint_error(tmp_path):
    (tmp_path / "arguments.json").write_text(json.dumps({**ARGUMENTS, "micro_batch_size": "32"}))
    with pytest.raises(CnnsError, match="arguments.json: micro_batch_size must be an integer, got '32'"):
        read_run_options(tmp_path)


@pytest.mark.parametrize("entries, message", [
    ({"iteration": "4"}, "its 'iteration' entry is a str, not int"),
    ({"seed": 1.5}, "its 'seed' entry is a float, not int"),
    ({"optimiser": [1]}, "its 'optimiser' entry is a list, not dict"),
    ({"ema": {"w": 1}}, "its 'ema' entry is not a state dict"),
])
def test_checkpoint_entries_of_the_wrong_type_are_a_checkpoint_error(tmp_path, entries, message):
    path = tmp_path / "ckpt-1.pt"
    torch.save({"model": {"w": torch.zeros(1)}, **entries}, path)
    with pytest.raises(CnnsError, match=message):
        load_checkpoint(path)


def test_an_unknown_model_in_configs_yml_is_one_line_naming_the_models(tmp_path, capfd):
    """--model takes any timm name (cnns.models' registry), so the file's value is checked where the options are
    resolved, as the command line's is: one line, exit 2, before anything is written."""
    from scripts import run_here

    (tmp_path / "configs.yml").write_text("fuzzed: {model: foo}\n")
    done = run_here(capfd, "train.py", "--config", "fuzzed", "--config-path", str(tmp_path / "configs.yml"),
                    "--generated-data", "--dataset", "cifar-10", "--print-config", cwd=tmp_path, expect=2)
    assert "unknown model 'foo'" in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not (tmp_path / "logs").exists()
