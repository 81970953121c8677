"""Whole-batch augmentation and normalisation for uint8 NHWC image batches, on CPU or CUDA.

Every function works on the whole batch with tensor ops: on a 2-core CPU a Python loop per image
(or a worker process per core) costs more than the model's forward pass at CIFAR sizes.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def random_crop_flip(images: torch.Tensor, padding: int, generator: torch.Generator) -> torch.Tensor:
    """CIFAR augmentation: zero-pad `padding` pixels on each side, crop a random H x W window per
    image, and flip each image horizontally with probability 0.5.

    images: uint8 [N, H, W, C] on any device; returns a new uint8 [N, H, W, C] on the same device.
    The random offsets and flips are drawn from `generator` on the generator's own device (a CPU
    generator is fine for CUDA images: only 3N numbers are drawn, then moved), so the same seed
    gives the same augmentation whatever device the images are on.
    """
    count, height, width, _ = images.shape
    draw_device = generator.device
    row_offsets = torch.randint(0, 2 * padding + 1, (count,), generator=generator, device=draw_device)
    col_offsets = torch.randint(0, 2 * padding + 1, (count,), generator=generator, device=draw_device)
    flips = torch.randint(0, 2, (count,), generator=generator, device=draw_device).bool()
    row_offsets, col_offsets, flips = (t.to(images.device) for t in (row_offsets, col_offsets, flips))

    padded = F.pad(images, (0, 0, padding, padding, padding, padding)) if padding else images
    rows = row_offsets[:, None] + torch.arange(height, device=images.device)  # [N, H]
    cols = torch.arange(width, device=images.device).expand(count, width)  # [N, W]
    # A flip of the crop is the crop read right to left.
    cols = torch.where(flips[:, None], cols.flip(1), cols) + col_offsets[:, None]
    return _gather_pixels(padded, rows, cols)


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


def cifar_augment(padding: int = 4) -> Callable[[torch.Tensor, torch.Generator], torch.Tensor]:
    """random_crop_flip with a fixed padding, in the (images, generator) form TensorBatches calls."""

    def augment(images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        return random_crop_flip(images, padding, generator)

    return augment


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
    scale, shift = _scale_and_shift(tuple(map(float, mean)), tuple(map(float, std)), images.device)
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
