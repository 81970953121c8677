"""cnns predict: a trained run's model classifies image files (PNG, JPEG, folders), top-k with names."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

import scripts
import torch
from torchvision.io import encode_jpeg, encode_png

from cnns.cli.inference import predict_main, restored_run
from cnns.data.drawn_shapes import BUILTIN_CLASSES, draw_shapes
from cnns.errors import CnnsError
from cnns.runfolder.checkpoint import list_checkpoints, load_checkpoint, save_checkpoint

HELD_OUT = 100
# torchvision 0.29 deprecates its image codecs (used here to write the test images), warning per call.
pytestmark = [pytest.mark.filterwarnings("ignore:The image decoding and encoding capabilities:DeprecationWarning"),
              # every test here reads the trained run: one test worker trains it once (`--dist loadgroup`)
              scripts.ON_THE_PLATEAU_RUN]
LINE = re.compile(r"^(?P<path>.+?): (?P<entries>.+)$")
ENTRY = re.compile(r"^(?P<label>.+) \((?P<p>[0-9.]+)\)$")


@pytest.fixture(scope="session")
def run_folder(plateau_run_32) -> Path:
    """A ResNet-8 trained to its plateau on 2,000 drawn-shape images in CIFAR-10 format, with a moving average of
    its weights and the class names of CIFAR-10's archive (conftest's `plateau_run_32`). About 89 % on its
    1,000 test images."""
    return plateau_run_32


@pytest.fixture(scope="session")
def held_out(tmp_path_factory) -> tuple[Path, list[str]]:
    """100 new drawings (a seed training never saw) as PNG files, and their true class names."""
    folder = tmp_path_factory.mktemp("held-out")
    images, labels = draw_shapes(HELD_OUT, seed=12345)
    names = []
    for index in range(HELD_OUT):
        (folder / f"{index:03d}.png").write_bytes(encode_png(images[index].permute(2, 0, 1).contiguous()).numpy())
        names.append(BUILTIN_CLASSES[int(labels[index])])
    return folder, names


@pytest.fixture(scope="session")
def photos(tmp_path_factory) -> Path:
    """scikit-learn's two sample photographs (427 x 640), each as JPEG and as PNG."""
    from sklearn.datasets import load_sample_images

    folder = tmp_path_factory.mktemp("photos")
    sample = load_sample_images()
    for filename, array in zip(sample.filenames, sample.images):
        stem = Path(filename).stem
        chw = torch.from_numpy(np.array(array)).permute(2, 0, 1).contiguous()
        (folder / f"{stem}.jpg").write_bytes(encode_jpeg(chw, quality=90).numpy())
        (folder / f"{stem}.png").write_bytes(encode_png(chw).numpy())
    return folder


def predict(capsys, *argv: str) -> tuple[int, str, str]:
    code = predict_main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def parse_lines(out: str) -> dict[str, list[tuple[str, float]]]:
    """{path: [(label, probability), ...]} from the plain output."""
    parsed = {}
    for line in out.splitlines():
        match = LINE.match(line)
        assert match, line
        entries = []
        for entry in match["entries"].split(", "):
            found = ENTRY.match(entry)
            assert found, line
            entries.append((found["label"], float(found["p"])))
        parsed[match["path"]] = entries
    return parsed


def accuracy(parsed: dict[str, list[tuple[str, float]]], folder: Path, names: list[str]) -> float:
    correct = sum(parsed[str(folder / f"{i:03d}.png")][0][0] == names[i] for i in range(len(names)))
    return correct / len(names)


def test_held_out_drawings_are_mostly_predicted_correctly_with_the_runs_class_names(run_folder, held_out, capsys):
    folder, names = held_out
    code, out, err = predict(capsys, "--restore-path", str(run_folder), str(folder))
    assert code == 0, err
    parsed = parse_lines(out)
    assert len(parsed) == HELD_OUT  # every file of the folder, once
    assert list(parsed) == sorted(parsed)  # in path order
    for entries in parsed.values():
        assert len(entries) == 5 and all(label in BUILTIN_CLASSES for label, _ in entries)
        probabilities = [p for _, p in entries]
        assert probabilities == sorted(probabilities, reverse=True) and sum(probabilities) <= 1.0 + 5e-4
    top1 = accuracy(parsed, folder, names)
    print(f"held-out top-1 accuracy (raw weights): {top1:.0%}")
    # Measured 89% (the run's own validation: 89%); chance is 10%, an untrained ResNet-8 ~10%.
    # Measured 85-89 % on the AVX-512 EPYC; float32 training takes other roundings on other CPUs, so a few
    # points of margin; an untrained or wrongly preprocessed model scores about 10 %.
    assert top1 >= 0.75, top1
    assert "batches.meta.txt" in err  # where the names came from


