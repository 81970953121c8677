"""Mixup and cutmix on whole batches, with Graphcore's application's semantics (--mixup-alpha, --cutmix-lambda,
--cutmix-version), as pure functions of (images, soft targets, generator).

Written by hand because torchvision's v2.MixUp / v2.CutMix differ from Graphcore's application: they
draw one Beta coefficient per batch (it draws one per image and keeps the larger side), pair each
image with its neighbour for both (it pairs by rolling the batch 1 for mixup and 2 for
cutmix, so a mixed-up image is never cut with its own partner), sample the cutmix area from a
Beta distribution (it uses a fixed or v1-sampled lambda and shifts the box inside the image)
and draw from torch's global RNG.

Graphcore's application's semantics:

* mixup: per image i, m_i ~ Beta(a, a), m_i = max(m_i, 1 - m_i) (the original image stays the
  'foreground'); image_i = m_i x_i + (1 - m_i) x_{i-1}; target_i likewise.
* cutmix: one box for the batch, with the image's aspect ratio and area (1 - lambda) H W, centre
  uniform in the image then moved so the box lies inside it, corners rounded to pixels; pixels in
  the box come from image i-2 (i-1 for batches of 2). The target weight of the base image is 1 minus
  the box's exact pixel fraction (so it matches what was pasted, not the requested lambda).
  Version 1 first draws lambda itself: 1 (no cutmix) with probability lambda*1.55 - 0.96, else
  1 + log(u)/4 with u ~ U(e^-4, 1).
* both: mixup first, then cutmix of the mixed batch; the soft targets compose the same way (its
  four-label formula is exactly this composition).

Images may be on any device; the few random numbers are drawn on the CPU generator and moved.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch

Mixer = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def one_hot(labels: torch.Tensor, num_classes: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """int labels [N] -> [N, num_classes] float targets."""
    return torch.nn.functional.one_hot(labels.long(), num_classes).to(dtype)


def smooth_targets(targets: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    """Graphcore's application's label smoothing on (soft) targets: a one-hot row becomes 1 - e on its class and
    e / (K - 1) on each other class. The map is affine, so smoothing mixed targets equals mixing
    smoothed one-hot targets (which is how Graphcore's application computes it), and rows still sum to one."""
    classes = targets.shape[-1]
    if label_smoothing == 0 or classes < 2:
        return targets
    off = label_smoothing / (classes - 1)
    return targets * (1 - label_smoothing - off) + off


def soft_target_cross_entropy(logits: torch.Tensor, targets: torch.Tensor,
                              label_smoothing: float = 0.0) -> torch.Tensor:
    """Mean over the batch of -sum_k t_k log softmax(logits)_k, in float32, with Graphcore's
    application's label smoothing applied to the targets; integer targets are one-hot encoded first."""
    logits = logits.float()
    if not targets.dtype.is_floating_point:
        targets = one_hot(targets, logits.shape[-1])
    targets = smooth_targets(targets.float(), label_smoothing)
    return torch.sum(-targets * torch.log_softmax(logits, dim=-1), dim=-1).mean()


def _numpy_rng(generator: torch.Generator) -> np.random.Generator:
    """A numpy RNG seeded from `generator`: torch has no generator-driven Beta sampler, and
    Graphcore's application drew its mixup coefficients with numpy's beta."""
    return np.random.default_rng(int(torch.randint(0, 2**62, (1,), generator=generator)))


def mixup_coefficients(batch_size: int, alpha: float, generator: torch.Generator) -> torch.Tensor:
    """m_i ~ Beta(alpha, alpha) per image, folded to max(m, 1 - m) in [0.5, 1], float32 on the CPU."""
    if alpha <= 0:
        raise ValueError(f"mixup alpha must be positive, got {alpha}")
    draws = _numpy_rng(generator).beta(alpha, alpha, batch_size)
    return torch.from_numpy(np.maximum(draws, 1 - draws)).float()


def mixup(images: torch.Tensor, targets: torch.Tensor, alpha: float,
          generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mixed images, mixed targets, coefficients m [N]): image i becomes m_i x_i + (1 - m_i) x_{i-1}.

    images: floating point [N, ...] of any layout; targets: [N, K] soft targets."""
    if not images.dtype.is_floating_point:
        raise ValueError(f"mixup needs floating-point images (normalise first), got {images.dtype}")
    coefficients = mixup_coefficients(images.shape[0], alpha, generator)
    image_weight = coefficients.to(images.device, images.dtype).view(-1, *([1] * (images.dim() - 1)))
    target_weight = coefficients.to(targets.device, targets.dtype)[:, None]
    mixed = image_weight * images + (1 - image_weight) * images.roll(1, dims=0)
    mixed_targets = target_weight * targets + (1 - target_weight) * targets.roll(1, dims=0)
    return mixed, mixed_targets, coefficients


def cutmix_partner_shift(batch_size: int) -> int:
    """Cutmix pastes from image i-2 (i-1 in a batch of two), so that after mixup (partner i-1) an
    image is not cut with the partner it was already mixed with."""
    return 2 if batch_size > 2 else 1


def sample_cutmix_lambda_v1(cutmix_lambda: float, generator: torch.Generator) -> float:
    """Cutmix version 1's random lambda: 1 with probability cutmix_lambda*1.55 - 0.96, otherwise
    1 + log(u)/4 with u uniform in [e^-4, 1), which lies in [0, 1)."""
    first, second = torch.rand(2, generator=generator, dtype=torch.float64).tolist()
    if first < cutmix_lambda * 1.55 - 0.96:
        return 1.0
    low = math.exp(-4.0)
    return 1.0 + math.log(low + (1.0 - low) * second) / 4.0


def cutmix_box(height: int, width: int, cutmix_lambda: float,
               generator: torch.Generator) -> tuple[int, int, int, int]:
    """(top, bottom, left, right) pixel bounds (bottom/right exclusive) of the pasted box: the
    image's aspect ratio, area ~ (1 - lambda) of it, centre uniform then moved inside the image."""
    centre_y, centre_x = torch.rand(2, generator=generator, dtype=torch.float64).tolist()
    centre_x, centre_y = centre_x * width, centre_y * height
    box_width = width * math.sqrt(1.0 - cutmix_lambda)
    box_height = height * math.sqrt(1.0 - cutmix_lambda)
    centre_x = min(max(centre_x, box_width / 2), width - box_width / 2)
    centre_y = min(max(centre_y, box_height / 2), height - box_height / 2)
    left = min(max(round(centre_x - box_width / 2), 0), width)
    right = min(max(round(centre_x + box_width / 2), left), width)
    top = min(max(round(centre_y - box_height / 2), 0), height)
    bottom = min(max(round(centre_y + box_height / 2), top), height)
    return top, bottom, left, right


def cutmix(images: torch.Tensor, targets: torch.Tensor, cutmix_lambda: float, generator: torch.Generator,
           version: int = 2, layout: str = "NCHW") -> tuple[torch.Tensor, torch.Tensor, float]:
    """(cut images, targets, weight): one box of the batch replaced by the same box of image i-2
    (i-1 for two images); targets = weight * t_i + (1 - weight) * t_partner, where weight is the
    exact fraction of the image's pixels outside the box.

    images: [N, C, H, W] ("NCHW") or [N, H, W, C] ("NHWC"), any dtype; targets: [N, K]."""
    if not 0.0 <= cutmix_lambda <= 1.0:
        raise ValueError(f"cutmix lambda must be between 0 and 1, got {cutmix_lambda}")
    if version not in (1, 2):
        raise ValueError(f"cutmix version must be 1 or 2, got {version}")
    if layout not in ("NCHW", "NHWC"):
        raise ValueError(f"layout must be NCHW or NHWC, got {layout!r}")
    if version == 1:
        cutmix_lambda = sample_cutmix_lambda_v1(cutmix_lambda, generator)
    height, width = images.shape[2:4] if layout == "NCHW" else images.shape[1:3]
    top, bottom, left, right = cutmix_box(height, width, cutmix_lambda, generator)
    shift = cutmix_partner_shift(images.shape[0])
    partners = images.roll(shift, dims=0)
    cut = images.clone()
    if layout == "NCHW":
        cut[:, :, top:bottom, left:right] = partners[:, :, top:bottom, left:right]
    else:
        cut[:, top:bottom, left:right, :] = partners[:, top:bottom, left:right, :]
    weight = 1.0 - (bottom - top) * (right - left) / (height * width)
    mixed_targets = weight * targets + (1.0 - weight) * targets.roll(shift, dims=0)
    return cut, mixed_targets, weight


def mix_batch(images: torch.Tensor, labels: torch.Tensor, num_classes: int, generator: torch.Generator, *,
              mixup_alpha: float = 0.0, cutmix_lambda: float = 1.0, cutmix_version: int = 1,
              label_smoothing: float = 0.0, layout: str = "NCHW") -> tuple[torch.Tensor, torch.Tensor]:
    """Graphcore's application's training-time mixing of one batch: mixup if alpha > 0, then cutmix if lambda < 1.
    Returns (images, [N, num_classes] float32 soft targets) with that label smoothing
    applied, ready for a cross entropy that takes soft targets as given."""
    targets = one_hot(labels, num_classes).to(images.device)
    if mixup_alpha > 0:
        images, targets, _ = mixup(images, targets, mixup_alpha, generator)
    if cutmix_lambda < 1:
        images, targets, _ = cutmix(images, targets, cutmix_lambda, generator, cutmix_version, layout)
    return images, smooth_targets(targets, label_smoothing)


def batch_mixer(num_classes: int, seed: int, *, mixup_alpha: float = 0.0, cutmix_lambda: float = 1.0,
                cutmix_version: int = 1, label_smoothing: float = 0.0, layout: str = "NCHW") -> Mixer | None:
    """A (images, labels) -> (images, soft targets) callable drawing from one CPU generator seeded
    with `seed` (seed it per rank), or None when neither mixup nor cutmix is on."""
    if mixup_alpha <= 0 and cutmix_lambda >= 1:
        return None
    generator = torch.Generator().manual_seed(seed)

    def mix(images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return mix_batch(images, labels, num_classes, generator, mixup_alpha=mixup_alpha, cutmix_lambda=cutmix_lambda,
                         cutmix_version=cutmix_version, label_smoothing=label_smoothing, layout=layout)

    mix.generator = generator  # checkpointed with the run's random states, so a restore continues it
    return mix
