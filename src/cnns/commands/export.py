"""`cnns export`: a trained run's model as a portable file, for use outside cnns.

```
cnns export --restore-path logs/RN8_bs32_BN_16.16_X7Q --format onnx --out rn8.onnx
cnns export --restore-path logs/RN8_bs32_BN_16.16_X7Q/ckpt-937.pt --format pt2 --eight-bit-io \
    --batch-size 16 --out rn8.pt2
```

* **Which weights.** `--restore-path` as for `cnns predict` (a run folder: its newest checkpoint; or
  one checkpoint or weight-average file), `--weights raw|ema`; the model is rebuilt from the run's
  arguments.json, resolved as validation.py resolves it (`cnns.cli.inference.restored_run`).
* **Precision.** Always float32, whatever the training precision: a 16.16 run's bfloat16 (or float16)
  weights are converted to float32 (exactly), so the file runs on any CPU or GPU runtime, and its
  results do not depend on a half type the target may only emulate.
* **Input.** By default ``images``: float32 NCHW, RGB, already normalised as training normalises
  (``(pixel / 255 - mean) / std`` with the run's constants, printed). With ``--eight-bit-io``:
  uint8 NHWC RGB pixels 0..255, the normalisation folded into the graph (as
  `cnns.deploy.restored_model.NormalisedClassifier`, the 8-bit I/O of Graphcore's application). Images must already be
  image_size x image_size (resized and cropped as `cnns predict` does). The output ``logits`` is
  float32 [batch, classes]: softmax gives probabilities.
* **Batch size.** ``--batch-size dynamic`` (the default) exports the batch dimension as a
  `torch.export.Dim`: any size from 1, and at most 65535 in a pt2 package for CUDA
  (`cnns.deploy.graphs.CUDA_MAX_BATCH`: cuDNN's batch-norm limit, which torch.export turns into a bound);
  the range the exported program recorded is printed. ``--batch-size N`` fixes it to N.
* **Formats.**
  ``onnx``: torch's dynamo exporter (``torch.onnx.export(..., dynamo=True)``) at ONNX opset 18,
  the opset of the ONNX functions (onnxscript's torchlib) that it translates ATen operators to, so
  no version conversion is applied; one self-contained file (weights inside). Runs in onnxruntime.
  ``pt2``: ``torch.export`` then AOTInductor (``torch._inductor.aoti_compile_and_package``), as
  ``inference_embedded.py`` compiles: a package of compiled native code for this machine's kind of
  device (``--device``, CPU by default). Loading it needs PyTorch
  (``torch._inductor.aoti_load_package``) but not cnns; compilation takes tens of seconds on a CPU.
  ``safetensors``: the weights alone, for timm and the model hubs: ``--out`` is a folder that gets
  ``model.safetensors`` (the state dict under timm's key names, which are cnns' own; float32, or the
  training half type with ``--keep-dtype``) and ``config.json`` in timm's hub layout (architecture as
  timm names it, class count and names, and the run's evaluation preprocessing: input size, interpolation,
  crop, mean and std). The printed way, ``timm.create_model("local-dir:FOLDER", pretrained=True)`` with
  ``timm.data.create_transform(**timm.data.resolve_data_config(model=model))``, reproduces `cnns predict`
  (a test runs it). ``timm.create_model(NAME, pretrained=True, pretrained_cfg_overlay=dict(file=
  "FOLDER/model.safetensors", num_classes=N), num_classes=N)`` loads the same weights but leaves timm's own
  preprocessing (its input size and statistics), so it is printed second, for the weights alone. Only models
  timm defines by name qualify (the family's `timm_name`: `cnns.init_weights.timm_model`); the others are
  one line saying so.
* The file is written under a temporary name in the destination folder and renamed (`cnns.safe_writes`), so `--out`
  never holds a partial file, and a full disk is one line naming the file. An existing file (a checkpoint
  above all) is replaced only with `--overwrite`, and never the checkpoint or arguments.json the export reads.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from cnns.config import RunConfig
from cnns.deploy.graphs import (DYNAMIC_EXAMPLE_BATCH, INPUT_NAME, OUTPUT_NAME, export_onnx, export_pt2,
                                max_batch)
from cnns.deploy.restored_model import FloatClassifier, NormalisedClassifier, RestoredModel, restore_model
from cnns.errors import ConfigError, WriteError
from cnns.safe_writes import check_output, write_atomically

FORMATS = ("onnx", "pt2", "safetensors")
TIMM_FILES = ("model.safetensors", "config.json")  # what --format safetensors writes into its --out folder


def exportable_module(restored: RestoredModel, eight_bit_io: bool) -> nn.Module:
    """The module to export: the float32 model, behind the 8-bit normalisation when asked."""
    if not eight_bit_io:
        return FloatClassifier(restored.model).eval()
    from cnns.data.augment import IMAGENET_MEAN, normalise

    # NormalisedClassifier subtracts the ImageNet mean, as the device feed always does.
    if restored.mean != tuple(float(v) for v in IMAGENET_MEAN):
        raise ConfigError(f"{restored.checkpoint}: the run's input mean {restored.mean} is not the ImageNet mean "
                          "that the 8-bit graph subtracts")
    # normalise() caches its constants per device: make them here, outside tracing, so that the
    # traced graph and later eager calls both see real tensors.
    normalise(torch.zeros(1, 1, 1, 3, dtype=torch.uint8, device=restored.device), restored.mean, restored.std,
              torch.float32)
    return NormalisedClassifier(restored.model, restored.std, torch.float32).eval()


def example_input(restored: RestoredModel, batch: int, eight_bit_io: bool) -> torch.Tensor:
    size = restored.image_size
    generator = torch.Generator().manual_seed(0)
    if eight_bit_io:
        images = torch.randint(0, 256, (batch, size, size, 3), dtype=torch.uint8, generator=generator)
    else:
        images = torch.randn(batch, 3, size, size, generator=generator)
    return images.to(restored.device)


def input_spec_lines(restored: RestoredModel, batch: int | None, eight_bit_io: bool,
                     batch_range: tuple[int, int | None] | None = None) -> list[str]:
    """The input and output lines; `batch_range` is the dynamic batch's (smallest, largest or None)."""
    size = restored.image_size
    batch_text = "batch" if batch is None else str(batch)
    smallest, largest = batch_range or (1, None)
    upto = "" if largest is None else f" to {largest}"
    dynamic = f" (batch dynamic: any size from {smallest}{upto})" if batch is None else ""
    mean = ", ".join(f"{v:g}" for v in restored.mean)
    std = ", ".join(f"{v:g}" for v in restored.std)
    if eight_bit_io:
        first = (f"input  {INPUT_NAME}: uint8 [{batch_text}, {size}, {size}, 3]{dynamic}, layout NHWC, RGB pixels "
                 f"0..255, {size}x{size} (normalised inside the graph: (x/255 - mean)/std, mean ({mean}), "
                 f"std ({std}))")
    else:
        first = (f"input  {INPUT_NAME}: float32 [{batch_text}, 3, {size}, {size}]{dynamic}, layout NCHW, RGB, "
                 f"{size}x{size}, normalised: (x/255 - mean)/std for pixels x in 0..255, mean ({mean}), std ({std})")
    return [first, f"output {OUTPUT_NAME}: float32 [{batch_text}, {restored.num_classes}] (logits; softmax for "
                   "probabilities)"]


