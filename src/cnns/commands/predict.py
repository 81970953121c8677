"""`cnns predict`: classify image files with a trained run's model.

```
cnns predict --restore-path logs/RN8_bs32_BN_16.16_X7Q photo.jpg more-photos/ [--top-k 5] [--json]
             [--weights raw|ema] [--batch-size 64] [--device cpu|cuda]
```

What it does, step by step:

* **Model.** `--restore-path` is a run folder (its newest ``ckpt-<iteration>.pt``) or one checkpoint
  file of a run folder (``ckpt-N.pt``, or a weight average ``weight_avg_*.pt``). The model is rebuilt
  from the run folder's ``arguments.json`` resolved exactly as ``validation.py`` resolves it
  (`cnns.cli.inference.restored_run`, `cnns.deploy.restored_model.restore_model`), the checkpoint's ``"model"``
  entry (or with ``--weights ema`` its ``"ema"`` entry, the float32 moving average of ``--ema-decay``)
  is loaded, and the model runs in **float32** in eval mode whatever the training precision: a 16.16
  checkpoint's bfloat16 weights are exactly representable in float32, and float32 arithmetic gives
  the same answer on every CPU and GPU (the validation after training computes in the half type, so
  its probabilities can differ from ours in the third decimal).
* **Images.** Each argument is an image file (JPEG, PNG, WebP, GIF, BMP; decoded as the run's evaluation
  loader decodes them, `cnns.data.decoding.ImageDecoder`: libjpeg-turbo's region decoder for JPEGs, TorchCodec
  for the rest, PIL for an animation's first frame and the formats TorchCodec does not read)
  or a folder, which means every image file under it (by extension, recursively, hidden entries
  skipped), sorted by path. A file is read only if it is a regular file no larger than ``--max-file-size``
  (1 GiB by default), and read no further (`cnns.bounded_reads`): a FIFO, a device (a symlink to
  /dev/zero), a sparse 20 GB ``.jpg`` are never read. What the file system shows before anything runs
  stops the command in one line (`CnnsError`, exit 2): a missing path, an image argument that is not a
  regular file or is larger than the limit, a folder without images (a directory named ``x.jpg`` is a
  folder). A file found in a folder that cannot be read (``error: cannot read <path>: <reason>``) or
  decoded (``error: cannot decode <path>: <reason>``) is named on stderr in one line, the other images
  are still predicted, and the exit code is 1 (0 when every image was predicted).
* **Preprocessing.** As the run's evaluation data is prepared, by the same code: the evaluation loader's
  `cnns.data.image_loader.ImageNetTransform` of the run's recorded options (short side resized to image_size /
  --eval-crop-pct with --eval-interpolation's antialiased resampler, then the centre image_size square: image_size
  x 256/224, bilinear, by default; a timm model's own pretrained_cfg values on ImageNet-sized data). The 32-px models of
  CIFAR-10/100 and the built-in dataset take a 32x32 image as it is; any other size is brought to
  32x32 by resizing its short side to 32 (antialiased) and cropping the centre 32x32 square: the
  aspect ratio is kept (a circle stays a circle; a plain resize would squash it), and no margin is
  cropped away, because CIFAR objects fill the frame. Then the uint8 NHWC batch is normalised as
  training normalises it on the device (`cnns.engine.feed.DeviceFeed`'s constants through
  `cnns.data.augment.normalise`): minus the ImageNet mean, divided by the ImageNet std with
  ``--normalise-input`` and by 1 without it (the mean subtraction of Graphcore's application).
* **Output.** Per image, in order, one line ``path: label (p), label (p), ...`` with the top-k
  classes and their softmax probabilities (4 decimals), or with ``--json`` one JSON object per line:
  ``{"path": ..., "top_k": [{"class": index, "label": name, "probability": p}, ...]}``. A line on
  stderr says which checkpoint and weights were used and where the class names come from.
* **Class names**, in the dataset's class-index order: CIFAR-10's ``batches.meta.txt`` and CIFAR-100's
  ``fine_label_names.txt`` (one name a line, as the official binary archives ship them) from the run's
  data folder or its archive subfolder; the built-in dataset's shape names; an ImageNet JPEG tree's
  class folder names (sorted: the dataset's class index). ImageNet TFRecords carry no class list that
  the reader exposes, and a file with the wrong number of names is not trusted: then, and when the
  run's data folder is not there, the class index is the label (`cnns.runfolder.classes.class_names`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Iterator, Sequence

import torch

from cnns.config import RunConfig
from cnns.deploy.restored_model import restore_model
from cnns.errors import DataError


# ----------------------------------------------------------------------------------------------
# Images


def image_files(arguments: Sequence[str], size_limit: int | None = None) -> list[Path]:
    """The files to predict: files as given, each a regular file within `size_limit` (--max-file-size), and
    folders as their image files (recursive, sorted; checked as they are read)."""
    from cnns.bounded_reads import check_regular_file
    from cnns.data.imagefolder import IMAGE_EXTENSIONS

    files: list[Path] = []
    for argument in arguments:
        path = Path(argument)
        if path.is_dir():
            # Every entry named as an image but a folder: a FIFO or a device among them is named when it is read.
            found = sorted(
                entry for entry in path.rglob("*")
                if entry.suffix.lower() in IMAGE_EXTENSIONS and not entry.is_dir()
                and not any(part.startswith(".") for part in entry.relative_to(path).parts)
            )
            if not found:
                raise DataError(f"{path}: no image files ({', '.join(sorted(IMAGE_EXTENSIONS))}) in the folder "
                                "or its sub-folders")
            files.extend(found)
        elif path.exists():
            check_regular_file(path, size_limit)
            files.append(path)
        else:
            raise DataError(f"image not found: {path}")
    return files


def evaluation_transform(cfg):
    """(encoded bytes, file name) -> uint8 [S, S, 3] (HWC), the run's evaluation preprocessing (module docstring):
    the evaluation loader's own `ImageNetTransform` of the run's data configuration (its decoder, its resize and
    centre crop of --eval-crop-pct with --eval-interpolation's resampler, as validation.py). On CIFAR-sized data
    the crop keeps the whole short side (--eval-crop-pct is 1 there): an image of another size than 32 x 32 has
    its short side brought to 32 and the centre square kept; CIFAR's own images are taken as they are."""
    from cnns.data.image_loader import ImageNetTransform

    return ImageNetTransform.evaluation(cfg.data)


def _failure_reason(error: Exception, path: Path) -> str:
    """decode_rgb's message without its leading "<path>: cannot decode image (...)" frame."""
    text = str(error)
    prefix = f"{path}: cannot decode image ("
    if text.startswith(prefix) and text.endswith(")"):
        return text[len(prefix):-1]
    return text


def decoded_images(files: Sequence[Path], transform,
                   size_limit: int | None = None) -> Iterator[tuple[Path, torch.Tensor | None]]:
    """(path, uint8 HWC image) per file, or (path, None) after naming the failure on stderr."""
    from cnns.bounded_reads import UnreadableFile, read_bounded

    for path in files:
        try:
            data = read_bounded(path, size_limit)
        except UnreadableFile as error:
            print(f"error: cannot read {path}: {error.reason}", file=sys.stderr)
            yield path, None
            continue
        try:
            image = transform(data, str(path))
        except DataError as error:
            print(f"error: cannot decode {path}: {_failure_reason(error, path)}", file=sys.stderr)
            yield path, None
            continue
        yield path, image.contiguous()


def _batches(items: Iterator[tuple[Path, torch.Tensor | None]], size: int):
    batch: list[tuple[Path, torch.Tensor]] = []
    for path, image in items:
        if image is None:
            continue
        batch.append((path, image))
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


# ----------------------------------------------------------------------------------------------
# The command


def predict(checkpoint: Path, cfg: RunConfig, images: Sequence[str], top_k: int = 5, as_json: bool = False,
            weights: str = "raw", batch_size: int = 64, device: str | None = None,
            max_file_size: int | None = None) -> int:
    """Print the top-k classes of every image (module docstring); 1 when an image could not be read."""
    from cnns.data.augment import normalise
    from cnns.devices import resolve_device
    from cnns.runfolder.classes import class_names

    files = image_files(images, max_file_size)
    restored = restore_model(checkpoint, cfg, weights, resolve_device(device))
    device = restored.device
    names, names_source = class_names(restored.cfg, restored.checkpoint.parent)
    top_k = min(top_k, restored.num_classes)
    print(f"predict: {restored.checkpoint} ({restored.weights} weights), {restored.description}, "
          f"{restored.num_classes} classes, names from {names_source}", file=sys.stderr)
    transform = evaluation_transform(restored.cfg)
    failures = len(files)
    for batch in _batches(decoded_images(files, transform, max_file_size), batch_size):
        images = torch.stack([image for _, image in batch]).to(device)
        with torch.inference_mode():
            logits = restored.model(normalise(images, restored.mean, restored.std, torch.float32)).float()
            probabilities = torch.softmax(logits, dim=1)
            values, indices = probabilities.topk(top_k, dim=1)
        for (path, _), row_values, row_indices in zip(batch, values.tolist(), indices.tolist()):
            failures -= 1
            labels = [names[i] if names is not None else str(i) for i in row_indices]
            if as_json:
                print(json.dumps({"path": str(path), "top_k": [
                    {"class": index, "label": label, "probability": value}
                    for index, label, value in zip(row_indices, labels, row_values)]}))
            else:
                print(f"{path}: " + ", ".join(f"{label} ({value:.4f})" for label, value in zip(labels, row_values)))
        sys.stdout.flush()
    return 1 if failures else 0


__all__ = ["predict", "evaluation_transform", "image_files", "decoded_images"]
