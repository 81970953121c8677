"""Host -> device: Graphcore's application's infeed, and where normalisation happens.

Batches arrive as uint8 NHWC. By default they cross to the device as uint8 (Graphcore's application's 8-bit I/O,
a quarter of float32's bytes) and are normalised there into a channels_last float tensor of the
model's input dtype. With host-side normalisation the float tensor is made on the host instead.
On CUDA the copy is pinned and non-blocking, and the next batch's copy is queued before the current
batch's step, so the host never waits for a copy. It runs on the compute stream, between two steps, not
beside one: 8-bit batches are small (a quarter of the float32 batch's bytes, and a small part of a step's
memory traffic), so a second stream would save little.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Sequence

import torch

from cnns.data.augment import IMAGENET_MEAN, normalise

UNIT_STD = (1.0, 1.0, 1.0)


class DeviceFeed:
    def __init__(self, device: torch.device, dtype: torch.dtype, *, imagenet_normalisation: bool,
                 host_normalisation: bool = False):
        self.device = device
        self.dtype = dtype
        self.mean: Sequence[float] = IMAGENET_MEAN
        # Without --normalise-input Graphcore's application only subtracts the mean; batch norm takes care of scale.
        self.std: Sequence[float] = (0.229, 0.224, 0.225) if imagenet_normalisation else UNIT_STD
        self.host_normalisation = host_normalisation
        self.pin = device.type == "cuda"
        self._resident: tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] | None = None

    def to_device(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Synthetic data lives on the device already and repeats one batch: normalise it only once.
        if self._resident is not None and self._resident[0] is images:
            return self._resident[1]
        if getattr(images, "_cnns_resident", False):
            self._resident = (images, (normalise(images, self.mean, self.std, self.dtype), labels))
            return self._resident[1]
        if self.host_normalisation and images.device.type == "cpu":
            images = normalise(images, self.mean, self.std, self.dtype)
        if images.device != self.device:
            if self.pin and images.device.type == "cpu":  # only host memory is pinned
                images, labels = images.pin_memory(), labels.pin_memory()
            images = images.to(self.device, non_blocking=self.pin)
            labels = labels.to(self.device, non_blocking=self.pin)
        if images.dtype == torch.uint8:
            images = normalise(images, self.mean, self.std, self.dtype)
        return images, labels

    def __call__(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Device batches, one staged ahead on CUDA so the host queues its copy without waiting."""
        iterator = iter(batches)
        if not self.pin:
            for images, labels in iterator:
                yield self.to_device(images, labels)
            return
        staged = None
        for images, labels in iterator:
            ready, staged = staged, self.to_device(images, labels)
            if ready is not None:
                yield ready
        if staged is not None:
            yield staged