def usage_line(fmt: str, out: Path) -> str:
    if fmt == "onnx":
        return (f"import onnxruntime as ort; logits = ort.InferenceSession({str(out)!r}, "
                f"providers=['CPUExecutionProvider']).run(None, {{{INPUT_NAME!r}: images}})[0]  "
                "# images: a numpy array as above")
    return (f"import torch; logits = torch._inductor.aoti_load_package({str(out)!r})(images)  "
            "# images: a torch tensor as above, on the package's device")


def _batch_size(value: str) -> int | None:
    """None for dynamic, else the fixed batch size."""
    if value.strip().lower() == "dynamic":
        return None
    try:
        batch = int(value)
    except ValueError:
        raise ConfigError(f"--batch-size must be a positive integer or dynamic, got {value!r}") from None
    if batch < 1:
        raise ConfigError(f"--batch-size must be a positive integer or dynamic, got {value!r}")
    return batch


def export(checkpoint: Path, cfg: RunConfig, fmt: str, out: str | Path, batch_size: str = "dynamic",
           eight_bit_io: bool = False, weights: str = "raw", device: str = "cpu", keep_dtype: bool = False,
           overwrite: bool = False) -> int:
    """Write a run's model as `fmt` (onnx or pt2) to `out` and print how to run it (module docstring)."""
    from cnns.devices import resolve_device

    if fmt not in FORMATS:
        raise ConfigError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if fmt == "safetensors":
        return export_for_timm(checkpoint, cfg, Path(out), weights, keep_dtype, overwrite)
    batch = _batch_size(batch_size)
    out = Path(out)
    if out.is_dir():
        raise ConfigError(f"--out {out} is a folder; give a file name")
    if not out.parent.is_dir():
        raise ConfigError(f"--out {out}: the folder {out.parent} does not exist")
    check_output(out, inputs(checkpoint), overwrite)
    device = resolve_device(device) if fmt == "pt2" else torch.device("cpu")
    restored = restore_model(checkpoint, cfg, weights, device)
    module = exportable_module(restored, eight_bit_io)
    example = example_input(restored, batch or DYNAMIC_EXAMPLE_BATCH, eight_bit_io)
    dynamic = batch is None
    if fmt == "onnx":  # traced on the CPU for any runtime: no device limit on the batch
        opset, batches = export_onnx(module, example, dynamic, out)
        what = f"ONNX, opset {opset} (torch.onnx.export dynamo=True)"
    else:
        batches = export_pt2(module, example, dynamic, out, max_batch(device))
        what = f"AOTInductor .pt2 package for {device.type} (loads with torch, not cnns)"
    print(f"Exported {restored.checkpoint} ({restored.weights} weights, {restored.description}) to {out}: {what}")
    if not restored.saved_half_weights:
        print(f"weights: float32 (the {restored.trained_precision} run saved float32 weights)")
    else:
        print(f"weights: float32, converted from the half-precision weights of the {restored.trained_precision} run")
    for line in input_spec_lines(restored, batch, eight_bit_io, batches):
        print(line)
    print(f"run: {usage_line(fmt, out)}")
    return 0


