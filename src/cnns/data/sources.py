"""From a DataConfig to batch sources for training and evaluation.

Every source yields (uint8 NHWC images, int64 labels) batches through the same small protocol:
``len(source)`` batches per epoch, ``source.epoch(e, start_batch)`` and ``source.num_samples``. The
device side (`cnns.engine.feed`) moves them to the device and normalises them there, which is
Graphcore's application's 8-bit I/O: a quarter of the bytes of float32 cross to the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from cnns.data.formats import BatchSource, SourceRequest, dataset_facts, find_format
from cnns.data.data_config import DataConfig


class SyntheticBatches:
    """One random batch made once on the device and yielded forever: no host input pipeline at all.

    An epoch has as many batches as a real source of `num_samples` samples would have on this shard
    (cnns.data.batches.ShardPlan), so the run's epochs count the same as with real data."""

    def __init__(self, batch_size: int, image_size: int, num_classes: int, num_samples: int,
                 device: torch.device, seed: int, *, shard: tuple[int, int] = (0, 1),
                 global_batch_size: int | None = None):
        from cnns.data.batches import ShardPlan

        plan = ShardPlan(num_samples, batch_size, shard[0], shard[1], True, global_batch_size)
        generator = torch.Generator().manual_seed(seed)
        images = torch.randint(0, 256, (batch_size, image_size, image_size, 3), dtype=torch.uint8, generator=generator)
        labels = torch.randint(0, num_classes, (batch_size,), generator=generator)
        self.batch = (images.to(device), labels.to(device))
        self.batch[0]._cnns_resident = True  # tells the device feed to normalise it once, not every step
        self.batches_per_epoch = max(1, len(plan))
        self.num_samples = num_samples

    def __len__(self) -> int:
        return self.batches_per_epoch

    def epoch(self, epoch: int, start_batch: int = 0):
        for _ in range(start_batch, self.batches_per_epoch):
            yield self.batch


@dataclass
class DataSources:
    dataset: str
    num_classes: int  # the model's outputs (cfg.num_classes): every label lies below it
    train: BatchSource | None  # None where the command does not train (`need_train`)
    eval: BatchSource | None
    decoding: str | None = None  # how the files are decoded, where that is a choice: a line for the run's header
    decoded_in_workers: bool = False  # by --pipeline-num-parallel worker processes, rather than the main process


def build_sources(cfg: DataConfig, *, micro_batch_size: int, eval_batch_size: int, seed: int,
                  device: torch.device, shard: tuple[int, int] = (0, 1), need_eval: bool = True,
                  need_train: bool = True, global_batch_size: int | None = None,
                  step_rate: Callable[[], float] | None = None) -> DataSources:
    """The run's training and evaluation sources for shard (replica rank, replicas): generated or synthetic
    batches, or its data format's (`cnns.data.formats`).

    global_batch_size (micro-batch x accumulation x replicas, a multiple of micro_batch_size x
    replicas) makes every training epoch a whole number of global batches, the same samples for
    any split of the global batch into replicas x accumulation (cnns.data.batches.ShardPlan);
    None keeps whole micro-batch groups only. Evaluation ignores it: every image exactly once
    over all the ranks, with any batch size. step_rate: the training step's images/s, estimated where
    --decode-device auto asks (`SourceRequest.step_rate`)."""
    num_classes = cfg.num_classes  # generated labels: the model's classes
    # A source that is not needed is not built, as a data format builds none (`SourceRequest`): evaluation with
    # another replica count than training never meets the training run's global batch, which it need not divide.
    if cfg.source == "synthetic":
        facts = dataset_facts(cfg.dataset)
        train = SyntheticBatches(micro_batch_size, cfg.image_size, num_classes, facts.train_images,
                                 device, seed, shard=shard, global_batch_size=global_batch_size) if need_train else None
        evaluation = SyntheticBatches(eval_batch_size, cfg.image_size, num_classes, facts.eval_images,
                                      device, seed + 1, shard=shard) if need_eval else None
        return DataSources(cfg.dataset, num_classes, train, evaluation)
    if cfg.source == "generated":
        from cnns.data.batches import GeneratedBatches

        facts = dataset_facts(cfg.dataset)
        train = GeneratedBatches(micro_batch_size, cfg.image_size, num_classes,
                                 num_samples=facts.train_images, seed=seed, shard=shard,
                                 global_batch_size=global_batch_size) if need_train else None
        evaluation = GeneratedBatches(eval_batch_size, cfg.image_size, num_classes,
                                      num_samples=facts.eval_images, seed=seed + 1, drop_last=False,
                                      shard=shard) if need_eval else None
        return DataSources(cfg.dataset, num_classes, train, evaluation)
    data_format, folder = find_format(cfg.dataset, cfg.data_dir)
    request = SourceRequest(micro_batch_size, eval_batch_size, seed, device, shard, need_train, need_eval,
                            global_batch_size, step_rate)
    made = data_format.sources(cfg, folder, request)
    return DataSources(data_format.dataset.name, num_classes, made.train, made.eval, made.decoding,
                       data_format.decoded_in_workers)
