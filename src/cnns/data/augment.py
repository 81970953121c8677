"""Whole-batch augmentation and normalisation for uint8 NHWC image batches, on CPU or CUDA.

Every function works on the whole batch with tensor ops, one call per batch instead of one per image: at
CIFAR sizes a Python loop per image costs more than the model's forward pass, and on a GPU the batch is
augmented where it is trained (docs/performance.md has the measurements).
"""

from __future__ import annotations

import functools
from typing import Protocol, Sequence

import torch
import torch.nn.functional as F

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class Augment(Protocol):
    """A per-sample random augmentation of uint8 NHWC batches, split in two so that the random draw
    can be made per sample, independently of how samples are batched: `draw(count, generator)`
    returns one row of parameters per sample (a CPU tensor [count, ...]), and
    `augment(images, params)` applies the rows to a batch, params[i] to images[i], with tensor ops
    on the whole batch. TensorBatches draws the rows of a whole epoch at once and gathers each
    batch's rows by the samples it holds."""

    def draw(self, count: int, generator: torch.Generator) -> torch.Tensor: ...

    def __call__(self, images: torch.Tensor, params: torch.Tensor) -> torch.Tensor: ...


def draw_crop_flip(count: int, padding: int, generator: torch.Generator) -> torch.Tensor:
    """int64 [count, 3] random (row offset, column offset, flip) per image for crop_flip: offsets in
    0..2*padding, flip 0 or 1. Drawn on the generator's own device and returned there."""
    draw_device = generator.device
    row_offsets = torch.randint(0, 2 * padding + 1, (count,), generator=generator, device=draw_device)
    col_offsets = torch.randint(0, 2 * padding + 1, (count,), generator=generator, device=draw_device)
    flips = torch.randint(0, 2, (count,), generator=generator, device=draw_device)
    return torch.stack([row_offsets, col_offsets, flips], 1)


def crop_flip(images: torch.Tensor, params: torch.Tensor, padding: int) -> torch.Tensor:
    """CIFAR augmentation with given parameters: zero-pad `padding` pixels on each side, crop the
    H x W window at (params[n, 0], params[n, 1]) of image n, and flip it horizontally if
    params[n, 2] is 1.

    images: uint8 [N, H, W, C] on any device; params: int64 [N, 3] (draw_crop_flip) on any device
    (it is moved to the images' device: 3N small numbers). Returns a new uint8 [N, H, W, C].
    """
    count, height, width, _ = images.shape
    if params.shape != (count, 3):
        raise ValueError(f"expected crop and flip parameters of shape [{count}, 3], got {list(params.shape)}")
    params = params.to(images.device)
    row_offsets, col_offsets, flips = params[:, 0], params[:, 1], params[:, 2].bool()

    padded = F.pad(images, (0, 0, padding, padding, padding, padding)) if padding else images
    rows = row_offsets[:, None] + torch.arange(height, device=images.device)  # [N, H]
    cols = torch.arange(width, device=images.device).expand(count, width)  # [N, W]
    # A flip of the crop is the crop read right to left.
    cols = torch.where(flips[:, None], cols.flip(1), cols) + col_offsets[:, None]
    return _gather_pixels(padded, rows, cols)


def random_crop_flip(images: torch.Tensor, padding: int, generator: torch.Generator) -> torch.Tensor:
    """crop_flip with parameters drawn from `generator` for this batch (draw_crop_flip).

    The draw is made on the generator's own device (a CPU generator is fine for CUDA images: only
    3N numbers are drawn, then moved), so the same seed gives the same augmentation whatever
    device the images are on.
    """
    return crop_flip(images, draw_crop_flip(len(images), padding, generator), padding)


def _gather_pixels(images: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """out[n, i, j] = images[n, rows[n, i], cols[n, j]] for all pixels at once.

    One flat index per output pixel and a single index_select of whole pixels (C bytes each):
    cheaper than three-tensor advanced indexing, which broadcasts and checks three index tensors.
    """
    count, height, width, channels = images.shape
    image_starts = torch.arange(count, device=images.device) * (height * width)
    flat = image_starts[:, None, None] + rows[:, :, None] * width + cols[:, None, :]
    pixels = images.reshape(count * height * width, channels)
    return pixels.index_select(0, flat.reshape(-1)).view(count, rows.shape[1], cols.shape[1], channels)


class CropFlip:
    """The CIFAR training augmentation (pad, random crop, random flip) in the Augment form."""

    def __init__(self, padding: int = 4) -> None:
        if padding < 0:
            raise ValueError(f"padding must not be negative, got {padding}")
        self.padding = padding

    def draw(self, count: int, generator: torch.Generator) -> torch.Tensor:
        return draw_crop_flip(count, self.padding, generator)

    def __call__(self, images: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
        return crop_flip(images, params, self.padding)


def cifar_augment(padding: int = 4) -> CropFlip:
    """The CIFAR training augmentation with `padding` pixels of zero padding, for TensorBatches."""
    return CropFlip(padding)


def normalise(
    images_uint8_nhwc: torch.Tensor,
    mean: Sequence[float],
    std: Sequence[float],
    dtype: torch.dtype,
) -> torch.Tensor:
    """uint8 [N, H, W, C] -> `dtype` [N, C, H, W] in channels_last memory format, (x/255 - mean)/std.

    The permute of a contiguous NHWC tensor already has channels_last strides, so no layout copy
    is made; the arithmetic runs in float32 (exact enough for any dtype) and is cast at the end.
    """
    images = images_uint8_nhwc
    if images.dtype != torch.uint8 or images.dim() != 4:
        raise ValueError(f"expected uint8 [N, H, W, C] images, got {images.dtype} {list(images.shape)}")
    channels = images.shape[3]
    if len(mean) != channels or len(std) != channels:
        raise ValueError(f"mean and std need {channels} values, got {len(mean)} and {len(std)}")
    constants = (tuple(map(float, mean)), tuple(map(float, std)), images.device)
    # Traced by torch.export or torch.compile the constants are the trace's (fake) tensors: computed for it, never
    # cached, or the next eager batch or export in this process would be handed them.
    if torch.compiler.is_compiling():
        scale, shift = _scale_and_shift.__wrapped__(*constants)
    else:
        scale, shift = _scale_and_shift(*constants)
    nchw = images.permute(0, 3, 1, 2)
    result = torch.addcmul(shift, nchw.to(torch.float32), scale)
    return result.to(dtype).contiguous(memory_format=torch.channels_last)


@functools.lru_cache(maxsize=16)
def _scale_and_shift(mean: tuple[float, ...], std: tuple[float, ...], device: torch.device):
    """(x/255 - mean)/std == x * scale + shift, per channel: one multiply-add per element.

    Cached per device because the run normalises every batch with the same constants, and a
    fresh host->device copy of them each step would make the host wait for the copy."""
    std64 = torch.tensor(std, dtype=torch.float64)
    mean64 = torch.tensor(mean, dtype=torch.float64)
    scale = (1.0 / (255.0 * std64)).to(torch.float32).view(1, -1, 1, 1).to(device)
    shift = (-mean64 / std64).to(torch.float32).view(1, -1, 1, 1).to(device)
    return scale, shift
