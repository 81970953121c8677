"""Mixup and cutmix against closed forms: mixed pixels, pasted areas and target weights."""

from __future__ import annotations

import math

import pytest
import torch

from cnns.data.mixing import (
    batch_mixer,
    cutmix,
    cutmix_box,
    mix_batch,
    mixup,
    one_hot,
    sample_cutmix_lambda_v1,
    smooth_targets,
    soft_target_cross_entropy,
)


def generator(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def constant_images(count: int, height: int, width: int, layout: str = "NCHW") -> torch.Tensor:
    """Image i is filled with the value i + 1, so each pixel tells which image it came from."""
    values = torch.arange(1, count + 1, dtype=torch.float32)
    shape = (count, 3, height, width) if layout == "NCHW" else (count, height, width, 3)
    return values.view(count, 1, 1, 1).expand(shape).contiguous()


def test_mixup_is_per_image_convex_combination_with_previous_image():
    images = torch.randn(6, 3, 5, 7)
    labels = torch.tensor([0, 1, 2, 3, 4, 0])
    targets = one_hot(labels, 5)
    mixed, mixed_targets, lam = mixup(images, targets, alpha=0.4, generator=generator(1))
    assert lam.shape == (6,) and (lam >= 0.5).all() and (lam <= 1).all() and len(set(lam.tolist())) > 1
    for i in range(6):
        expected = lam[i] * images[i] + (1 - lam[i]) * images[i - 1]
        assert torch.allclose(mixed[i], expected, atol=1e-6)
        assert torch.allclose(mixed_targets[i], lam[i] * targets[i] + (1 - lam[i]) * targets[i - 1])
    assert torch.allclose(mixed_targets.sum(dim=1), torch.ones(6))
    with pytest.raises(ValueError):
        mixup(torch.zeros(2, 3, 4, 4, dtype=torch.uint8), targets[:2], 0.2, generator())


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("cutmix_lambda", [0.0, 0.1, 0.37, 0.5, 0.9, 0.999, 1.0])
@pytest.mark.parametrize("height, width", [(8, 8), (7, 13), (32, 3)])
def test_cutmix_weight_is_exact_pasted_fraction(layout, cutmix_lambda, height, width):
    count = 5
    images = constant_images(count, height, width, layout)
    targets = one_hot(torch.arange(count), count)
    for seed in range(4):
        cut, mixed_targets, weight = cutmix(images, targets, cutmix_lambda, generator(seed), version=2, layout=layout)
        plane = cut[:, 0] if layout == "NCHW" else cut[..., 0]
        for i in range(count):
            partner = (i - 2) % count
            pasted = int((plane[i] == partner + 1).sum())
            kept = int((plane[i] == i + 1).sum())
            assert kept + pasted == height * width
            from_partner = pasted / (height * width)
            assert weight == pytest.approx(1.0 - from_partner, abs=1e-12)
            assert mixed_targets[i, i].item() == pytest.approx(weight)
            if partner != i:
                assert mixed_targets[i, partner].item() == pytest.approx(1.0 - weight)
        assert torch.allclose(mixed_targets.sum(dim=1), torch.ones(count))
        # The box follows the requested area up to pixel rounding.
        assert abs((1 - weight) - (1 - cutmix_lambda)) <= (height + width + 1) / (height * width) + 1e-9
    if cutmix_lambda == 0.0:
        assert weight == 0.0
    if cutmix_lambda == 1.0:
        assert weight == 1.0 and torch.equal(cut, images)


def test_cutmix_box_lies_inside_the_image():
    for seed in range(50):
        top, bottom, left, right = cutmix_box(10, 17, 0.3, generator(seed))
        assert 0 <= top <= bottom <= 10 and 0 <= left <= right <= 17
        assert (bottom - top) == pytest.approx(10 * math.sqrt(0.7), abs=1) and (right - left) == pytest.approx(
            17 * math.sqrt(0.7), abs=1)


def test_cutmix_partner_for_two_images_is_the_other_one():
    images = constant_images(2, 6, 6)
    cut, targets, weight = cutmix(images, one_hot(torch.tensor([0, 1]), 2), 0.5, generator(), version=2)
    assert set(cut[0].unique().tolist()) == {1.0, 2.0} and targets[0, 1] == pytest.approx(1 - weight)


def test_cutmix_version_1_lambda_distribution():
    draws = [sample_cutmix_lambda_v1(1.0, generator(seed)) for seed in range(400)]
    assert all(0.0 <= d <= 1.0 for d in draws)
    ones = sum(d == 1.0 for d in draws) / len(draws)
    assert abs(ones - 0.59) < 0.1  # P(lambda = 1) = 1.55 * 1.0 - 0.96
    assert all(sample_cutmix_lambda_v1(0.5, generator(s)) < 1.0 for s in range(20))  # 1.55 * 0.5 - 0.96 < 0
    cut, targets, weight = cutmix(constant_images(4, 8, 8), one_hot(torch.arange(4), 4), 0.5, generator(3), version=1)
    assert torch.allclose(targets.sum(dim=1), torch.ones(4)) and 0.0 <= weight <= 1.0


def test_mix_batch_composes_mixup_then_cutmix_as_graphcore_does():
    count, classes = 6, 10
    images = torch.randn(count, 3, 8, 8)
    labels = torch.tensor([1, 4, 7, 2, 9, 0])
    mixed, targets = mix_batch(images, labels, classes, generator(7), mixup_alpha=0.2, cutmix_lambda=0.6,
                               cutmix_version=2)
    assert mixed.shape == images.shape and targets.shape == (count, classes)
    assert torch.allclose(targets.sum(dim=1), torch.ones(count))

    # Replay the same draws step by step and compare with the four-label formula of Graphcore's application.
    g = generator(7)
    onehot = one_hot(labels, classes)
    after_mixup, mixup_targets, m = mixup(images, onehot, 0.2, g)
    after_cutmix, _, w = cutmix(after_mixup, mixup_targets, 0.6, g, version=2)
    assert torch.equal(mixed, after_cutmix)
    m2 = m.roll(2)
    four_labels = (m[:, None] * w * onehot + (1 - m[:, None]) * w * onehot.roll(1, 0)
                   + m2[:, None] * (1 - w) * onehot.roll(2, 0) + (1 - m2[:, None]) * (1 - w) * onehot.roll(3, 0))
    assert torch.allclose(targets, four_labels, atol=1e-6)


def test_label_smoothing_matches_graphcores_application_and_torch():
    logits = torch.randn(4, 5)
    labels = torch.tensor([0, 3, 4, 1])
    smoothed = smooth_targets(one_hot(labels, 5), 0.1)
    assert torch.allclose(smoothed.sum(dim=1), torch.ones(4))
    assert smoothed[0, 0] == pytest.approx(0.9) and smoothed[0, 1] == pytest.approx(0.1 / 4)
    plain = soft_target_cross_entropy(logits, labels)
    assert torch.allclose(plain, torch.nn.functional.cross_entropy(logits, labels))
    # Graphcore's e over the K-1 other classes is torch's label_smoothing with e * K / (K - 1).
    assert torch.allclose(soft_target_cross_entropy(logits, one_hot(labels, 5), 0.1),
                          torch.nn.functional.cross_entropy(logits, labels, label_smoothing=0.1 * 5 / 4))


def test_batch_mixer_is_seeded_and_off_when_disabled():
    assert batch_mixer(10, 0) is None
    images, labels = torch.randn(4, 3, 6, 6), torch.tensor([0, 1, 2, 3])
    first = batch_mixer(10, 3, mixup_alpha=0.2, cutmix_lambda=0.5, label_smoothing=0.1)(images, labels)
    second = batch_mixer(10, 3, mixup_alpha=0.2, cutmix_lambda=0.5, label_smoothing=0.1)(images, labels)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    assert torch.allclose(first[1].sum(dim=1), torch.ones(4)) and first[1].min() > 0
