"""`cnns bench-data`: the input pipeline alone on each layout, the account of one image's time, the
torchvision baseline beside it, and the synthetic JPEG tree it can write; train.py --dataset-benchmark.
Tiny sizes: these check behaviour, never speed."""

from __future__ import annotations

import io
import json
import multiprocessing
import struct
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, JpegImagePlugin

from cnns.cli.measure import bench_data_main as bench_data_command
from cnns.data.jpegtree import make_jpeg_tree
from cnns.data.photos import IMAGENET_LIKE_SIZES, JPEG_QUALITIES, photo_like_jpeg
from cnns.errors import ConfigError
from test_tfrecord import reference_masked_crc

TINY = ["--batch-size", "2", "--batches", "2", "--warmup-batches", "1", "--image-size", "32", "--no-account"]


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("jpeg-tree")
    make_jpeg_tree(root, images=8, classes=2, validation_images=4, processes=1)
    return root


def quality_of(image: Image.Image) -> int | None:
    """The PIL quality whose luminance table `image` was saved with (None if no quality 1-100 gives it)."""
    tables = {}
    for quality in range(1, 101):
        buffer = io.BytesIO()
        Image.new("RGB", (8, 8)).save(buffer, "JPEG", quality=quality)
        tables[tuple(Image.open(buffer).quantization[0])] = quality
    return tables.get(tuple(image.quantization[0]))


def test_jpeg_tree_is_imagenet_like_and_reproducible(tree, tmp_path):
    files = sorted((tree / "train").glob("*/*.JPEG"))
    assert len(files) == 8 and len(list((tree / "validation").glob("*/*.JPEG"))) == 4
    assert sorted(p.name for p in (tree / "train").iterdir()) == ["n00000000", "n00000001"]
    for path in files:
        with Image.open(path) as image:
            assert image.format == "JPEG" and image.mode == "RGB" and image.size in IMAGENET_LIKE_SIZES
            assert JpegImagePlugin.get_sampling(image) == 2  # 4:2:0 chroma
            assert quality_of(image) in JPEG_QUALITIES
            decoded = np.asarray(image.convert("RGB"))
        assert decoded.shape == (image.size[1], image.size[0], 3) and decoded.std() > 10  # decodes, not flat
    again = make_jpeg_tree(tmp_path, images=8, classes=2, validation_images=4, processes=1)
    assert again["bytes"] > 0 and (tmp_path / "train" / files[0].parent.name / files[0].name).read_bytes() \
        == files[0].read_bytes()
    assert make_jpeg_tree(tree, images=8, classes=2, validation_images=4)["bytes"] == 0  # kept, not rewritten


def test_jpeg_tree_bytes_are_imagenet_like():
    """docs/performance.md states the tree's mean size and bytes (about 460 x 425 px, about 95 KB). The images are a
    pure function of (seed, index), so these figures are exact for the first 40 images: the mean lies
    within 20 % of 95 KB (the sizes' spread, about 40 KB, puts a 40-image mean's standard error near 6 KB),
    and every file between 15 KB (a small smooth image at quality 90) and 400 KB (an 800 x 600 textured one
    at 96)."""
    sizes = [len(photo_like_jpeg(0, index)) for index in range(40)]
    assert 0.8 * 95_000 < np.mean(sizes) < 1.2 * 95_000
    assert all(15_000 < size < 400_000 for size in sizes)