def test_moving_average_weights_predict_as_well(run_folder, held_out, capsys):
    folder, names = held_out
    code, out, err = predict(capsys, "--restore-path", str(run_folder), "--weights", "ema", "--top-k", "1",
                             str(folder))
    assert code == 0, err
    parsed = parse_lines(out)
    assert all(len(entries) == 1 for entries in parsed.values())
    top1 = accuracy(parsed, folder, names)
    print(f"held-out top-1 accuracy (EMA weights): {top1:.0%}")
    # Measured 85-89 % on the AVX-512 EPYC; float32 training takes other roundings on other CPUs, so a few
    # points of margin; an untrained or wrongly preprocessed model scores about 10 %.
    assert top1 >= 0.75, top1


def test_a_checkpoint_file_gives_the_same_predictions_as_its_run_folder(run_folder, held_out, capsys):
    folder, _ = held_out
    files = [str(folder / f"{i:03d}.png") for i in range(8)]
    newest = list_checkpoints(run_folder)[-1][1]
    _, by_folder, _ = predict(capsys, "--restore-path", str(run_folder), "--json", "--batch-size", "3", "--top-k", "10",
                              *files)
    _, by_file, _ = predict(capsys, "--restore-path", str(newest), "--json", "--top-k", "10", *files)

    def probabilities(out: str) -> list[tuple[str, dict[str, float]]]:
        rows = [json.loads(line) for line in out.splitlines()]
        return [(row["path"], {entry["label"]: entry["probability"] for entry in row["top_k"]}) for row in rows]

    # Batches of 3 and of 8 run other convolution kernels (oneDNN chooses by shape), which sum in another
    # order: float32 rounding, not exactness. Reordering a sum of K products moves it by at most about
    # K x 2^-24 of the sum of their magnitudes; the widest layer here sums K = 3 x 3 x 64 = 576, so each
    # of ResNet-8's 8 layers adds at most ~3.4e-5 relative, ~3e-4 over the network: about 3e-3 on logits
    # of magnitude 10, and half of that on a probability (dp/dlogit <= 1/4, two logits move). All ten
    # classes are compared, so a near tie cannot reorder which ones are printed.
    folder_rows, file_rows = probabilities(by_folder), probabilities(by_file)
    assert [path for path, _ in folder_rows] == [path for path, _ in file_rows] == files
    for (_, ours), (_, theirs) in zip(folder_rows, file_rows):
        assert ours.keys() == theirs.keys() == set(BUILTIN_CLASSES)
        for label, probability in ours.items():
            assert probability == pytest.approx(theirs[label], abs=1.5e-3)


def test_photographs_in_jpeg_and_png_get_top_k_lines(run_folder, photos, capsys):
    code, out, err = predict(capsys, "--restore-path", str(run_folder), "--top-k", "3", str(photos))
    assert code == 0, err
    parsed = parse_lines(out)
    assert sorted(Path(path).name for path in parsed) == ["china.jpg", "china.png", "flower.jpg", "flower.png"]
    for entries in parsed.values():
        assert len(entries) == 3 and all(label in BUILTIN_CLASSES for label, _ in entries)
        assert 0.0 < sum(p for _, p in entries) <= 1.0 + 5e-4


