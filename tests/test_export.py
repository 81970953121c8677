"""cnns export: ONNX (onnxruntime) and AOTInductor .pt2 files of a 16.16-trained checkpoint compute the
eager float32 model's logits, for float NCHW and for uint8 NHWC (--eight-bit-io) input; a timm model's compute
what `cnns predict` computes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import scripts
import torch

from cnns.cli.inference import export_main, restored_run
from cnns.data.augment import IMAGENET_MEAN, normalise
from cnns.data.drawn_shapes import draw_shapes
from cnns.data.cifar_records import write_cifar10
from cnns.deploy.graphs import (CUDA_MAX_BATCH, ONNX_OPSET, batch_range, export_onnx, export_program,
                                max_batch)
from cnns.deploy.restored_model import FloatClassifier, restore_model
from cnns.errors import CnnsError
from cnns.runfolder.checkpoint import list_checkpoints
from cnns.models import ModelSpec, build_model
from model_kinds import TIMM

UNIT_STD = (1.0, 1.0, 1.0)  # the run trains without --normalise-input: mean subtraction only


# The exports share one trained run: one test worker (`--dist loadgroup`) and a session fixture, so it is
# trained once, not once per worker and again whenever the worker ran another module's tests in between.
pytestmark = pytest.mark.xdist_group("test_export-run")


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Path:
    """A ResNet-8 trained in 16.16 with bfloat16 weights (2 epochs of 640 drawn shapes)."""
    root = tmp_path_factory.mktemp("export")
    images, labels = draw_shapes(672, seed=8)
    write_cifar10(root / "data", (images[:640], labels[:640]), (images[640:], labels[640:]))
    scripts.train_here("--dataset", "cifar-10", "--data-dir", str(root / "data"), "--model-size", "8", "--precision",
                       "16.16", "--half-dtype", "bfloat16", "--epochs", "2", "--ckpts-per-epoch", "0", "--seed", "1",
                       "--no-validation", "--log-dir", str(root / "logs"))
    (folder,) = (root / "logs").iterdir()  # the run's folder, named by train.py
    return list_checkpoints(folder)[-1][1]


@pytest.fixture(scope="session")
def eager(checkpoint) -> torch.nn.Module:
    """The reference: the checkpoint's weights in a float32 ResNet-8, built here from the model code."""
    state = torch.load(checkpoint, weights_only=True)["model"]
    assert state["conv1.weight"].dtype == torch.bfloat16  # 16.16 really saved half-precision weights
    model = build_model(ModelSpec(arch="resnet", size="8", num_classes=10, image_size=32))
    model.load_state_dict(state)
    return model.float().eval()


def eager_logits(model: torch.nn.Module, images: torch.Tensor) -> np.ndarray:
    with torch.no_grad():
        if images.dtype == torch.uint8:
            images = normalise(images, IMAGENET_MEAN, UNIT_STD, torch.float32)
        return model(images).numpy()


def assert_close(actual: np.ndarray, expected: np.ndarray) -> None:
    """Within 1e-4 of the eager logits, relative to their scale (absolute below 1).

    float32 both ways, but each runtime (AOTInductor, ONNX Runtime, TorchScript) sums the
    convolutions and the pooling in its own order: one reordered sum of K terms differs by at most
    about K x 2^-24 of its magnitude, 5e-5 for the largest fan-in here (3 x 3 x 64 = 576), typically
    sqrt(K) times less. Measured up to 1.5e-7 on logits of scale 1 (AVX-512 EPYC); a wrong layer,
    weight or normalisation is off by orders of magnitude more."""
    assert actual.shape == expected.shape and actual.dtype == np.float32
    scale = max(1.0, float(np.abs(expected).max()))
    error = float(np.abs(actual - expected).max())
    print(f"max |logit difference| {error:.2e} (logit scale {scale:.1f})")
    assert error <= 1e-4 * scale, (error, scale)


def export(capsys, *argv: str) -> str:
    assert export_main(list(argv)) == 0
    return capsys.readouterr().out