def test_bench_data_times_both_pipelines_at_each_worker_count(tree, tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert bench_data_command(["--data-dir", str(tree), "--workers", "0", "1", "--compare-baseline",
                               "--json", str(out), *TINY]) == 0
    printed = capsys.readouterr().out
    comparisons = json.loads(out.read_text())["comparisons"]
    assert [(c["cnns"]["workers"], c["torchvision"]["workers"]) for c in comparisons] == [(0, 0), (1, 1)]
    for c in comparisons:
        ours, theirs = c["cnns"], c["torchvision"]
        assert ours["pipeline"] == "cnns" and theirs["pipeline"] == "torchvision"
        assert all(m["images"] == 4 and m["images_per_second"] > 0 and m["layout"] == "folder" for m in (ours, theirs))
        assert c["ratio"] == pytest.approx(ours["images_per_second"] / theirs["images_per_second"])
    assert "| pipeline | data | transforms | workers |" in printed and "| torchvision | folder | train | 1 |" in printed
    assert printed.count("x |") == 4  # a ratio on every row
    assert "| images/s | per worker core |" in printed
    assert multiprocessing.active_children() == []  # the workers were shut down


def test_bench_data_makes_its_tree_and_measures_evaluation_transforms(tmp_path, capsys):
    target = tmp_path / "made"
    assert bench_data_command(["--make-jpeg-tree", str(target), "--images", "4", "--classes", "2",
                               "--eval", "--workers", "0", *TINY]) == 0
    printed = capsys.readouterr().out
    assert len(list((target / "train").glob("*/*.JPEG"))) == 4
    assert "| cnns | folder | eval | 0 | 2 | 32 |" in printed


def read_framed_records(path: Path) -> list[bytes]:
    """The records of a TFRecord file, each CRC checked against the bitwise reference."""
    blob, records, position = path.read_bytes(), [], 0
    while position < len(blob):
        (length,) = struct.unpack_from("<Q", blob, position)
        assert struct.unpack_from("<I", blob, position + 8)[0] == reference_masked_crc(blob[position:position + 8])
        data = blob[position + 12:position + 12 + length]
        assert struct.unpack_from("<I", blob, position + 12 + length)[0] == reference_masked_crc(data)
        records.append(data)
        position += 16 + length
    return records


def test_tfrecord_layout_holds_the_same_jpegs_as_the_tree(tree, tmp_path, capsys):
    from cnns.data.tfrecord_reader import parse_imagenet_example

    records = tmp_path / "records"
    assert bench_data_command(["--make-jpeg-tree", str(records), "--layout", "tfrecord", "--images", "8",
                               "--classes", "2", "--workers", "0", *TINY]) == 0
    assert "| cnns | tfrecord | train | 0 | 2 | 32 |" in capsys.readouterr().out
    assert sorted(p.name for p in records.iterdir()) == ["train-00000-of-00001", "validation-00000-of-00001"]
    for index, record in enumerate(read_framed_records(records / "train-00000-of-00001")):
        image, label = parse_imagenet_example(record, "test")
        assert label == index % 2
        assert image == (tree / "train" / f"n{label:08d}" / f"train_{index:07d}.JPEG").read_bytes()
    with pytest.raises(ConfigError, match="--compare-baseline needs a JPEG folder tree"):
        bench_data_command(["--data-dir", str(records), "--compare-baseline", *TINY])


def test_bench_data_on_cifar_runs_in_the_main_process(tmp_path, capsys):
    from cnns.data.drawn_shapes import draw_shapes
    from cnns.data.cifar_records import write_cifar10

    cifar = tmp_path / "cifar"
    images, labels = draw_shapes(20, seed=0)
    write_cifar10(cifar, (images[:12], labels[:12]), (images[12:], labels[12:]))
    assert bench_data_command(["--data-dir", str(cifar), "--batch-size", "4", "--batches", "5"]) == 0
    printed = capsys.readouterr().out
    assert "(no workers)" in printed and "| cnns | cifar-10 | train | 0 | 4 | 32 |" in printed


def test_bench_data_needs_data(monkeypatch):
    monkeypatch.delenv("DATA_DIR", raising=False)
    with pytest.raises(ConfigError, match="--data-dir"):
        bench_data_command(["--batches", "1"])


def test_ratio_is_the_median_of_the_ratios_within_rounds():
    from cnns.bench.data import Measurement, compare_rounds

    def measured(pipeline: str, images_per_second: int) -> Measurement:
        return Measurement(pipeline, "folder", "train", 1, 32, 224, images_per_second, 1.0, 0.0)

    # The machine got busier after round 1: both pipelines slowed down together.
    ours = [measured("cnns", 800), measured("cnns", 400), measured("cnns", 420)]
    theirs = [measured("torchvision", 500), measured("torchvision", 250), measured("torchvision", 400)]
    comparison = compare_rounds(ours, theirs)
    assert comparison.cnns.images_per_second == 420 and comparison.baseline.images_per_second == 400
    assert comparison.ratio == pytest.approx(1.6)  # round ratios 1.6, 1.6, 1.05 (the medians' ratio is 1.05)


def printed_order(printed: str) -> list[str]:
    """The pipelines in the order their measurements were printed ("  cnns        workers 0: ...")."""
    return [line.split()[0] for line in printed.splitlines() if line.startswith("  ") and " workers " in line]


def test_comparison_alternates_the_pipelines_round_by_round(tree, capsys):
    assert bench_data_command(["--data-dir", str(tree), "--workers", "0", "--compare-baseline", "--rounds", "3",
                               *TINY]) == 0
    # Each round measures both; the one measured second in a round goes first in the next, so neither always
    # runs on a machine the other has just warmed (or loaded).
    assert printed_order(capsys.readouterr().out) == ["cnns", "torchvision", "torchvision", "cnns", "cnns",
                                                      "torchvision"]


ACCOUNT_ROWS = ("read", "header", "decode", "resize", "flip", "between", "into the batch", "across")


def test_account_splits_one_image_into_stages_that_add_up(tree, tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert bench_data_command(["--data-dir", str(tree), "--workers", "1", "--compare-baseline", "--account",
                               "--account-images", "100", "--json", str(out),
                               *[a for a in TINY if a != "--no-account"]]) == 0
    printed = capsys.readouterr().out
    account = json.loads(out.read_text())["account"]
    stages = account["stage_nanoseconds"]
    assert stages["images"] == 8  # --account-images beyond the split: each training image once
    for stage in ("read", "header", "decode", "resize", "flip"):
        assert stages[stage] > 0, stage
    # The stages are timed inside each image's step, so their sum cannot exceed the step's time; what lies
    # between them is a few Python statements per image (microseconds against a decode's hundreds). The
    # machine can only push the gap up by preempting this process inside those statements, which hold
    # under a few percent of the step's time: a quarter of the step is a wide margin for that.
    summed = sum(stages[stage] for stage in ("read", "header", "decode", "resize", "flip"))
    assert 0.75 * stages["step"] <= summed <= stages["step"]
    seconds = account["seconds_per_image"]
    assert list(seconds) == list(ACCOUNT_ROWS)
    assert seconds["between"] >= 0
    # "into the batch" and "across" are differences of rates measured one after the other, so they carry the
    # machine's drift and may come out below zero on a shared machine: their sum with the stages is what is
    # defined, the delivered per-image time (to float rounding).
    assert sum(seconds.values()) == pytest.approx(account["delivered_seconds"], rel=1e-9)
    assert account["delivered_seconds"] == pytest.approx(1 / account["one_worker_images_per_second"])
    assert account["decode_only_seconds"] > 0 and account["baseline_images_per_second"] > 0
    for label in ("read (the file's bytes)", "header + crop draw", "decode (", "crop + resize", "| flip |",
                  "into the batch", "across to the main process", "the loader, 1 worker: delivered",
                  "decode-only cap: the whole image", "torchvision ImageFolder + PIL loader, 1 worker"):
        assert label in printed, label
    assert "images/s per worker core" in printed and "x the decode-only cap" in printed
    assert multiprocessing.active_children() == []


def test_account_times_the_fallback_decoder_step_by_step(tree):
    """Where the native decoder is not built the worker decodes the whole image with TorchCodec, then crops,
    resizes and flips with torch (the flip as it resizes): the account times those steps of the worker's own
    decoding instead of the native call's clocks."""
    from cnns.bench.data import time_stages
    from cnns.data.decoding import ImageDecoder
    from cnns.data.formats import records_in
    from cnns.data.image_loader import ImageNetTransform

    dataset = records_in(tree, "train")
    transform = ImageNetTransform(True, 32, seed=0, decoder=ImageDecoder(use_native=False))
    stages = time_stages(dataset, range(len(dataset)), transform)
    assert stages.images == len(dataset) == stages.whole
    assert all(getattr(stages, stage) > 0 for stage in ("read", "header", "decode", "resize")) and stages.flip == 0
    assert stages.stages <= stages.step


def test_account_on_tfrecords_reads_records_and_eval_has_no_flip(tmp_path, capsys):
    records = tmp_path / "records"
    make_jpeg_tree(records, images=6, classes=2, validation_images=4, processes=1, layout="tfrecord")
    assert bench_data_command(["--data-dir", str(records), "--eval", "--workers", "1", "--account-images", "4",
                               *[a for a in TINY if a != "--no-account"]]) == 0
    printed = capsys.readouterr().out
    assert "| read (the TFRecord record's image bytes) |" in printed and "| flip | - | - | |" in printed


def test_dataset_benchmark_names_the_decoder_and_the_rate_per_worker_core(tree, tmp_path, capsys, monkeypatch):
    from cnns.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["train", "--dataset", "imagenet", "--data-dir", str(tree), "--image-size", "48",
                 "--micro-batch-size", "2", "--iterations", "4", "--pipeline-num-parallel", "1",
                 "--dataset-benchmark"]) == 0
    printed = capsys.readouterr().out
    assert "Images decoded by " in printed
    assert "1 worker: " in printed and " images/sec per worker core" in printed
    assert not (tmp_path / "logs").exists()
    assert multiprocessing.active_children() == []


def test_bench_data_names_the_decoder_and_refuses_gpu_decoding_without_a_gpu(tree, capsys):
    assert bench_data_command(["--data-dir", str(tree), "--workers", "0", *TINY]) == 0
    assert "Images decoded by " in capsys.readouterr().out
    with pytest.raises(ConfigError, match="--decode-device cuda needs a run on a CUDA GPU"):
        bench_data_command(["--data-dir", str(tree), "--decode-device", "cuda", *TINY])


def test_account_measures_torchvision_in_its_rounds_when_the_comparison_did_not(tree, capsys):
    assert bench_data_command(["--data-dir", str(tree), "--workers", "0", "--account", "--account-images", "4",
                               "--rounds", "2", *[a for a in TINY if a != "--no-account"]]) == 0
    printed = capsys.readouterr().out
    # The comparison at 0 workers (2 rounds), then the account's measurements (in this process stage by stage,
    # decode-only, the loaders), the order reversed in round 2.
    measured = [line.split()[0] for line in printed.splitlines() if line.startswith("  ")]
    account_round = ["in", "decode-only", "cnns", "cnns", "torchvision"]
    assert measured == ["cnns", "cnns"] + account_round + account_round[::-1]
    assert "torchvision ImageFolder + PIL loader, 1 worker" in printed


def test_scaling_is_each_worker_count_against_one_worker():
    from cnns.bench.data import Comparison, Measurement, scaling_lines

    def measured(workers: int, images_per_second: float) -> Comparison:
        return Comparison(Measurement("cnns", "folder", "train", workers, 32, 224, images_per_second, 1.0, 0.0),
                          None, None)

    assert scaling_lines([measured(1, 400), measured(2, 760), measured(4, 1400)]) == [
        "cnns with 2 workers: 1.90x one worker", "cnns with 4 workers: 3.50x one worker"]
    assert scaling_lines([measured(2, 760)]) == []  # no one-worker measurement to compare with
