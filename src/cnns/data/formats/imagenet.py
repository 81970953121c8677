"""ImageNet: what its two layouts (`tfrecord`, `folder`) share. Images are decoded by worker processes, each
training crop's region only (`cnns.data.imagenet`), on the CPU or, with --decode-device, on the GPU
(nvJPEG), or by NVIDIA DALI (`cnns.data.dali`)."""

from __future__ import annotations

from pathlib import Path

from cnns.data.formats.base import DataFormat, Dataset, FormatSources, SourceRequest

IMAGENET = Dataset("imagenet", num_classes=1000, cifar_sized=False, train_images=1281167, eval_images=50000,
                   path_words=("imagenet",))


class ImageNetFiles(DataFormat):
    dataset = IMAGENET
    decoded_in_workers = True

    def recognise(self, folder: Path) -> bool:
        from cnns.data.imagenet import detect_imagenet

        return detect_imagenet(folder) == self.name

    def missing(self, folder: Path) -> str:
        return f"no ImageNet TFRecords (train-*-of-*) or JPEG folders (train/<class>/) found in {folder}"

    def sources(self, data, folder: Path, request: SourceRequest) -> FormatSources:
        """Pinned host memory only for a run on a GPU: pinning costs host memory and time for nothing on a CPU.
        The decoder and where it runs (--decode-device) are chosen once, for both splits."""
        from cnns.data.decode_rates import measured_rates
        from cnns.data.decoding import ImageDecoder, choose_decode_device, decoding_header
        from cnns.data.imagenet import ImageNetBatches

        device = request.device
        choice = choose_decode_device(data.decode_device, device, rates=measured_rates(
            data.pipeline_num_parallel, data.image_size, request.step_rate))
        decoder = ImageDecoder()
        if choice.device == "dali":
            train, evaluation = dali_sources(data, folder, request)
            return FormatSources(train, evaluation, decoding_header(choice, decoder, device))
        common = dict(image_size=data.image_size, workers=data.pipeline_num_parallel, seed=request.seed,
                      shard=request.shard, skip_corrupt=data.skip_corrupt_images, size_limit=data.max_file_size,
                      pin_memory=device.type == "cuda", decoder=decoder,
                      device_decoding=device if choice.device == "cuda" else None)
        train = evaluation = None
        if request.need_train:
            train = ImageNetBatches(folder, train=True, batch_size=request.micro_batch_size,
                                    percentage=data.dataset_percentage_to_use,
                                    global_batch_size=request.global_batch_size, **common)
        if request.need_eval:
            evaluation = ImageNetBatches(folder, train=False, batch_size=request.eval_batch_size,
                                         cache=data.dataset_cache, **common)
        return FormatSources(train, evaluation, decoding_header(choice, decoder, device))

    def check_first_image(self, data: bytes, source: str) -> None:
        from cnns.data.imagefolder import decode_rgb

        decode_rgb(data, source)


def dali_sources(data, folder: Path, request: SourceRequest) -> tuple:
    """(training, evaluation) sources decoded by DALI (`cnns.data.dali`): the same samplers, crops and options as
    `ImageNetBatches`; DALI's threads are --pipeline-num-parallel."""
    from cnns.data.dali import DaliBatches

    common = dict(image_size=data.image_size, device=request.device, threads=data.pipeline_num_parallel,
                  seed=request.seed, shard=request.shard, skip_corrupt=data.skip_corrupt_images,
                  size_limit=data.max_file_size)
    train = evaluation = None
    if request.need_train:
        train = DaliBatches(folder, True, request.micro_batch_size, percentage=data.dataset_percentage_to_use,
                            global_batch_size=request.global_batch_size, **common)
    if request.need_eval:
        evaluation = DaliBatches(folder, False, request.eval_batch_size, cache=data.dataset_cache, **common)
    return train, evaluation