def float_images(batch: int, seed: int) -> torch.Tensor:
    """Normalised-looking input: uint8 pixels minus the ImageNet mean, as the run trains on."""
    pixels = torch.randint(0, 256, (batch, 32, 32, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    return normalise(pixels, IMAGENET_MEAN, UNIT_STD, torch.float32).contiguous()


def uint8_images(batch: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (batch, 32, 32, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def onnx_session(path: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def test_onnx_float_input_with_a_dynamic_batch_computes_the_eager_logits(checkpoint, eager, tmp_path, capsys):
    path = tmp_path / "model.onnx"
    out = export(capsys, "--restore-path", str(checkpoint), "--format", "onnx", "--batch-size", "dynamic",
                 "--out", str(path))
    printed_opset = int(re.search(r"opset (\d+)", out).group(1))
    model_opset = next(entry.version for entry in onnx.load(str(path)).opset_import if entry.domain in ("", "ai.onnx"))
    assert printed_opset == model_opset == ONNX_OPSET == 18, (printed_opset, model_opset)
    assert "float32 [batch, 3, 32, 32]" in out and "NCHW" in out and "mean (0.485, 0.456, 0.406), std (1, 1, 1)" in out
    assert "converted from the half-precision weights of the 16.16 (bfloat16) run" in out
    assert "onnxruntime" in out
    assert "(batch dynamic: any size from 1)" in out  # traced on the CPU for any runtime: no upper limit
    session = onnx_session(path)
    [graph_input] = session.get_inputs()
    assert graph_input.name == "images" and graph_input.type == "tensor(float)"
    assert isinstance(graph_input.shape[0], str) and graph_input.shape[1:] == [3, 32, 32]  # symbolic batch
    for batch, seed in ((1, 1), (5, 2)):
        images = float_images(batch, seed)
        [logits] = session.run(None, {"images": images.numpy()})
        assert_close(logits, eager_logits(eager, images))


def test_onnx_eight_bit_input_computes_the_eager_logits_at_two_batch_sizes(checkpoint, eager, tmp_path, capsys):
    path = tmp_path / "model-u8.onnx"
    out = export(capsys, "--restore-path", str(checkpoint), "--format", "onnx", "--eight-bit-io", "--out", str(path))
    assert "uint8 [batch, 32, 32, 3]" in out and "NHWC" in out and "0..255" in out
    session = onnx_session(path)
    assert session.get_inputs()[0].type == "tensor(uint8)"
    for batch, seed in ((2, 3), (7, 4)):
        images = uint8_images(batch, seed)
        [logits] = session.run(None, {"images": images.numpy()})
        assert_close(logits, eager_logits(eager, images))


def test_onnx_fixed_batch(checkpoint, eager, tmp_path, capsys):
    path = tmp_path / "model-b4.onnx"
    out = export(capsys, "--restore-path", str(checkpoint), "--format", "onnx", "--batch-size", "4", "--out", str(path))
    assert "float32 [4, 3, 32, 32]" in out
    session = onnx_session(path)
    assert session.get_inputs()[0].shape == [4, 3, 32, 32]
    images = float_images(4, 5)
    assert_close(session.run(None, {"images": images.numpy()})[0], eager_logits(eager, images))


@pytest.fixture(scope="module")
def pt2_package(checkpoint, tmp_path_factory) -> tuple[Path, str]:
    """One AOTInductor compilation (tens of seconds): uint8 NHWC input, dynamic batch."""
    path = tmp_path_factory.mktemp("pt2") / "model.pt2"
    import contextlib
    import io

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert export_main(["--restore-path", str(checkpoint), "--format", "pt2", "--eight-bit-io",
                            "--out", str(path)]) == 0
    return path, printed.getvalue()


def test_pt2_package_computes_the_eager_logits(pt2_package, eager):
    path, out = pt2_package
    assert "aoti_load_package" in out and "uint8 [batch, 32, 32, 3]" in out
    assert not list(path.parent.glob(".*tmp*"))  # written under a temporary name, then renamed
    runner = torch._inductor.aoti_load_package(str(path))
    for batch, seed in ((1, 6), (6, 7)):
        images = uint8_images(batch, seed)
        logits = runner(images)
        assert logits.dtype == torch.float32
        assert_close(logits.numpy(), eager_logits(eager, images))


@pytest.mark.parametrize("argv, text", [
    (["--batch-size", "0"], "--batch-size"),
    (["--batch-size", "many"], "--batch-size"),
    (["--out", "/nonexistent-folder/model.onnx"], "/nonexistent-folder"),
])
def test_bad_options_are_one_line_errors(checkpoint, tmp_path, argv, text):
    base = {"--format": "onnx", "--out": str(tmp_path / "m.onnx")}
    for key, value in zip(argv[::2], argv[1::2]):
        base[key] = value
    flat = [item for pair in base.items() for item in pair]
    with pytest.raises(CnnsError, match=re.escape(text)) as raised:
        export_main(["--restore-path", str(checkpoint), *flat])
    assert "\n" not in str(raised.value)
    assert not (tmp_path / "m.onnx").exists()


def test_a_dynamic_batch_traced_for_cuda_is_bounded_by_cudnns_batch_norm_limit():
    """The GPU failure "Constraints violated (batch)! ... 2 <= batch <= 65535", reproduced without a GPU: the
    model's tensors are fake CUDA tensors (FakeTensorMode), so torch's real C++ kernel selection runs for a
    CUDA device. Eval-mode batch norm picks cuDNN only for batches up to 65535, which a symbolic batch turns
    into a guard; with the device's limit in the Dim the export succeeds and records the range from 1."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    assert max_batch("cpu") is None
    assert max_batch(torch.device("cuda")) == max_batch("cuda:1") == CUDA_MAX_BATCH == 65535

    def fake_cuda_resnet8(norm: str):
        with FakeTensorMode(), torch.device("cuda"):
            spec = ModelSpec(arch="resnet", size="8", num_classes=10, image_size=32, norm=norm, groups=4)
            return FloatClassifier(build_model(spec)).eval(), torch.randn(2, 3, 32, 32)

    module, example = fake_cuda_resnet8("batch")
    assert example.device.type == "cuda" and next(module.parameters()).device.type == "cuda"
    with pytest.raises(CnnsError, match=re.escape("<= 65535")) as raised:
        export_program(module, example, True, max_batch("cpu"))  # the CPU's range, unbounded
    assert "\n" not in str(raised.value) and "--batch-size" in str(raised.value)
    assert batch_range(export_program(module, example, True, max_batch(example.device))) == (1, 65535)
    assert batch_range(export_program(module, example, False)) is None  # a fixed batch: no range at all
    # Group norm has no cuDNN batch-size test, and the convolutions add no guard: unbounded there.
    module, example = fake_cuda_resnet8("group")
    assert batch_range(export_program(module, example, True)) == (1, None)


def test_onnx_export_with_the_cuda_batch_range_runs_batches_of_one_and_three(eager, tmp_path):
    path = tmp_path / "cuda-range.onnx"
    opset, batches = export_onnx(FloatClassifier(eager).eval(), float_images(2, 0), True, path, CUDA_MAX_BATCH)
    assert opset == ONNX_OPSET and batches == (1, CUDA_MAX_BATCH)  # as the traced program recorded it
    session = onnx_session(path)
    assert isinstance(session.get_inputs()[0].shape[0], str)  # the file names the batch, without bounds
    for batch, seed in ((1, 8), (3, 9)):
        images = float_images(batch, seed)
        assert_close(session.run(None, {"images": images.numpy()})[0], eager_logits(eager, images))


def test_pt2_export_for_cuda_prints_the_recorded_range_and_the_package_runs_one_and_three(
        checkpoint, eager, tmp_path, monkeypatch, capsys):
    """`cnns export --format pt2 --device cuda` as it runs on a GPU, but traced and compiled on the CPU: the
    command asks for the limit of the device it exports for, here answered as for CUDA."""
    import cnns.commands.export as export_command

    asked = []
    monkeypatch.setattr(export_command, "max_batch", lambda device: asked.append(device.type) or CUDA_MAX_BATCH)
    path = tmp_path / "cuda-range.pt2"
    out = export(capsys, "--restore-path", str(checkpoint), "--format", "pt2", "--out", str(path))
    assert asked == ["cpu"]
    assert "float32 [batch, 3, 32, 32] (batch dynamic: any size from 1 to 65535)" in out
    runner = torch._inductor.aoti_load_package(str(path))
    for batch, seed in ((1, 10), (3, 11)):
        images = float_images(batch, seed)
        assert_close(runner(images).numpy(), eager_logits(eager, images))


# ---------------------------------------------------------------------------------------------
# Every kind of model: a timm model by its timm name exports as the seed's does


@pytest.mark.slow
@pytest.mark.parametrize("model", TIMM)
def test_a_timm_models_onnx_and_pt2_exports_compute_what_cnns_predict_computes(model, tmp_path, capfd):
    """A timm model trained in 16.16 (tests/model_kinds.py): its ONNX file (float NCHW, dynamic batch) and its .pt2
    package (uint8 NHWC) on the pixels of PNG files give the probabilities `cnns predict` prints for those files."""
    from PIL import Image

    images, labels = draw_shapes(96 + 6, seed=5)
    write_cifar10(tmp_path / "data", (images[:96], labels[:96]), (images[96:], labels[96:]))
    run = tmp_path / "run"
    scripts.train_here("--dataset", "cifar-10", "--data-dir", str(tmp_path / "data"), *TIMM[model], "--precision",
                       "16.16", "--half-dtype", "bfloat16", "--micro-batch-size", "16", "--iterations", "6",
                       "--ckpts-per-epoch", "0", "--seed", "1", "--no-validation", "--logs-path", str(run))
    pngs = tmp_path / "pngs"
    pngs.mkdir()
    for index, image in enumerate(images[96:]):
        Image.fromarray(image.numpy()).save(pngs / f"{index}.png")
    printed = scripts.run_here(capfd, "predict", "--restore-path", str(run), str(pngs), "--top-k", "10", "--json")
    rows = sorted((json.loads(line) for line in printed.stdout.splitlines()), key=lambda row: row["path"])
    predicted = torch.tensor([[p["probability"] for p in sorted(row["top_k"], key=lambda p: p["class"])]
                              for row in rows])
    pixels = torch.stack([torch.from_numpy(np.array(Image.open(row["path"]))) for row in rows])  # uint8 NHWC
    restored = restore_model(*restored_run(str(run)))

    onnx_path, pt2_path = tmp_path / "model.onnx", tmp_path / "model.pt2"
    scripts.run_here(capfd, "export", "--restore-path", str(run), "--format", "onnx", "--batch-size", "dynamic",
                     "--out", str(onnx_path))
    scripts.run_here(capfd, "export", "--restore-path", str(run), "--format", "pt2", "--eight-bit-io",
                     "--out", str(pt2_path))
    floats = normalise(pixels, restored.mean, restored.std, torch.float32).contiguous()
    [onnx_logits] = onnx_session(onnx_path).run(None, {"images": floats.numpy()})
    pt2_logits = torch._inductor.aoti_load_package(str(pt2_path))(pixels)
    for logits in (torch.from_numpy(onnx_logits), pt2_logits):
        # float32 all three ways, each summing in its own order: logits within 1e-4 of their scale of each other
        # (assert_close above), and softmax moves a probability by at most half the largest logit's change.
        scale = max(1.0, float(logits.abs().max()))
        assert torch.equal(logits.argmax(-1), predicted.argmax(-1))
        assert torch.allclose(logits.softmax(-1), predicted, rtol=0, atol=1e-4 * scale), \
            (logits.softmax(-1) - predicted).abs().max()