def test_a_photo_is_predicted_alike_from_its_png_and_its_jpeg(run_folder, photos, capsys):
    """Bringing a photo to 32 x 32 (short side to 32, centre crop) does not depend on its file format beyond
    JPEG's loss. So: (1) the two files' model inputs agree within that loss, and (2) the printed probabilities
    of every class agree within what that input difference can move them. (2)'s bound is the model's own:
    p(x_jpeg) - p(x_png) is the integral of the directional derivative of p along the segment between the
    inputs, so its size is at most the largest directional derivative there, read by autograd at points
    along the segment (x2 for the points between them). An argmax would not do: the shapes model barely
    tells some photos' top two classes apart, and which one wins is decided by JPEG's loss and the CPU's
    rounding."""
    from cnns.commands.predict import evaluation_transform
    from cnns.deploy.restored_model import restore_model

    checkpoint, cfg = restored_run(str(run_folder))
    restored = restore_model(checkpoint, cfg)
    transform = evaluation_transform(restored.cfg)
    for stem in ("china", "flower"):
        png, jpeg = (photos / f"{stem}.png", photos / f"{stem}.jpg")
        x_png, x_jpeg = (transform(path.read_bytes(), str(path)).float() for path in (png, jpeg))
        # Quality 90 moves a 427 x 640 photo's pixels by a few levels; averaged down to 32 x 32, less (measured:
        # 0.19 levels on average, 4 at most, for china). The bounds leave room for other decoders' IDCTs.
        difference = (x_jpeg - x_png).abs()
        assert difference.mean() <= 2.0 and difference.max() <= 24, (difference.mean(), difference.max())

        mean, std = torch.tensor(restored.mean), torch.tensor(restored.std)

        def probabilities(x: torch.Tensor) -> torch.Tensor:  # x: float [32, 32, 3] in levels, as predict normalises
            inputs = ((x / 255 - mean) / std).permute(2, 0, 1).unsqueeze(0)
            return torch.softmax(restored.model(inputs.contiguous(memory_format=torch.channels_last)).float(), dim=1)[0]

        slopes = []
        for t in torch.linspace(0, 1, 9):
            point = (x_png + t * (x_jpeg - x_png)).requires_grad_()
            p = probabilities(point)
            slopes.append(torch.stack([torch.autograd.grad(p[c], point, retain_graph=True)[0].mul(x_jpeg - x_png).sum()
                                       for c in range(len(p))]).abs())
        # + 1.5e-3: predict's batch of two runs other kernels than the test's batch of one (the float32
        # rounding bound derived in the test above).
        bound = 2 * torch.stack(slopes).amax(dim=0) + 1.5e-3
        _, out, _ = predict(capsys, "--restore-path", str(run_folder), "--json", "--top-k", "10", str(png), str(jpeg))
        rows = [{entry["class"]: entry["probability"] for entry in json.loads(line)["top_k"]} for line in out.splitlines()]
        with torch.no_grad():  # the model here is the one predict ran (float32 rounding apart: see above)
            assert [rows[0][c] for c in range(len(bound))] == pytest.approx(probabilities(x_png).tolist(), abs=1.5e-3)
        for c in range(len(bound)):
            assert abs(rows[0][c] - rows[1][c]) <= bound[c], (stem, c, rows[0][c], rows[1][c], float(bound[c]))


def test_json_lines_parse(run_folder, photos, capsys):
    code, out, _ = predict(capsys, "--restore-path", str(run_folder), "--json", "--top-k", "10",
                           str(photos / "china.jpg"), str(photos / "flower.png"))
    assert code == 0
    records = [json.loads(line) for line in out.splitlines()]
    assert [record["path"] for record in records] == [str(photos / "china.jpg"), str(photos / "flower.png")]
    for record in records:
        top = record["top_k"]
        assert len(top) == 10 and sorted(entry["class"] for entry in top) == list(range(10))
        for entry in top:
            assert entry["label"] == BUILTIN_CLASSES[entry["class"]] and 0.0 <= entry["probability"] <= 1.0
        assert abs(sum(entry["probability"] for entry in top) - 1.0) < 1e-4  # all ten classes: the whole softmax


