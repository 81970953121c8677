"""Your own images, a head start, and weights timm loads: the class count from a folder tree,
`--init-path` fine-tuning, and `cnns export --format safetensors` read back by timm.

The images are scikit-learn's handwritten digits (bundled with it, nothing downloaded), written as a
PNG folder tree: train/<digit>/ and validation/<digit>/.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from cnns.cli import run_script as run_command
from model_kinds import TIMM

pytestmark = pytest.mark.filterwarnings("ignore:The image decoding and encoding capabilities:DeprecationWarning")
# The tests that start from the trained run share one test worker (`--dist loadgroup`), and the run is a
# session fixture: a module fixture is made again when the worker runs another module's tests in between.
ON_THE_TRAINED_RUN = pytest.mark.xdist_group("test_weights-pretrained")

# ResNet-18 (timm's resnet18) on 40 px digits, float32, batch norm, seeded.
RESNET18 = ["--model", "resnet", "--model-size", "18", "--dataset", "imagenet", "--image-size", "40", "--batch-norm",
            "--precision", "32.32", "--optimiser", "momentum", "--lr-schedule", "cosine",
            "--base-learning-rate-exponent", "-9", "--pipeline-num-parallel", "0", "--ckpts-per-epoch", "0",
            "--logs-per-epoch", "1"]


def digits_tree(root: Path, digits: list[int], train_per_class: int, validation_per_class: int) -> Path:
    """8x8 digits scaled 4x into 36x36 RGB PNGs, the first of each class for training, the next for validation."""
    from sklearn.datasets import load_digits

    digits_data = load_digits()
    seen = {d: 0 for d in digits}
    for index, (image, label) in enumerate(zip(digits_data.images, digits_data.target)):
        if label not in seen or seen[label] >= train_per_class + validation_per_class:
            continue
        split = "train" if seen[label] < train_per_class else "validation"
        seen[label] += 1
        folder = root / split / f"digit{label}"
        folder.mkdir(parents=True, exist_ok=True)
        pixels = np.pad(np.kron((image * 255 / 16).astype(np.uint8), np.ones((4, 4), np.uint8)), 2)
        Image.fromarray(np.stack([pixels] * 3, axis=-1)).save(folder / f"{index}.png")
    return root


@pytest.fixture(scope="session")
def digits(tmp_path_factory) -> Path:
    return digits_tree(tmp_path_factory.mktemp("digits"), list(range(10)), 120, 40)


@pytest.fixture(scope="session")
def pretrained(digits, tmp_path_factory) -> Path:
    """A ResNet-18 trained on the ten digits: 6 epochs, 86.5 % validation accuracy (measured)."""
    folder = tmp_path_factory.mktemp("runs") / "digits"
    assert run_command("train", [*RESNET18, "--data-dir", str(digits), "--micro-batch-size", "32", "--epochs", "6",
                                 "--warmup-epochs", "1", "--seed", "1", "--logs-path", str(folder)]) == 0
    return folder


def validation_accuracy(folder: Path) -> float:
    rows = (folder / "validation.csv").read_text().splitlines()
    header = rows[0].split(",")
    return float(rows[-1].split(",")[header.index("val_acc")])


# ---------------------------------------------------------------------------------------------
# The class count from the data


@ON_THE_TRAINED_RUN
def test_the_digits_give_ten_outputs_and_the_run_records_them(pretrained):
    options = json.loads((pretrained / "arguments.json").read_text())
    assert options["num_classes"] == 10
    state = torch.load(pretrained / "ckpt-225.pt", weights_only=True)["model"]
    assert state["fc.weight"].shape == (10, 512)
    assert validation_accuracy(pretrained) > 60.0  # it learned the digits (chance: 10 %)


# ---------------------------------------------------------------------------------------------
# --init-path


@pytest.fixture(scope="module")
def five_digits(tmp_path_factory) -> Path:
    """A small new task: digits 0-4 only, 8 training images of each."""
    return digits_tree(tmp_path_factory.mktemp("five-digits"), list(range(5)), 8, 40)


def fine_tune(five_digits: Path, folder: Path, *init: str, length: tuple[str, ...] = ("--epochs", "4")) -> int:
    return run_command("train", [*RESNET18, "--data-dir", str(five_digits), "--micro-batch-size", "8", *length,
                                 "--warmup-epochs", "0", "--seed", "2", "--logs-path", str(folder), *init])


@ON_THE_TRAINED_RUN
def test_fine_tuning_from_a_run_learns_a_new_task_faster_than_from_scratch(pretrained, five_digits, tmp_path, capsys):
    assert fine_tune(five_digits, tmp_path / "scratch") == 0
    capsys.readouterr()
    assert fine_tune(five_digits, tmp_path / "fine-tuned", "--init-path", str(pretrained)) == 0
    out = capsys.readouterr().out
    assert f"Initialised from {pretrained}/ckpt-225.pt (--init-path)" in out
    assert "Classifier (fc) initialised anew: 5 classes here, 10 in ckpt-225.pt" in out
    scratch, tuned = (validation_accuracy(tmp_path / name) for name in ("scratch", "fine-tuned"))
    # 20 updates on 40 images: measured 19.5 % from scratch, 93.0 % from the digits' ResNet-18 (86.5 % on ten);
    # on an AVX2-only EPYC (Zen 3), 20.0 % and 71.5 % (84.75 % on ten).
    assert tuned > scratch + 40.0, (tuned, scratch)


@ON_THE_TRAINED_RUN
def test_a_timm_safetensors_file_initialises_the_model(pretrained, five_digits, tmp_path, capsys):
    from safetensors.torch import save_file

    weights = torch.load(pretrained / "ckpt-225.pt", weights_only=True)["model"]
    save_file({k: v.contiguous() for k, v in weights.items()}, tmp_path / "digits.safetensors")
    assert fine_tune(five_digits, tmp_path / "run", "--init-path", str(tmp_path / "digits.safetensors"),
                     "--ckpts-per-epoch", "1", length=("--iterations", "1")) == 0
    # The initial checkpoint: every tensor but the classifier is the file's, bit for bit.
    state = torch.load(tmp_path / "run" / "ckpt-0.pt", weights_only=True)["model"]
    for name, tensor in state.items():
        if name.startswith("fc."):
            assert tensor.shape[0] == 5
        else:
            assert torch.equal(tensor, weights[name]), name


@pytest.mark.parametrize("model", TIMM)
def test_a_timm_run_initialises_a_run_of_another_class_count(model, five_digits, tmp_path, capsys):
    """A timm model by its timm name (tests/model_kinds.py), trained on ten classes, starts a run on five: every
    tensor but timm's classifier (its `get_classifier`) is the first run's last checkpoint's, bit for bit."""
    first, second = tmp_path / "first", tmp_path / "second"
    assert run_command("train", [*TIMM[model], "--dataset", "cifar-10", "--generated-data", "--micro-batch-size", "8",
                                 "--iterations", "2", "--ckpts-per-epoch", "0", "--no-validation",
                                 "--logs-path", str(first)]) == 0
    capsys.readouterr()
    assert run_command("train", [*TIMM[model], "--dataset", "imagenet", "--image-size", "40", "--data-dir",
                                 str(five_digits), "--micro-batch-size", "8", "--iterations", "1", "--ckpts-per-epoch",
                                 "1", "--no-validation", "--pipeline-num-parallel", "0", "--init-path", str(first),
                                 "--logs-path", str(second)]) == 0
    out = capsys.readouterr().out
    assert f"Initialised from {first}/ckpt-2.pt (--init-path)" in out
    assert "Classifier (classifier) initialised anew: 5 classes here, 10 in ckpt-2.pt" in out
    weights = torch.load(first / "ckpt-2.pt", weights_only=True)["model"]
    state = torch.load(second / "ckpt-0.pt", weights_only=True)["model"]
    assert state.keys() == weights.keys()
    for name, tensor in state.items():
        if name.startswith("classifier."):
            assert tensor.shape[0] == 5
        else:
            assert torch.equal(tensor, weights[name]), name