def export_for_timm(checkpoint: Path, cfg: RunConfig, out: Path, weights: str, keep_dtype: bool,
                    overwrite: bool = False) -> int:
    """--format safetensors: FOLDER/model.safetensors and FOLDER/config.json (module docstring)."""
    import json

    from safetensors.torch import save

    from cnns.runfolder.run_folder import checkpoint_weights
    from cnns.init_weights import timm_model

    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file; --format safetensors writes a folder "
                          "(model.safetensors, config.json)")
    for name in TIMM_FILES:
        check_output(out / name, inputs(checkpoint), overwrite)
    restored = restore_model(checkpoint, cfg, weights)  # checks the weights against the run's model
    architecture, model_args = timm_model(restored.cfg.model)
    if keep_dtype:
        tensors = dict(checkpoint_weights(restored.checkpoint, weights))
    else:
        tensors = restored.model.state_dict()
    tensors = {name: tensor.detach().contiguous().cpu() for name, tensor in tensors.items()}
    config = timm_config(restored, architecture, model_args)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise WriteError(out, exc) from None
    write_atomically(out / "model.safetensors", save(tensors, metadata={"format": "pt"}))
    write_atomically(out / "config.json", json.dumps(config, indent=2) + "\n")
    dtypes = sorted({str(t.dtype).replace("torch.", "") for t in tensors.values() if t.is_floating_point()})
    print(f"Exported {restored.checkpoint} ({restored.weights} weights, {restored.description}) to "
          f"{out}/model.safetensors ({', '.join(dtypes)}) and {out}/config.json: timm's {architecture}")
    print(f"run: {timm_usage_line(out)}")
    print(f"weights alone: {timm_weights_line(architecture, model_args, out, restored.num_classes)}  (timm then "
          "preprocesses as its own pretrained_cfg says, not as this run: take the transform above)")
    return 0