def test_a_corrupt_image_is_named_and_the_others_are_still_predicted(run_folder, held_out, tmp_path, capsys):
    source, _ = held_out
    folder = tmp_path / "mixed"
    (folder / "sub").mkdir(parents=True)
    for index in range(3):
        (folder / f"{index}.png").write_bytes((source / f"{index:03d}.png").read_bytes())
    (folder / "sub" / "3.png").write_bytes((source / "003.png").read_bytes())
    (folder / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n this is not an image")
    (folder / "notes.txt").write_text("not an image file: skipped by extension")
    code, out, err = predict(capsys, "--restore-path", str(run_folder), str(folder))
    assert code == 1
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: cannot decode {folder / 'broken.png'}: "), err
    assert sorted(parse_lines(out)) == sorted(str(p) for p in [folder / "0.png", folder / "1.png", folder / "2.png",
                                                              folder / "sub" / "3.png"])


def one_image(folder: Path) -> Path:
    image = folder / "one.png"
    images, _ = draw_shapes(1, seed=3)
    image.write_bytes(encode_png(images[0].permute(2, 0, 1).contiguous()).numpy())
    return image


def test_ema_weights_of_a_checkpoint_without_them_is_one_line_error(run_folder, tmp_path, capsys):
    newest = list_checkpoints(run_folder)[-1][1]
    state = load_checkpoint(newest)
    del state["ema"]
    copy = tmp_path / "no-ema"
    copy.mkdir()
    (copy / "arguments.json").write_text((run_folder / "arguments.json").read_text())
    save_checkpoint(copy / newest.name, state)
    image = one_image(tmp_path)
    with pytest.raises(CnnsError) as raised:
        predict_main(["--restore-path", str(copy), "--weights", "ema", str(image)])
    message = str(raised.value)
    assert "\n" not in message and str(copy / newest.name) in message and "--ema-decay" in message
    # The raw weights of that checkpoint still predict.
    assert predict(capsys, "--restore-path", str(copy), str(image))[0] == 0


@pytest.mark.parametrize("argv, text", [
    (["--top-k", "0", "x.png"], "--top-k"),
    (["missing-image.png"], "missing-image.png"),
])
def test_bad_input_is_a_one_line_error(run_folder, argv, text):
    with pytest.raises(CnnsError, match=re.escape(text)):
        predict_main(["--restore-path", str(run_folder), *argv])


def test_an_empty_folder_and_a_folder_without_arguments_json_are_refused(run_folder, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(CnnsError, match="no image files"):
        predict_main(["--restore-path", str(run_folder), str(tmp_path / "empty")])
    (tmp_path / "ckpt-1.pt").write_bytes(b"")
    with pytest.raises(CnnsError, match="arguments.json"):
        predict_main(["--restore-path", str(tmp_path), str(one_image(tmp_path))])


def test_a_relative_data_dir_is_found_from_where_training_ran(run_folder, tmp_path, capsys):
    """arguments.json keeps --data-dir as given; a run folder copied with its data keeps its names."""
    copy = tmp_path / "logs" / run_folder.name
    copy.mkdir(parents=True)
    newest = list_checkpoints(run_folder)[-1][1]
    (copy / newest.name).write_bytes(newest.read_bytes())
    arguments = json.loads((run_folder / "arguments.json").read_text())
    arguments.update(data_dir="shapes", log_dir="logs")
    (copy / "arguments.json").write_text(json.dumps(arguments))
    (tmp_path / "shapes").mkdir()
    (tmp_path / "shapes" / "batches.meta.txt").write_text("\n".join(n.upper() for n in BUILTIN_CLASSES) + "\n")
    code, out, err = predict(capsys, "--restore-path", str(copy), str(one_image(tmp_path)))
    assert code == 0, err
    labels = [label for label, _ in parse_lines(out)[str(tmp_path / "one.png")]]
    assert labels and all(label in [n.upper() for n in BUILTIN_CLASSES] for label in labels)


def test_the_run_folder_reads_back_what_training_wrote(run_folder):
    """cnns.runfolder.run_folder.RunFolder, the object every later command starts from: its options, checkpoints in
    iteration order, raw and moving-average weights, and the class names of its data folder."""
    import torch

    from cnns.runfolder.checkpoint import iteration_of
    from cnns.runfolder.run_folder import RunFolder

    run = RunFolder.open(run_folder)
    assert run.options["model_size"] == "8" and run.config.model.num_classes == 10
    checkpoints = run.checkpoints()
    iterations = [iteration_of(path) for path in checkpoints]
    assert iterations == sorted(iterations) and iterations[-1] > 0 and run.newest_checkpoint() == checkpoints[-1]
    raw, ema = run.weights(), run.weights(which="ema")
    assert raw.keys() == ema.keys()
    assert any(not torch.equal(raw[key], ema[key]) for key in raw if raw[key].is_floating_point())
    assert run.class_names() == (list(BUILTIN_CLASSES), str(Path(run.config.data.data_dir) / "batches.meta.txt"))
    # predict and export see the run as validation.py resolves it: one process, the run's model and batch.
    _, evaluation = restored_run(str(run_folder))
    assert evaluation.parallel.replicas == 1 and evaluation.model == run.config.model
    assert evaluation.train.global_batch_size == run.options["global_batch_size"]
