"""Evaluation: exact top-1 and top-5 over every image of the validation set, once."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn

from cnns.engine.feed import DeviceFeed
from cnns.engine.compilation import compilation_failures_named
from cnns.precision import PrecisionPolicy


@dataclass
class EvalResult:
    correct_top1: int
    correct_top5: int
    count: int
    seconds: float
    latencies_ms: list[float] = field(default_factory=list)

    @property
    def top1(self) -> float:
        return 100.0 * self.correct_top1 / max(self.count, 1)

    @property
    def top5(self) -> float:
        return 100.0 * self.correct_top5 / max(self.count, 1)

    @property
    def throughput(self) -> float:
        return self.count / self.seconds if self.seconds > 0 else 0.0

    @property
    def latency_avg_ms(self) -> float:
        return sum(self.latencies_ms) / len(self.latencies_ms) if self.latencies_ms else 0.0

    def merged(self, other: "EvalResult") -> "EvalResult":
        return EvalResult(self.correct_top1 + other.correct_top1, self.correct_top5 + other.correct_top5,
                          self.count + other.count, max(self.seconds, other.seconds),
                          self.latencies_ms + other.latencies_ms)


@torch.no_grad()
def evaluate(model: nn.Module, batches, feed: DeviceFeed, policy: PrecisionPolicy) -> EvalResult:
    """Counts are accumulated on the device and read once at the end; latency is per batch."""
    was_training = model.training
    model.eval()
    correct1 = correct5 = count = None
    latencies = []
    start = time.perf_counter()
    for images, labels in feed(batches):
        batch_start = time.perf_counter()
        with policy.autocast(), compilation_failures_named():
            logits = model(images)
        top5 = logits.topk(min(5, logits.shape[1]), dim=1).indices
        hits = top5 == labels[:, None]
        c1, c5 = hits[:, 0].sum(), hits.any(dim=1).sum()
        correct1 = c1 if correct1 is None else correct1 + c1
        correct5 = c5 if correct5 is None else correct5 + c5
        count = labels.shape[0] + (count or 0)
        if images.device.type == "cuda":
            torch.cuda.synchronize(images.device)
        latencies.append(1000.0 * (time.perf_counter() - batch_start))
    seconds = time.perf_counter() - start
    model.train(was_training)
    if count is None:
        return EvalResult(0, 0, 0, seconds, latencies)
    return EvalResult(int(correct1), int(correct5), count, seconds, latencies)