@pytest.mark.parametrize("name, size, heads", [("resnet", "8", ["fc"]), ("resnet18d", "", ["fc"]), ("dla34", "", ["fc"]),
                                              ("deit_tiny_distilled_patch16_224", "", ["head", "head_dist"])])
def test_the_classifier_started_anew_is_the_one_timm_names(name, size, heads):
    """timm's get_classifier where the model is timm's: DLA's is a 1x1 convolution (no linear layer at all), a
    distilled DeiT has two; the CIFAR ResNet's is its last linear layer. Built on the meta device, as --init-path does."""
    from cnns.init_weights import _other_class_count, classifier_names
    from cnns.models import ModelSpec, build_model

    image_size = 224 if name.startswith("deit") else 32
    with torch.device("meta"):
        ours, theirs = (build_model(ModelSpec(name, size, classes, image_size)) for classes in (5, 10))
    assert classifier_names(ours) == heads
    for head in heads:  # the file's head, of 10 classes, is the model's of 5 for another class count
        assert _other_class_count(theirs.state_dict(), ours.state_dict(), head)
        assert not _other_class_count(ours.state_dict(), ours.state_dict(), head)


def save_safetensors(tensors: dict, path: Path) -> None:
    from safetensors.torch import save_file

    save_file(tensors, path)


