"""ImageNet, and any set of encoded images read as it is: what its layouts (`tfrecord`, `webdataset`,
`huggingface-parquet`, `huggingface-arrow`, `folder`) share. Each layout's module recognises its
files and hands the loader its reader (`records`); the loader (`cnns.data.image_loader`) decodes each training
crop's region only, in worker processes, on the CPU or, with --decode-device, on the GPU (nvJPEG), or NVIDIA
DALI decodes it (`cnns.data.dali`)."""

from __future__ import annotations

from abc import abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING

from cnns.data.formats.base import DataFormat, Dataset, FormatSources, SourceRequest

if TYPE_CHECKING:
    from cnns.data.image_loader import ImageRecords

IMAGENET = Dataset("imagenet", num_classes=1000, cifar_sized=False, train_images=1281167, eval_images=50000,
                   path_words=("imagenet",))


class ImageNetFiles(DataFormat):
    dataset = IMAGENET
    decoded_in_workers = True

    @abstractmethod
    def records(self, folder: Path, split: str, size_limit: int | None = None) -> "ImageRecords":
        """The reader of `split` ("train", "validation") in `folder`: what the loader, `cnns bench-data` and
        the checks read images from. No image or record larger than `size_limit` (--max-file-size) is read."""

    def sources(self, data, folder: Path, request: SourceRequest) -> FormatSources:
        """Pinned host memory only for a run on a GPU: pinning costs host memory and time for nothing on a CPU.
        The decoder and where it runs (--decode-device) are chosen once, for both splits."""
        from cnns.data.decode_rates import measured_rates
        from cnns.data.decoding import ImageDecoder, choose_decode_device, decoding_header
        from cnns.data.image_loader import ImageNetBatches

        device = request.device
        choice = choose_decode_device(data.decode_device, device, rates=measured_rates(
            data.pipeline_num_parallel, data.image_size, request.step_rate))
        decoder = ImageDecoder()
        if choice.device == "dali":
            train, evaluation = dali_sources(self, data, folder, request)
            return FormatSources(train, evaluation, decoding_header(choice, decoder, device))
        common = dict(image_size=data.image_size, workers=data.pipeline_num_parallel, seed=request.seed,
                      shard=request.shard, skip_corrupt=data.skip_corrupt_images,
                      pin_memory=device.type == "cuda", decoder=decoder,
                      device_decoding=device if choice.device == "cuda" else None)
        train = evaluation = None
        if request.need_train:
            train = ImageNetBatches(self.records(folder, "train", data.max_file_size), train=True,
                                    batch_size=request.micro_batch_size, percentage=data.dataset_percentage_to_use,
                                    global_batch_size=request.global_batch_size, **common)
        if request.need_eval:
            evaluation = ImageNetBatches(self.records(folder, "validation", data.max_file_size), train=False,
                                         batch_size=request.eval_batch_size, cache=data.dataset_cache,
                                         eval_crop_pct=data.eval_crop_pct, eval_interpolation=data.eval_interpolation,
                                         **common)
        return FormatSources(train, evaluation, decoding_header(choice, decoder, device))

    def check_first_image(self, data: bytes, source: str) -> None:
        from cnns.data.imagefolder import decode_rgb

        decode_rgb(data, source)


def dali_sources(files: ImageNetFiles, data, folder: Path, request: SourceRequest) -> tuple:
    """(training, evaluation) sources decoded by DALI (`cnns.data.dali`) from the layout's readers: the same
    samplers, crops and options as `ImageNetBatches`; DALI's threads are --pipeline-num-parallel."""
    from cnns.data.dali import DaliBatches

    common = dict(image_size=data.image_size, device=request.device, threads=data.pipeline_num_parallel,
                  seed=request.seed, shard=request.shard, skip_corrupt=data.skip_corrupt_images)
    train = evaluation = None
    if request.need_train:
        train = DaliBatches(files.records(folder, "train", data.max_file_size), True, request.micro_batch_size,
                            percentage=data.dataset_percentage_to_use, global_batch_size=request.global_batch_size,
                            **common)
    if request.need_eval:
        evaluation = DaliBatches(files.records(folder, "validation", data.max_file_size), False,
                                 request.eval_batch_size, cache=data.dataset_cache, eval_crop_pct=data.eval_crop_pct,
                                 eval_interpolation=data.eval_interpolation, **common)
    return train, evaluation
