"""ImageNet's JPEGs decoded by NVIDIA DALI (--decode-device dali): on a GPU with hardware JPEG decoders (the
NVJPG engines of the A100, H100 and H200) the training crop's region is decoded there, beside the compute units
rather than on them, and resized and flipped on the GPU, as NVIDIA's MLPerf ResNet-50 feeds its GPUs; on a run
without a GPU the same pipeline runs on DALI's CPU backend, which is how its plumbing is tested without one.

DALI only decodes. Everything that decides *what* a batch holds is cnns's own, so a run reads the same images
in the same order, with the same crops, as with the CPU decoder, by construction:

- the epoch's order, the replica's share and the restore position: the JPEG-folder / TFRecord loader's
  samplers (`cnns.data.image_loader.TrainingSampler`, `EvaluationSampler`, `BatchKeys`), read here in the main
  process;
- the training crop and flip of each (seed, epoch, index): `ImageNetTransform.crop`, drawn from the JPEG
  header's size, then handed to DALI's region decoder (`fn.decoders.image_slice`, absolute anchor and shape per
  sample) through `fn.external_source`;
- evaluation: the resize and centre crop of `cnns.data.image_loader.evaluation_crop`, as the CPU decoder's
  whole-image path computes its sizes (`resize_crop_into`): the whole image resized to those sizes, then the
  box cut out (`fn.slice`).

Files DALI is not given (grey-or-colour JPEGs only: PNG bytes named .JPEG, CMYK JPEGs) are decoded by cnns's
CPU decoder in the main process and put into their rows, as the nvJPEG path does (`DeviceBatch`). Batches come
out as every source's: (uint8 [N, S, S, 3], int64 [N]), on the run's GPU or on the CPU; the device feed
normalises them (8-bit I/O).

DALI is an optional extra (`pip install -e '.[dali]'`): nothing imports it unless --decode-device dali (or
auto on a GPU with hardware decoders) chose it.
"""

from __future__ import annotations

import functools
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
import torch

from cnns.data.dali_probe import HW_DECODER_LOAD, check_dali_installed
from cnns.data.decoding import Crop, ImageDecoder, device_jpeg_size
from cnns.data.image_loader import (EVAL_CROP_PCT, EVAL_INTERPOLATION, BatchKeys, EpochBatches, EvaluationSampler,
                                   ImageNetTransform, ImageRecords, SampleKey, TrainingSampler, _index,
                                   training_subset)
from cnns.errors import ConfigError, DataError, first_line

# Batches handed to DALI before the one being taken out, so that decoding the next overlaps the step. Each is
# fed and scheduled on its own (`schedule_run`), so that the pipeline never runs an iteration it was not fed:
# DALI's own prefetching (prefetch_queue_depth > 1) would, at an epoch's end.
BATCHES_AHEAD = 2


# ----------------------------------------------------------------------------------------------
# The pipelines
# ----------------------------------------------------------------------------------------------


def _decoder_options(device: torch.device) -> dict:
    """DALI's decoder device: "mixed" on a GPU (the hardware decoder where there is one), else the CPU. The pixels
    in the file's stored orientation, as every cnns decoder gives them (`stored_orientation`): the crops are drawn
    from the header's stored size."""
    from nvidia.dali import types

    common = dict(output_type=types.RGB, adjust_orientation=False)
    if device.type == "cuda":
        return dict(device="mixed", hw_decoder_load=HW_DECODER_LOAD, **common)
    return dict(device="cpu", **common)