@pytest.mark.parametrize("name, make, message", [
    ("weights.pt", lambda path: path.write_bytes(b"not a checkpoint"), "not a checkpoint or state dict"),
    ("weights.pt", lambda path: torch.save({"model": "nothing"}, path), "not a state dict of tensors"),
    ("weights.pt", lambda path: torch.save({"optimiser": torch.optim.SGD}, path),
     "not a checkpoint or state dict (it holds Python objects, not only tensors)"),
    ("weights.safetensors", lambda path: path.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}"),
     "not a safetensors file"),
    ("weights.safetensors", lambda path: save_safetensors({"head.weight": torch.zeros(2, 2)}, path),
     "does not fit ResNet-18: it has 'head.weight', which the model has not (1 such tensors)"),
    ("weights.pt", lambda path: torch.save({"conv1.weight": torch.zeros(64, 3, 7, 7)}, path),
     "does not fit ResNet-18: it lacks 'bn1.weight'"),
], ids=["bytes", "no-tensors", "objects", "bad-safetensors", "foreign-keys", "missing"])
def test_an_init_path_that_does_not_fit_is_one_line_and_nothing_is_written(five_digits, tmp_path, capsys, name, make,
                                                                          message):
    path = tmp_path / name
    make(path)
    assert fine_tune(five_digits, tmp_path / "run", "--init-path", str(path)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: --init-path {path}") and message in err, err
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------------------------
# cnns export --format safetensors, read by timm


def predictions(folder: Path, images: Path, capsys) -> list[list[float]]:
    from cnns.cli.inference import predict_main

    assert predict_main(["--restore-path", str(folder), str(images), "--top-k", "10", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    return [[p["probability"] for p in sorted(row["top_k"], key=lambda p: p["class"])] for row in rows]


@ON_THE_TRAINED_RUN
def test_exported_safetensors_load_in_timm_and_predict_as_cnns_does(pretrained, digits, tmp_path, capsys):
    import timm

    from cnns.cli.inference import export_main, restored_run
    from cnns.data.augment import normalise
    from cnns.commands.predict import decoded_images, evaluation_transform, image_files

    out = tmp_path / "digits-resnet18"
    assert export_main(["--restore-path", str(pretrained), "--format", "safetensors", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "timm's resnet18" in printed and "pretrained_cfg_overlay" in printed
    config = json.loads((out / "config.json").read_text())
    assert config["architecture"] == "resnet18" and config["num_classes"] == 10
    assert config["label_names"] == [f"digit{d}" for d in range(10)]
    assert config["pretrained_cfg"]["input_size"] == [3, 40, 40]

    # timm's documented call for a local file; and timm's local-dir form, from config.json alone.
    model = timm.create_model("resnet18", pretrained=True, num_classes=10,
                              pretrained_cfg_overlay=dict(file=str(out / "model.safetensors"), num_classes=10)).eval()
    from_folder = timm.create_model(f"local-dir:{out}", pretrained=True).eval()
    images = digits / "validation" / "digit3"
    files = image_files([str(images)])[:6]
    _, cfg = restored_run(str(pretrained / "ckpt-225.pt"))
    batch = torch.stack([image for _, image in decoded_images(files, evaluation_transform(cfg))])
    pixels = normalise(batch, config["pretrained_cfg"]["mean"], config["pretrained_cfg"]["std"], torch.float32)
    with torch.no_grad():
        theirs = model(pixels).softmax(-1)
        assert torch.equal(from_folder(pixels), model(pixels))
    ours = torch.tensor(predictions(pretrained, images, capsys)[:6])
    # cnns predict prints 4 decimals; the same float32 model on the same pixels agrees far below that.
    assert torch.allclose(theirs, ours, atol=5e-5 + 1e-6)


@pytest.mark.parametrize("model, size, timm_name", [("resnext", "50", "resnext50_32x4d"),
                                                     ("efficientnet", "B0", "efficientnet_b0")])
def test_resnext_and_efficientnet_weights_load_in_timm_as_cnns_runs_them(tmp_path, capsys, model, size, timm_name):
    import timm
    from safetensors import safe_open

    from cnns.cli.inference import export_main, restored_run
    from cnns.deploy.restored_model import restore_model

    run = tmp_path / "run"
    assert run_command("train", ["--model", model, "--model-size", size, "--dataset", "imagenet", "--image-size", "64",
                                 "--synthetic-data", "--batch-norm", "--precision", "16.16", "--half-dtype", "bfloat16",
                                 "--micro-batch-size", "2", "--iterations", "1", "--no-validation",
                                 "--logs-path", str(run)]) == 0
    for keep_dtype in (False, True):
        out = tmp_path / f"export-{keep_dtype}"
        assert export_main(["--restore-path", str(run), "--format", "safetensors", "--out", str(out),
                            *(["--keep-dtype"] if keep_dtype else [])]) == 0
        assert f"timm's {timm_name}" in capsys.readouterr().out
        first_conv = "conv1.weight" if model == "resnext" else "conv_stem.weight"
        with safe_open(out / "model.safetensors", "pt") as f:
            # --keep-dtype: the 16.16 run's bfloat16 weights as trained; norms train in float32 either way.
            assert f.get_tensor(first_conv).dtype == (torch.bfloat16 if keep_dtype else torch.float32)
            assert f.get_tensor("bn1.weight").dtype == torch.float32
    theirs = timm.create_model(timm_name, pretrained=True, num_classes=1000, pretrained_cfg_overlay=dict(
        file=str(tmp_path / "export-False" / "model.safetensors"), num_classes=1000)).eval()
    ours = restore_model(*restored_run(str(run))).model
    pixels = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got = theirs(pixels), ours(pixels)
    # The same float32 weights and modules, but cnns deploys the model as it trains it (assemble: channels_last
    # convolutions, and the fused norm passes where they are built), whose kernels sum in another order. A
    # reordered sum of K float32 products moves by about sqrt(K) x 2^-24 of its magnitude (K <= 2048 here:
    # ~3e-6), over ~50 layers at most ~1e-4 of the largest logit; measured 3.4e-7 on an AVX-512-BF16 EPYC.
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4 * float(expected.abs().max()))


@pytest.mark.parametrize("argv, message", [
    (["--model", "resnet", "--model-size", "8", "--dataset", "cifar-10"],
     "timm defines no model for ResNet-8: the CIFAR models are cnns' own"),
    (["--model", "efficientnet", "--model-size", "B0", "--dataset", "imagenet", "--image-size", "64", "--group-norm"],
     "timm builds EfficientNet-B0 with group norm of 4 groups from code only"),
], ids=["cifar", "efficientnet-group-norm"])
def test_a_model_timm_does_not_define_is_one_line(tmp_path, capsys, argv, message):
    from cnns.cli import run_script

    run = tmp_path / "run"
    assert run_command("train", [*argv, "--synthetic-data", "--micro-batch-size", "2", "--iterations", "1",
                                 "--no-validation", "--logs-path", str(run)]) == 0
    capsys.readouterr()
    out = tmp_path / "x"
    assert run_script("export", ["--restore-path", str(run), "--format", "safetensors", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "x").exists()
