"""What a run reads of its data: the data's part of the frozen configuration (`cnns.config.RunConfig.data`),
declared here, beside the formats that read it, as a model's `ModelSpec` is beside the models."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DataConfig:
    dataset: str | None
    data_dir: str | None
    source: str  # "files" | "generated" | "synthetic"
    num_classes: int
    image_size: int  # the size the model trains at (32 for CIFAR-sized data)
    pipeline_num_parallel: int
    normalise_input: bool  # ImageNet mean/std; otherwise Graphcore's application's mean subtraction
    hostside_norm: bool  # --hostside-norm, off with --eight-bit-io (whose bytes the device normalises)
    dataset_percentage_to_use: int
    dataset_cache: bool
    mixup_alpha: float
    cutmix_lambda: float
    cutmix_version: int
    skip_corrupt_images: bool = False  # drop and count undecodable images
    decode_device: str = "auto"  # --decode-device: "auto" | "cpu" | "cuda" | "dali" (cnns.data.decoding.choose_decode_device)
    max_file_size: int | None = None  # --max-file-size: the largest data file read (None: cnns.bounded_reads's default)
    # Evaluation's resize and centre crop (validation, weight averaging and predict): the resampler and timm's
    # crop_pct (the short side resized to image_size / crop_pct); Graphcore's where a run's options predate them.
    eval_interpolation: str = "bilinear"
    eval_crop_pct: float = 0.875
