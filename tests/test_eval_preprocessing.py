"""Evaluation preprocessing from the model's timm configuration (issue 69): a timm model's resize, crop and
resampler on ImageNet-sized data are its pretrained_cfg's unless the run's options say otherwise, recorded with the
run, and validation and predict prepare an image as timm's own eval transform does, bitwise."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import scripts
from cnns.config import RunConfig
from cnns.config.defaults import resolve
from cnns.config.table import option_defaults
from cnns.errors import ConfigError

# convnext_tiny's pretrained_cfg: bicubic and crop_pct 0.95 (Graphcore's are bilinear and 0.875).
MODEL = "convnext_tiny"
# Photo-like sizes: landscape and portrait, square, one the crop enlarges, one the resize shrinks five-fold.
SIZES = ((333, 500), (500, 375), (240, 240), (180, 260), (1000, 1200))


def options(*argv_pairs: tuple[str, object], data_dir: Path | None = None) -> dict:
    values = {**option_defaults("train"), "dataset": "imagenet", "model": MODEL, "seed": 1,
              **({"data_dir": str(data_dir)} if data_dir else {"synthetic_data": True}), **dict(argv_pairs)}
    return resolve(values)


def timm_eval_transform():
    import timm

    model = timm.create_model(MODEL, pretrained=False, num_classes=10)
    return timm.data.create_transform(**timm.data.resolve_data_config(model=model))


@pytest.fixture(scope="module")
def validation_tree(tmp_path_factory) -> Path:
    """An ImageNet folder tree whose validation split holds smooth photo-like images of SIZES, as PNG and JPEG."""
    root = tmp_path_factory.mktemp("imagenet-tree")
    rng = np.random.default_rng(0)
    for split in ("train", "validation"):
        (root / split / "n00000000").mkdir(parents=True)
    for index, (height, width) in enumerate(SIZES):
        low = rng.integers(0, 256, (height // 8 + 1, width // 8 + 1, 3), dtype=np.uint8)
        image = Image.fromarray(low).resize((width, height), Image.Resampling.BILINEAR)
        image.save(root / "validation" / "n00000000" / f"{index}.png")
        image.save(root / "validation" / "n00000000" / f"{index}.JPEG", quality=90)
        image.save(root / "train" / "n00000000" / f"{index}.JPEG", quality=90)
    return root


def validation_images(cfg: RunConfig, device_decoding: bool = False) -> dict[str, torch.Tensor]:
    """The evaluation loader's uint8 HWC images (what validation.py and weight_avg.py evaluate), by file name; with
    `device_decoding`, the loader of --decode-device cuda (nvJPEG's call and the crops resized where it decodes, run
    here on the CPU as its tests do: the crops carry their resampler there)."""
    from cnns.data.image_loader import ImageNetBatches
    from cnns.data.sources import build_sources

    sources = build_sources(cfg.data, micro_batch_size=4, eval_batch_size=4, seed=1, device=torch.device("cpu"),
                            need_train=False)
    records = sources.eval.loader.dataset.records
    source = sources.eval
    if device_decoding:
        source = ImageNetBatches(records, train=False, batch_size=4, image_size=cfg.data.image_size, workers=0,
                                 device_decoding=torch.device("cpu"), eval_crop_pct=cfg.data.eval_crop_pct,
                                 eval_interpolation=cfg.data.eval_interpolation)
    images = torch.cat([batch for batch, _ in source.epoch(0)])
    return {Path(records.source(index)).name: images[index] for index in range(len(records))}


def test_a_timm_model_evaluates_with_its_pretrained_cfg_and_the_run_records_it():
    import timm

    cfg_of_timm = timm.models.get_pretrained_cfg(MODEL)
    assert (cfg_of_timm.interpolation, cfg_of_timm.crop_pct) == ("bicubic", 0.95)  # not Graphcore's: the test bites
    o = options()
    assert (o["eval_interpolation"], o["eval_crop_pct"]) == ("bicubic", 0.95)
    # What arguments.json records is read back as it is: restore and validation resolve it again to the same.
    again = resolve({**o, "seed": o["seed"]})
    assert (again["eval_interpolation"], again["eval_crop_pct"]) == ("bicubic", 0.95)
    data = RunConfig.from_options(o).data
    assert (data.eval_interpolation, data.eval_crop_pct) == ("bicubic", 0.95)
    # The seed families keep Graphcore's evaluation: bilinear, the short side to size x 256/224.
    resnet = resolve({**option_defaults("train"), "dataset": "imagenet", "synthetic_data": True, "seed": 1})
    assert (resnet["eval_interpolation"], resnet["eval_crop_pct"]) == ("bilinear", 0.875)


def test_validation_and_predict_prepare_images_bitwise_as_timms_eval_transform(validation_tree):
    """timm.data.create_transform(**resolve_data_config(model=...)) on the PIL image: PIL's bicubic resize of the
    short side to floor(224 / 0.95) = 235, the centre 224 square, then ToTensor and Normalize. cnns's validation
    loader and predict give the same uint8 pixels (PNG and JPEG: libjpeg-turbo's decode both ways), and the same
    model input within float32's rounding of (x / 255 - mean) / std."""
    from cnns.commands.predict import evaluation_transform
    from cnns.data.augment import normalise
    from cnns.deploy.restored_model import input_normalisation

    cfg = RunConfig.from_options(options(data_dir=validation_tree))
    theirs_transform = timm_eval_transform()
    resize_and_crop, to_tensor_and_normalise = theirs_transform.transforms[:2], theirs_transform.transforms[2:]
    validated, on_device = validation_images(cfg), validation_images(cfg, device_decoding=True)
    predicted = evaluation_transform(cfg)
    files = sorted((validation_tree / "validation" / "n00000000").iterdir())
    assert len(files) == len(validated) == len(on_device) == 2 * len(SIZES)
    for path in files:
        image = Image.open(path).convert("RGB")
        for step in resize_and_crop:
            image = step(image)
        theirs = torch.from_numpy(np.asarray(image).copy())
        ours = predicted(path.read_bytes(), str(path))
        assert torch.equal(ours, theirs), (path.name, (ours.int() - theirs.int()).abs().max())
        assert torch.equal(validated[path.name], theirs), path.name
        assert torch.equal(on_device[path.name], theirs), path.name
        # The model's input: the same arithmetic in another order, each of its <= 3 float32 roundings at most half
        # an ulp of a value below (1 + mean) / std; an error before the division by std grows by 1 / std.
        expected = Image.fromarray(theirs.numpy())
        for step in to_tensor_and_normalise:
            expected = step(expected)
        mean, std = input_normalisation(cfg)
        model_input = normalise(ours[None], mean, std, torch.float32)[0]
        bound = 3 * 0.5 * torch.finfo(torch.float32).eps * max((1 + m) / s for m, s in zip(mean, std)) / min(std)
        assert (model_input - expected).abs().max() <= bound


def test_gpu_decoders_leave_a_bicubic_crop_to_the_workers(validation_tree):
    """nvJPEG's and DALI's resize is bilinear: with --eval-interpolation bicubic no JPEG of an evaluation batch is
    sent to the GPU (the workers decode every one with PIL's bicubic); with bilinear they are."""
    from cnns.data.image_loader import ImageBatchDataset, ImageNetTransform
    from cnns.data.sources import build_sources

    for interpolation, sent in (("bicubic", 0), ("bilinear", len(SIZES))):  # the JPEGs; the PNGs never go
        cfg = RunConfig.from_options(options(("eval_interpolation", interpolation), data_dir=validation_tree))
        records = build_sources(cfg.data, micro_batch_size=4, eval_batch_size=4, seed=1, device=torch.device("cpu"),
                                need_train=False).eval.loader.dataset.records
        dataset = ImageBatchDataset(records, ImageNetTransform.evaluation(cfg.data), device_decoding=torch.device("cpu"))
        batch = dataset[list(range(len(records)))]
        assert len(batch.device_rows) == sent and len(batch.host_rows) == len(records) - sent, interpolation


def test_explicit_options_win_over_the_models_own(validation_tree):
    """--eval-interpolation bilinear --eval-crop-pct 0.875 give Graphcore's evaluation for the timm model: the short
    side to 256 with torch's antialiased bilinear resize, the centre 224 (torchvision's statement of it, on the
    decoded PNG: the whole-image path, bitwise), in validation and predict alike."""
    from cnns.commands.predict import evaluation_transform
    from cnns.data.image_loader import evaluation_transform as bilinear_statement
    from cnns.data.imagefolder import decode_rgb

    o = options(("eval_interpolation", "bilinear"), ("eval_crop_pct", 0.875), data_dir=validation_tree)
    assert (o["eval_interpolation"], o["eval_crop_pct"]) == ("bilinear", 0.875)
    cfg = RunConfig.from_options(o)
    validated = validation_images(cfg)
    predicted = evaluation_transform(cfg)
    for path in sorted((validation_tree / "validation" / "n00000000").glob("*.png")):
        expected = bilinear_statement(224, 0.875)(decode_rgb(path.read_bytes(), str(path))).permute(1, 2, 0)
        assert torch.equal(predicted(path.read_bytes(), str(path)), expected), path.name
        assert torch.equal(validated[path.name], expected), path.name


def test_cifar_sized_data_takes_its_images_whole():
    """On CIFAR-sized data no resize or crop applies (a 32 x 32 image is the model's input as it is): the timm
    model's crop_pct is not taken there, the run records 1, and another --eval-crop-pct is refused in one line."""
    o = resolve({**option_defaults("train"), "dataset": "cifar-10", "model": MODEL, "seed": 1,
                 "data_dir": "/nowhere/cifar-10"})
    assert (o["eval_interpolation"], o["eval_crop_pct"]) == ("bilinear", 1.0)
    with pytest.raises(ConfigError, match="--eval-crop-pct 0.9: CIFAR-sized images are evaluated whole"):
        resolve({**option_defaults("train"), "dataset": "cifar-10", "model": MODEL, "seed": 1,
                 "data_dir": "/nowhere/cifar-10", "eval_crop_pct": 0.9})


def test_a_crop_pct_outside_its_domain_is_one_line(capfd):
    out = scripts.run_here(capfd, "train.py", "--model", MODEL, "--dataset", "imagenet", "--synthetic-data",
                           "--eval-crop-pct", "1.5", "--print-config", expect=2)
    assert "--eval-crop-pct" in out.stderr and "Traceback" not in out.stderr