def timm_usage_line(out: Path) -> str:
    """How timm loads the export and prepares images as `cnns predict` does: timm's `local-dir:` form reads
    config.json (the run's input size, interpolation, crop and mean/std), and its transform follows them
    (tests/test_timm_models.py runs this line and compares it with `cnns predict`)."""
    return (f"import timm; model = timm.create_model({'local-dir:' + str(out)!r}, pretrained=True).eval(); "
            "transform = timm.data.create_transform(**timm.data.resolve_data_config(model=model))  "
            "# logits = model(transform(pil_image)[None])")


def timm_weights_line(architecture: str, model_args: dict, out: Path, classes: int) -> str:
    """timm's documented call for a local weights file under the model's timm name."""
    extra = "".join(f", {key}={value!r}" for key, value in model_args.items())
    return (f"timm.create_model({architecture!r}, pretrained=True, pretrained_cfg_overlay="
            f"dict(file={str(out / 'model.safetensors')!r}, num_classes={classes}), num_classes={classes}{extra})")


def timm_config(restored: RestoredModel, architecture: str, model_args: dict) -> dict:
    """config.json in timm's hub layout (what timm.models.load_model_config_from_path reads)."""
    from cnns.runfolder.classes import class_names
    from cnns.init_weights import classifier_name

    names, _ = class_names(restored.cfg, restored.checkpoint.parent)
    size = restored.image_size
    data = restored.cfg.data
    pretrained_cfg = {
        # Evaluation preprocessing as `cnns predict`'s (cnns.commands.predict.evaluation_transform), the run's
        # recorded --eval-interpolation and --eval-crop-pct: the short side to size / crop_pct, the centre size x
        # size square (on CIFAR-sized data crop_pct 1: a size x size image is taken as it is).
        "input_size": [3, size, size], "interpolation": data.eval_interpolation, "crop_pct": data.eval_crop_pct,
        "crop_mode": "center", "mean": list(restored.mean), "std": list(restored.std),
        "num_classes": restored.num_classes, "classifier": classifier_name(restored.model),
        "first_conv": first_conv(restored.cfg.model),
    }
    config = {"architecture": architecture, "num_classes": restored.num_classes,
              "num_features": restored.model.get_classifier().in_features, "pretrained_cfg": pretrained_cfg,
              "cnns": {"model": restored.cfg.model.display_name, "checkpoint": str(restored.checkpoint),
                       "weights": restored.weights}}
    if model_args:
        config["model_args"] = model_args
    if names is not None:
        config["label_names"] = list(names)
    return config


def first_conv(spec) -> str:
    """The stem convolution's module name (timm's pretrained_cfg): the family's, or the timm model's own."""
    family = spec.family
    own = family.evaluation(spec) if family.evaluation is not None else None
    return family.first_conv or (own or {}).get("first_conv", "")


def inputs(checkpoint: Path) -> tuple[Path, Path]:
    """The files an export reads, which its output must never replace: the checkpoint and its run's options."""
    return checkpoint, Path(checkpoint).parent / "arguments.json"


__all__ = ["export", "FORMATS", "exportable_module"]