def _device_id(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    return device.index if device.index is not None else torch.cuda.current_device()


def build_pipeline(train: bool, batch_size: int, image_size: int, threads: int, device: torch.device):
    """A DALI pipeline fed batch by batch (`feed_input`) with the encoded JPEGs and, per sample, where to cut:

    training: the crop's (left, top) and (width, height) in source pixels (DALI's WH order) and whether to
    flip; the crop's region decoded (`image_slice`), resized to image_size x image_size. Evaluation: the
    whole image decoded, resized to the per-sample (width, height), the (left, top) image_size square cut out.
    Both resize with the antialiased linear (triangle) filter, torch's and PIL's antialiased bilinear."""
    from nvidia.dali import fn, types
    from nvidia.dali.pipeline import Pipeline

    pipe = Pipeline(batch_size=batch_size, num_threads=max(1, threads), device_id=_device_id(device),
                    prefetch_queue_depth=1, exec_async=True, exec_pipelined=True)
    with pipe:
        encoded = fn.external_source(name="encoded", dtype=types.UINT8, ndim=1)
        anchor = fn.external_source(name="anchor", dtype=types.INT32, ndim=1)
        if train:
            shape = fn.external_source(name="shape", dtype=types.INT32, ndim=1)
            flip = fn.external_source(name="flip", dtype=types.INT32, ndim=0)
            images = fn.decoders.image_slice(encoded, anchor, shape, **_decoder_options(device))
            images = fn.resize(images, resize_x=image_size, resize_y=image_size, interp_type=types.INTERP_LINEAR,
                               antialias=True)
            images = fn.flip(images, horizontal=flip)
        else:
            size = fn.external_source(name="size", dtype=types.FLOAT, ndim=1)
            images = fn.decoders.image(encoded, **_decoder_options(device))
            images = fn.resize(images, size=size, interp_type=types.INTERP_LINEAR, antialias=True)
            # start as an argument input (on the CPU, as a GPU slice needs it), the shape a constant
            images = fn.slice(images, start=anchor, shape=[image_size, image_size], axis_names="WH")
        pipe.set_outputs(images)
    pipe.build()
    return pipe


@dataclass(frozen=True)
class DaliSample:
    """One JPEG for DALI and where to cut it (the inputs `build_pipeline` takes, in DALI's WH order)."""

    data: np.ndarray  # the encoded bytes
    source: str  # the file, for messages
    anchor: tuple[int, int]  # (left, top)
    shape: tuple[int, int] = (0, 0)  # training: the crop's (width, height)
    flip: bool = False
    size: tuple[int, int] = (0, 0)  # evaluation: the whole image resized to (width, height)


def training_sample(data: bytes, source: str, crop: Crop) -> DaliSample:
    """A training crop (whole source pixels: `training_crop`'s boxes are integers)."""
    top, left, height, width = (int(value) for value in crop.box)
    return DaliSample(np.frombuffer(data, dtype=np.uint8), source, (left, top), (width, height), crop.flip)


def evaluation_sample(data: bytes, source: str, crop: Crop, image_shape: tuple[int, int], image_size: int) -> DaliSample:
    """An evaluation crop (`evaluation_crop`'s box, resize then cut), with the sizes the CPU decoder's whole-image
    path computes for it (`cnns.data.decoding.resize_crop_into`), so both cut the same pixels."""
    height, width = image_shape
    top, left, box_height, box_width = crop.box
    scale_y, scale_x = image_size / box_height, image_size / box_width
    resized = (max(1, round(width * scale_x)), max(1, round(height * scale_y)))
    return DaliSample(np.frombuffer(data, dtype=np.uint8), source, (round(left * scale_x), round(top * scale_y)),
                      size=resized)


def decode_alone(data: np.ndarray, device: torch.device) -> None:
    """Decode one JPEG whole with DALI's decoder on `device`; RuntimeError where it cannot."""
    from nvidia.dali import fn, types
    from nvidia.dali.pipeline import Pipeline

    pipe = Pipeline(batch_size=1, num_threads=1, device_id=_device_id(device), exec_async=False,
                    exec_pipelined=False, prefetch_queue_depth=1)
    with pipe:
        encoded = fn.external_source(name="encoded", dtype=types.UINT8, ndim=1)
        pipe.set_outputs(fn.decoders.image(encoded, **_decoder_options(device)))
    pipe.build()
    pipe.feed_input("encoded", [data])
    pipe.run()  # one iteration, fed and run at once (exec_pipelined False)


def feed(pipe, train: bool, samples: list[DaliSample]) -> None:
    """Queue one batch's inputs on the pipeline and schedule its iteration (batches come out in the order fed)."""
    pipe.feed_input("encoded", [sample.data for sample in samples])
    pipe.feed_input("anchor", [np.array(sample.anchor, dtype=np.int32) for sample in samples])
    if train:
        pipe.feed_input("shape", [np.array(sample.shape, dtype=np.int32) for sample in samples])
        pipe.feed_input("flip", [np.array(int(sample.flip), dtype=np.int32) for sample in samples])
    else:
        # fn.resize's `size` is in the image's layout order (HWC: height, width)
        pipe.feed_input("size", [np.array(sample.size[::-1], dtype=np.float32) for sample in samples])
    pipe.schedule_run()


def take_output(pipe, device: torch.device) -> torch.Tensor:
    """The oldest scheduled batch (uniform uint8 [n, S, S, 3]) copied out of DALI's buffer into a new torch tensor
    on `device`, and the buffer given back to DALI."""
    (images,) = pipe.share_outputs()  # waits for the batch: host-synchronous
    try:
        return as_torch(images.as_tensor(), device)
    finally:
        pipe.release_outputs()


def as_torch(tensor, device: torch.device) -> torch.Tensor:
    """A copy of DALI's tensor in a new torch tensor on `device`. On a GPU the copy runs on a stream of its own and
    is waited for, so that DALI may reuse its buffer at once, without waiting for the training step queued on
    torch's current stream; the tensor is then handed to the current stream."""
    from nvidia.dali.plugin.pytorch import feed_ndarray

    shape = tuple(tensor.shape())
    if device.type != "cuda":
        out = torch.empty(shape, dtype=torch.uint8)
        feed_ndarray(tensor, out)
        return out
    copies = copy_stream(device)
    with torch.cuda.stream(copies):  # allocated from the copy stream's memory, so no queued kernel still uses it
        out = torch.empty(shape, dtype=torch.uint8, device=device)
        feed_ndarray(tensor, out, cuda_stream=copies)
    copies.synchronize()
    out.record_stream(torch.cuda.current_stream(device))
    return out


@functools.cache
def copy_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


# ----------------------------------------------------------------------------------------------
# A batch on its way
# ----------------------------------------------------------------------------------------------


@dataclass
class PendingBatch:
    """One batch between the sampler and the consumer: its labels (rows in order), the samples DALI decodes
    and the rows they fill, the rows cnns's CPU decoder filled (files DALI is not given), and the images
    --skip-corrupt-images left out."""

    labels: list[int]
    dali_rows: list[int]
    dali_samples: list[DaliSample]
    host_rows: list[int]
    host_images: torch.Tensor  # uint8 [len(host_rows), S, S, 3]
    skipped: list[str] = field(default_factory=list)

    def without(self, positions: set[int]) -> "PendingBatch":
        """The batch without the DALI samples at `positions` (corrupt files left out), its rows renumbered."""
        dropped = {self.dali_rows[position] for position in positions}
        renumber = {row: new for new, row in enumerate(r for r in range(len(self.labels)) if r not in dropped)}
        kept = [position for position in range(len(self.dali_samples)) if position not in positions]
        return PendingBatch([label for row, label in enumerate(self.labels) if row not in dropped],
                            [renumber[self.dali_rows[position]] for position in kept],
                            [self.dali_samples[position] for position in kept],
                            [renumber[row] for row in self.host_rows], self.host_images,
                            self.skipped + [self.dali_samples[position].source for position in sorted(positions)])


class DaliBatches(EpochBatches):
    """The batch-source protocol of cnns.data.sources (len() batches per epoch, epoch(e, start_batch) yielding
    (uint8 NHWC, int64) batches, num_samples, num_classes) over DALI, with `ImageNetBatches`'s samplers, batch
    rule, evaluation cache and --skip-corrupt-images accounting."""

    def __init__(self, records: ImageRecords, train: bool, batch_size: int, image_size: int, device: torch.device,
                 threads: int = 1, seed: int = 0, shard: tuple[int, int] = (0, 1), percentage: int = 100,
                 cache: bool = False, global_batch_size: int | None = None, skip_corrupt: bool = False,
                 eval_crop_pct: float = EVAL_CROP_PCT, eval_interpolation: str = EVAL_INTERPOLATION) -> None:
        check_dali_installed()
        if batch_size < 1:
            raise ConfigError(f"batch size must be positive, got {batch_size}")
        self.records, self.num_classes = records, records.num_classes
        if train:
            indices = training_subset(self.records, percentage)
            samples = TrainingSampler(indices, shard, seed, batch_size=batch_size,
                                      global_batch_size=global_batch_size, order=records.training_order)
            self.num_samples = len(indices)
        else:
            samples = EvaluationSampler(len(self.records), shard)
            self.num_samples = len(self.records)
        self.keys = BatchKeys(samples, batch_size, drop_last=train)
        if train and self.keys.batches_per_epoch() == 0:
            whole = global_batch_size or batch_size * shard[1]
            raise DataError(f"the training set in {records.where} has {self.num_samples} images, fewer than one global "
                            f"batch of {whole} ({shard[1]} ranks x {whole // shard[1]})")
        self.train, self.batch_size, self.image_size = train, batch_size, image_size
        self.device, self.threads, self.skip_corrupt = device, threads, skip_corrupt
        # The crops are cnns's own (seed, epoch, index) draws; files DALI is not given decode on the CPU here.
        # An evaluation resampler DALI does not have (PIL's bicubic): every file is decoded here.
        self.transform = ImageNetTransform(train, image_size, seed, ImageDecoder(), eval_crop_pct, eval_interpolation)
        self._pipe = None
        self._start_epochs(train, cache, image_size)

    @property
    def pipe(self):
        """The pipeline, built on first use and again after an error or an epoch left part-way (which leaves
        inputs queued in it)."""
        if self._pipe is None:
            self._pipe = build_pipeline(self.train, self.batch_size, self.image_size, self.threads, self.device)
        return self._pipe

    def _batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, list[str]]]:
        keys = iter(self.keys)
        fed: deque[PendingBatch] = deque()  # in DALI's queue, in the order fed
        while len(fed) < BATCHES_AHEAD and self._feed_next(keys, fed):
            pass
        while fed:
            batch, images = self._take(fed.popleft(), fed)
            self._feed_next(keys, fed)
            yield images, torch.tensor(batch.labels, dtype=torch.int64), batch.skipped

    def _abandoned(self) -> None:
        self._pipe = None  # inputs of batches never taken are still queued in it

    def _feed_next(self, keys: Iterator[list], fed: deque) -> bool:
        """Prepare the next batch of keys and queue its JPEGs on the pipeline; False at the epoch's end."""
        batch_keys = next(keys, None)
        if batch_keys is None:
            return False
        batch = self._prepare(batch_keys)
        if batch.dali_samples:
            feed(self.pipe, self.train, batch.dali_samples)
        fed.append(batch)
        return True

    def _prepare(self, keys: list[SampleKey]) -> PendingBatch:
        """Read each sample, draw its crop from the header's size; the files DALI is not given are decoded here."""
        size = self.image_size
        labels, dali_rows, dali_samples, host, skipped = [], [], [], [], []
        for key in keys:
            index = _index(key)
            try:
                data, label, source = self.records.read(index)
                shape = None if self.transform.on_host_only else device_jpeg_size(data, source)
            except DataError:
                if not self.skip_corrupt:
                    raise
                skipped.append(self.records.source(index))
                continue
            if shape is None:
                host.append((len(labels), key, data, label, source))
            else:
                crop = self.transform.crop(*shape, key)
                dali_rows.append(len(labels))
                dali_samples.append(training_sample(data, source, crop) if self.train
                                    else evaluation_sample(data, source, crop, shape, size))
            labels.append(label)
        host_images = torch.empty((len(host), size, size, 3), dtype=torch.uint8)
        host_rows, decoded = [], 0
        dropped = set()
        for row, key, data, label, source in host:
            try:
                self.transform.into(data, source, key, host_images[decoded])
            except DataError:
                if not self.skip_corrupt:
                    raise
                skipped.append(source)
                dropped.add(row)
                continue
            host_rows.append(row)
            decoded += 1
        batch = PendingBatch(labels, dali_rows, dali_samples, host_rows, host_images[:decoded], skipped)
        if dropped:  # rows of host files that did not decode: renumber the rest
            renumber = {row: new for new, row in enumerate(r for r in range(len(labels)) if r not in dropped)}
            batch = PendingBatch([label for row, label in enumerate(labels) if row not in dropped],
                                 [renumber[row] for row in dali_rows], dali_samples,
                                 [renumber[row] for row in host_rows], batch.host_images, skipped)
        return batch

    def _take(self, batch: PendingBatch, fed: deque) -> tuple[PendingBatch, torch.Tensor]:
        """(the batch as delivered, its images: DALI's rows and the CPU decoder's, on the output device). A JPEG
        DALI cannot decode is named in one line (DataError), or with --skip-corrupt-images left out: the
        pipeline, no longer usable after the error, is built again and the batches queued behind it fed again."""
        decoded = None
        while batch.dali_samples:
            try:
                decoded = take_output(self.pipe, self.device)
                break
            except RuntimeError as error:
                self._pipe = None
                bad = self._undecodable(batch.dali_samples)
                if not bad:
                    raise DataError(f"DALI could not decode a batch of {len(batch.dali_samples)} images "
                                    f"(first: {batch.dali_samples[0].source}): {first_line(error)}") from None
                if not self.skip_corrupt:
                    raise DataError(f"{batch.dali_samples[min(bad)].source}: cannot decode image (NVIDIA DALI: "
                                    f"corrupt, truncated or not a JPEG)") from None
                batch = batch.without(bad)
                for queued in [batch, *fed]:
                    if queued.dali_samples:
                        feed(self.pipe, self.train, queued.dali_samples)
        return batch, self._assemble(batch, decoded)

    def _assemble(self, batch: PendingBatch, decoded: torch.Tensor | None) -> torch.Tensor:
        rows = len(batch.labels)
        if decoded is not None and len(batch.dali_rows) == rows:  # all rows DALI's, in order
            return decoded
        images = torch.empty((rows, self.image_size, self.image_size, 3), dtype=torch.uint8, device=self.device)
        if decoded is not None:
            images[torch.tensor(batch.dali_rows, device=self.device)] = decoded
        if batch.host_rows:
            images[torch.tensor(batch.host_rows, device=self.device)] = batch.host_images.to(self.device)
        return images

    def _undecodable(self, samples: list[DaliSample]) -> set[int]:
        """The positions of the samples DALI cannot decode, each decoded alone, whole, in a pipeline of its own
        (the batched run fails as a whole, and its error does not say which file)."""
        bad = set()
        for position, sample in enumerate(samples):
            try:
                decode_alone(sample.data, self.device)
            except RuntimeError:
                bad.add(position)
        return bad
