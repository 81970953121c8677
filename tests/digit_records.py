"""scikit-learn's handwritten digits (1,797 real 8x8 images, 10 classes) as CIFAR-10 binary files: each image
scaled 4x to 32x32 grey RGB, the first 1,500 for training, the other 297 held out for validation."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import torch

from cnns.data.cifar_records import write_cifar10

TRAIN_IMAGES = 1500


def write_digits_cifar10(folder: Path) -> Path:
    from sklearn.datasets import load_digits

    digits = load_digits()
    pixels = np.kron((digits.images * 255 / 16).astype(np.uint8), np.ones((1, 4, 4), np.uint8))  # N x 32 x 32
    images = torch.from_numpy(np.ascontiguousarray(np.stack([pixels] * 3, axis=-1)))  # N x 32 x 32 x 3
    labels = torch.from_numpy(digits.target.astype(np.int64))
    write_cifar10(folder, (images[:TRAIN_IMAGES], labels[:TRAIN_IMAGES]),
                  (images[TRAIN_IMAGES:], labels[TRAIN_IMAGES:]))
    return folder


def held_out_accuracy(run: Path) -> float:
    """The top-1 accuracy (%) of a run's last validation (validation.csv), on the 297 held-out digits."""
    with open(run / "validation.csv", newline="") as rows:
        return float(list(csv.DictReader(rows))[-1]["val_acc"])
