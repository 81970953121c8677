"""The run's image decoder on the CPU: which decoder takes which file (the native region decoder, faked
here where its routing is the point, or TorchCodec's whole image), the choice between decoding in the
workers and on the GPU (CUDA mocked), and the GPU path itself run with device="cpu"."""

from __future__ import annotations

import io
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from cnns.data import decoding
from cnns.data.decoding import (
    Crop,
    DecodeRates,
    DeviceBatch,
    ImageDecoder,
    choose_decode_device,
    decode_crops_on_device,
    decode_whole,
    resize_crop_into,
)
from cnns.data.imagefolder import stored_orientation
from cnns.data.image_loader import ImageNetBatches, ImageNetTransform
from cnns.errors import ConfigError, DataError

sys.path.insert(0, str(Path(__file__).parent))
from test_imagenet_data import save, write_tree  # noqa: E402
from cnns.data.formats import records_in

CUDA = torch.device("cuda", 0)  # only named: nothing here runs on it


def encoded(image: Image.Image, file_format: str = "JPEG", **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, file_format, **options)
    return buffer.getvalue()


def smooth_image(width: int = 60, height: int = 40) -> Image.Image:
    y, x = np.mgrid[0:height, 0:width]
    return Image.fromarray(np.stack([x * 255 // width, y * 255 // height, 128 + 0 * x], axis=-1).astype(np.uint8))


# ---------------------------------------------------------------------------------------------
# CPU or GPU
# ---------------------------------------------------------------------------------------------


def no_problem(device: torch.device) -> decoding.DeviceJpegDecoder:
    return decoding.DeviceJpegDecoder("TorchCodec", lambda encoded, device: [])


def no_hardware(device: torch.device) -> bool:
    return False


def dali_loads() -> None:
    return None


def no_dali() -> str:
    return "No module named 'nvidia.dali'"


def rates(cpu: float, step: float | None, workers: int = 8, calls: list | None = None):
    """A `rates` callable giving these figures, recording that it was asked in `calls`."""
    def measured() -> DecodeRates:
        if calls is not None:
            calls.append(True)
        return DecodeRates(cpu, workers, step)

    return measured


def test_a_cpu_run_decodes_in_the_workers_unless_dali_is_asked_for():
    asked = []
    for dali in (dali_loads, no_dali):  # auto never picks DALI on a CPU run, installed or not
        choice = choose_decode_device("auto", torch.device("cpu"), find=no_problem, dali_missing=dali,
                                      rates=rates(1.0, 1e9, calls=asked))
        assert choice.device == "cpu" and choice.reason == "--decode-device auto: the run is on cpu"
    assert not asked  # nothing measured where there is no choice
    assert choose_decode_device("cpu", torch.device("cpu")).device == "cpu"
    assert choose_decode_device("dali", torch.device("cpu"), dali_missing=dali_loads).device == "dali"  # its CPU backend
    with pytest.raises(ConfigError, match="^--decode-device cuda needs a run on a CUDA GPU; this run is on cpu$"):
        choose_decode_device("cuda", torch.device("cpu"), find=no_problem)
    with pytest.raises(ConfigError, match="must be one of auto, cpu, cuda, dali"):
        choose_decode_device("gpu", torch.device("cpu"))


def test_dali_asked_for_where_it_does_not_load_names_the_extra_in_one_line():
    for device in (torch.device("cpu"), CUDA):
        with pytest.raises(ConfigError) as error:
            choose_decode_device("dali", device, dali_missing=no_dali)
        message = str(error.value)
        assert message == ("--decode-device dali needs NVIDIA DALI, which does not load here (No module named "
                           "'nvidia.dali'): install the optional extra `dali`: pip install -e '.[dali]' in "
                           "cnns's checkout (nvidia-dali-cuda130==2.4.0)")


def test_train_py_without_dali_ends_in_one_line_naming_the_extra_before_any_run_folder(tmp_path, capfd,
                                                                                      monkeypatch):
    """Where the optional extra is not installed (faked here, so that it runs whether it is or not)."""
    import scripts
    from cnns.data import dali_probe

    write_tree(tmp_path / "imagenet", "train", [2, 2], size=(48, 48))
    monkeypatch.setattr(dali_probe, "dali_missing", lambda: "No module named 'nvidia.dali'")
    out = scripts.run_here(capfd, "train.py", "--model", "resnet", "--model-size", "18", "--dataset", "imagenet",
                           "--data-dir", str(tmp_path / "imagenet"), "--image-size", "48", "--iterations", "1",
                           "--micro-batch-size", "2", "--no-validation", "--decode-device", "dali", cwd=tmp_path,
                           expect=2)
    assert out.stderr.strip().splitlines() == [
        "error: --decode-device dali needs NVIDIA DALI, which does not load here (No module named 'nvidia.dali'): "
        "install the optional extra `dali`: pip install -e '.[dali]' in cnns's checkout (nvidia-dali-cuda130==2.4.0)"]
    assert not (tmp_path / "logs").exists()


def test_auto_takes_the_hardware_decoder_through_dali_without_measuring_anything():
    asked = []
    choice = choose_decode_device("auto", CUDA, hardware=lambda device: True, dali_missing=dali_loads,
                                  rates=rates(1e9, 1.0, calls=asked), find=no_problem)
    assert choice.device == "dali" and not asked
    assert choice.reason == "--decode-device auto: cuda:0 has a hardware JPEG decoder and DALI is installed"


@pytest.mark.parametrize("hardware, dali, why", [
    (False, dali_loads, "no hardware JPEG decoder on this GPU"),
    (True, no_dali, "DALI, which would decode on its hardware JPEG decoder, does not load"),
    (False, no_dali, "no hardware JPEG decoder on this GPU"),
])
@pytest.mark.parametrize("cpu, step, expected", [
    (4_400.0, 6_800.0, "cuda"),  # the H200 host's 16 workers against ResNet-50 compiled: short
    (6_800.0, 6_800.0, "cpu"),  # enough: the workers cover the step
    (9_000.0, 2_000.0, "cpu"),
])
def test_auto_without_the_hardware_path_weighs_the_cpu_decoders_rate_against_the_steps(hardware, dali, why, cpu,
                                                                                      step, expected):
    choice = choose_decode_device("auto", CUDA, hardware=lambda device: hardware, dali_missing=dali,
                                  rates=rates(cpu, step, workers=16), find=no_problem)
    assert choice.device == expected
    assert choice.reason.startswith(f"--decode-device auto: {why}; the CPU decoder's {cpu:,.0f} images/s on 16 "
                                    f"workers {'cover' if expected == 'cpu' else 'fall short of'} the step's "
                                    f"estimated {step:,.0f}")


def test_auto_stays_on_the_cpu_where_the_step_is_unknown_or_nothing_decodes_on_the_gpu():
    def broken(device: torch.device) -> str:
        return "no CUDA build of TorchCodec"

    unknown = choose_decode_device("auto", CUDA, hardware=no_hardware, dali_missing=dali_loads,
                                   rates=rates(100.0, None), find=no_problem)
    assert unknown.device == "cpu" and unknown.reason.endswith("the step's rate not known here")
    assert choose_decode_device("auto", CUDA, hardware=no_hardware, dali_missing=dali_loads, rates=None,
                                find=no_problem).reason.endswith("the step's rate is not known here")
    short = choose_decode_device("auto", CUDA, hardware=no_hardware, dali_missing=dali_loads,
                                 rates=rates(100.0, 5_000.0), find=broken)
    assert short.device == "cpu" and short.reason.endswith(
        "fall short of the step's estimated 5,000, but JPEGs cannot be decoded on cuda:0 here "
        "(no CUDA build of TorchCodec)")


def test_the_cpu_decoders_rate_counts_the_workers_cores_per_gpu(monkeypatch):
    from cnns.data import decode_rates

    monkeypatch.setattr(decode_rates, "usable_cores", lambda: 12)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun's processes on the node share its cores
    assert decode_rates.worker_cores(8) == 3
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert decode_rates.worker_cores(8) == 8 and decode_rates.worker_cores(0) == 1
    monkeypatch.setattr(decode_rates, "cpu_decoder_rate", lambda image_size: 250.0)
    measured = decode_rates.measured_rates(8, 64, lambda: 6_000.0)()
    assert measured == DecodeRates(2_000.0, 8, 6_000.0)


def test_the_cpu_decoders_rate_is_measured_on_photo_like_jpegs():
    from cnns.data.decode_rates import cpu_decoder_rate

    assert cpu_decoder_rate(32, seconds=0.05) > 0


def test_forcing_either_way_and_falling_back_when_torchcodec_cannot_decode_there():
    called = []

    def broken(device: torch.device) -> str:
        called.append(device)
        return "no CUDA build of TorchCodec"

    assert choose_decode_device("cpu", CUDA, find=broken).device == "cpu" and not called
    assert choose_decode_device("cuda", CUDA, find=no_problem).device == "cuda"
    with pytest.raises(ConfigError, match=re.escape("--decode-device cuda: cannot decode JPEGs on cuda:0 "
                                                    "here (no CUDA build of TorchCodec)")):
        choose_decode_device("cuda", CUDA, find=broken)


def test_the_probe_names_what_stops_each_library_on_a_device():
    assert decoding.device_jpeg_decoder(torch.device("cpu")).name == "TorchCodec"  # TorchCodec decodes on the CPU
    if not torch.cuda.is_available():
        reason = decoding.device_jpeg_decoder(CUDA)  # a reason per library, in one line
        assert isinstance(reason, str) and "TorchCodec: " in reason and "; torchvision: " in reason
        assert "\n" not in reason


def test_torchvision_decodes_on_the_device_where_torchcodec_cannot(monkeypatch):
    """A machine whose CUDA torch is older than any TorchCodec build that loads: torchvision's nvJPEG, which
    has the same batched call, decodes instead, and the choice names it (run here on the CPU device)."""
    def no_torchcodec(encoded, device):
        raise RuntimeError("libtorchcodec_image.so: undefined symbol")

    monkeypatch.setattr(decoding, "DEVICE_JPEG_DECODERS",
                        (decoding.DeviceJpegDecoder("TorchCodec", no_torchcodec), decoding.DEVICE_JPEG_DECODERS[1]))
    decoding.device_jpeg_decoder.cache_clear()
    try:
        assert decoding.device_jpeg_decoder(torch.device("cpu")).name == "torchvision"
        choice = choose_decode_device("cuda", CUDA, find=lambda device: decoding.device_jpeg_decoder(torch.device("cpu")))
        assert choice.library == "torchvision"
        image = smooth_image(60, 40)
        jpeg = torch.frombuffer(bytearray(encoded(image, quality=95)), dtype=torch.uint8)
        out = torch.zeros(20, 30, 3, dtype=torch.uint8)
        assert decode_crops_on_device([jpeg], [Crop((0, 0, 40, 60))], [(40, 60)], [out], torch.device("cpu")) == []
        expected = torch.zeros_like(out)
        resize_crop_into(decode_whole(encoded(image, quality=95), "x"), Crop((0, 0, 40, 60)), expected)
        # Both libraries are libjpeg-turbo on the CPU: the same pixels, up to its IDCT's rounding.
        assert (out.int() - expected.int()).abs().max() <= 2
    finally:
        decoding.device_jpeg_decoder.cache_clear()


def test_the_header_line_names_the_decoder(tmp_path):
    from cnns.data.decoding import DecodeChoice, decoding_header

    whole = ImageDecoder(use_native=False)
    line = decoding_header(DecodeChoice("cpu", "--decode-device auto: the run is on cpu"), whole, torch.device("cpu"))
    assert line == ("Images decoded by TorchCodec (whole image); the native region decoder is not built "
                    "(--decode-device auto: the run is on cpu)")
    assert "libjpeg-turbo (region + DCT scaling, cnns native)" in ImageDecoder(use_native=True).name
    line = decoding_header(DecodeChoice("cuda", "--decode-device cuda", "TorchCodec"), whole, CUDA)
    assert line.startswith("Images decoded on cuda:0 by nvJPEG (TorchCodec, whole images in batches)")
    line = decoding_header(DecodeChoice("cuda", "--decode-device cuda", "torchvision"), whole, CUDA)
    assert line.startswith("Images decoded on cuda:0 by nvJPEG (torchvision, whole images in batches)")


def test_build_sources_chooses_once_and_says_so(tmp_path):
    from cnns.config import DataConfig
    from cnns.data.sources import build_sources

    write_tree(tmp_path, "train", [2, 2])
    config = DataConfig(dataset="imagenet", data_dir=str(tmp_path), source="files", num_classes=2, image_size=8,
                        pipeline_num_parallel=0, normalise_input=False, hostside_norm=False,
                        dataset_percentage_to_use=100, dataset_cache=False,
                        mixup_alpha=0.0, cutmix_lambda=1.0, cutmix_version=1, decode_device="auto")
    sources = build_sources(config, micro_batch_size=2, eval_batch_size=2, seed=0, device=torch.device("cpu"),
                            need_eval=False)
    assert sources.decoding == f"Images decoded by {ImageDecoder().name} (--decode-device auto: the run is on cpu)"
    with pytest.raises(ConfigError, match="needs a run on a CUDA GPU"):
        build_sources(config.__class__(**{**config.__dict__, "decode_device": "cuda"}), micro_batch_size=2,
                      eval_batch_size=2, seed=0, device=torch.device("cpu"), need_eval=False)


# ---------------------------------------------------------------------------------------------
# Which decoder takes which file
# ---------------------------------------------------------------------------------------------


class FakeNative:
    """cnns.kernels.jpeg's interface, recording its calls: it takes 1- and 3-component JPEGs, refuses CMYK
    with UnsupportedJpeg, and rejects `corrupt` bytes with JpegError."""

    class JpegError(ValueError):
        pass

    class UnsupportedJpeg(JpegError):
        pass

    class TooManyPixels(ValueError):
        pass

    def __init__(self, corrupt: bytes = b"") -> None:
        self.calls: list[tuple] = []
        self.corrupt = corrupt

    def available(self) -> bool:
        return True

    def header(self, data: bytes) -> tuple[int, int, int]:
        from cnns.data.imagefolder import jpeg_frame

        frame = jpeg_frame(bytes(data))
        if frame is None:
            raise self.JpegError("Premature end of JPEG file")
        width, height, components = frame
        if components == 4:
            raise self.UnsupportedJpeg("CMYK")
        return height, width, components

    def decode_resized_into(self, data, out, box, flip, timings=False):
        self.calls.append((box, flip, tuple(out.shape)))
        if data == self.corrupt:
            raise self.JpegError("Corrupt JPEG data: premature end of data segment")
        out.fill_(7)
        return self.TIMINGS if timings else None

    def decode_training_into(self, data, out, draw, max_pixels, timings=False):
        """The header, the training crop drawn as cnns.data.image_loader draws it, decode_resized_into."""
        from cnns.data.image_loader import sample_generator, training_crop

        height, width, _ = self.header(data)
        if height * width > max_pixels:
            raise self.TooManyPixels(f"{height} {width}")
        crop = training_crop(height, width, sample_generator(*draw[:3]))
        result = self.decode_resized_into(data, out, crop.box, crop.flip, timings)
        return (5, *result) if timings else None

    TIMINGS = (11, 13, 17)  # its clocks' nanoseconds (decode, resize, flip) when asked for them


@pytest.fixture
def fake_native(monkeypatch) -> FakeNative:
    fake = FakeNative()
    monkeypatch.setattr(decoding, "native_jpeg", lambda: fake)
    return fake


def test_the_native_decoder_gets_the_crop_drawn_from_the_header(fake_native):
    data = encoded(smooth_image(60, 40))
    transform = ImageNetTransform(True, 16, seed=4, decoder=ImageDecoder(use_native=True))
    image = transform(data, "a.JPEG", (3, 1))
    crop = transform.crop(40, 60, (3, 1))
    assert fake_native.calls == [(crop.box, crop.flip, (16, 16, 3))]  # one call, the header's size
    assert (image == 7).all()  # what the native decoder wrote, straight into the row
    evaluation = ImageNetTransform(False, 16, decoder=ImageDecoder(use_native=True))
    evaluation(data, "a.JPEG")
    # Short side 40 -> 18 (16 * 256/224), so 60 -> 27; the centre 16 square starts at row 1, column
    # round(5.5) = 6 of the resized image: in source pixels scaled by 40/18 and 60/27.
    assert fake_native.calls[-1][0] == pytest.approx((1 * 40 / 18, 6 * 60 / 27, 16 * 40 / 18, 16 * 60 / 27))


def test_a_clock_adds_each_stages_time_and_changes_no_pixel(fake_native):
    """`cnns bench-data`'s account times the worker's own decoding: the native call's own clocks, or the
    whole-image path's steps (its flip inside the resize); with a clock the pixels are those without."""
    from cnns.data.decoding import DecodeClock

    data = encoded(smooth_image(60, 40))
    native = ImageNetTransform(True, 16, seed=4, decoder=ImageDecoder(use_native=True))
    clock, out = DecodeClock(), torch.empty((16, 16, 3), dtype=torch.uint8)
    for _ in range(2):
        native.into(data, "a.JPEG", (3, 1), out, clock)
    assert (clock.decode, clock.resize, clock.flip, clock.whole) == (22, 26, 34, 0) and clock.header > 0
    whole = ImageNetTransform(True, 16, seed=4, decoder=ImageDecoder(use_native=False))
    clock, clocked, plain = DecodeClock(), torch.empty_like(out), torch.empty_like(out)
    whole.into(data, "a.JPEG", (3, 1), clocked, clock)
    whole.into(data, "a.JPEG", (3, 1), plain)
    assert torch.equal(clocked, plain)
    assert clock.whole == 1 and clock.flip == 0 and min(clock.header, clock.decode, clock.resize) > 0


def test_files_the_native_decoder_does_not_take_are_decoded_whole(fake_native):
    whole = ImageNetTransform(True, 16, seed=4, decoder=ImageDecoder(use_native=False))
    native = ImageNetTransform(True, 16, seed=4, decoder=ImageDecoder(use_native=True))
    for mode, file_format in (("CMYK", "JPEG"), ("RGB", "PNG"), ("RGB", "BMP")):
        data = encoded(smooth_image().convert(mode), file_format)
        assert torch.equal(native(data, "odd.JPEG", (0, 0)), whole(data, "odd.JPEG", (0, 0))), mode
    assert len(fake_native.calls) == 0  # the CMYK JPEG was refused at its header, the others are no JPEGs


def test_a_jpeg_the_native_decoder_rejects_is_decoded_whole_or_named_as_before(fake_native):
    data = encoded(smooth_image())
    fake_native.corrupt = data
    decoder = ImageNetTransform(True, 16, seed=4, decoder=ImageDecoder(use_native=True))
    whole = ImageNetTransform(True, 16, seed=4, decoder=ImageDecoder(use_native=False))
    assert torch.equal(decoder(data, "a.JPEG", (1, 0)), whole(data, "a.JPEG", (1, 0)))  # TorchCodec reads it
    truncated = data[:100]
    fake_native.corrupt = truncated
    with pytest.raises(DataError) as error:
        decoder(truncated, "a.JPEG", (1, 0))
    assert str(error.value) == ("a.JPEG: cannot decode image (Image is incomplete or truncated; "
                                "PIL: Truncated File Read)")


def test_a_header_declaring_too_many_pixels_is_refused_by_every_path(fake_native):
    import struct

    blob = bytearray(encoded(smooth_image()))
    at = blob.index(b"\xff\xc0") + 5
    blob[at:at + 4] = struct.pack(">HH", 65500, 2733)
    for use_native in (True, False):
        with pytest.raises(DataError, match="its header declares 2733 x 65500 pixels"):
            ImageNetTransform(True, 16, decoder=ImageDecoder(use_native=use_native))(bytes(blob), "big.JPEG")
    assert fake_native.calls == []


# ---------------------------------------------------------------------------------------------
# Pixels
# ---------------------------------------------------------------------------------------------


def test_exif_orientation_is_ignored_as_the_other_decoders_ignore_it():
    """A 60 x 40 JPEG tagged "rotate 90" decodes to its stored 40 rows x 60 columns, the size its header
    declares and the native decoder and torchvision's decoders give; TorchCodec alone would rotate it."""
    from torchcodec.decoders import decode_image

    exif = Image.Exif()
    exif[0x0112] = 6
    data = encoded(smooth_image(60, 40), exif=exif)
    assert tuple(decode_image(data).shape) == (3, 60, 40)  # TorchCodec applies the tag
    assert tuple(decode_whole(data, "x").shape) == (40, 60, 3)
    stored = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))  # PIL without exif_transpose
    assert np.abs(decode_whole(data, "x").numpy().astype(int) - stored).max() <= 1
    plain = encoded(smooth_image())
    assert stored_orientation(plain) is plain  # no EXIF segment: the same bytes, not a copy


def test_the_float_resize_used_on_gpus_agrees_with_the_uint8_one_within_a_level():
    """CUDA has no uint8 antialiased resize, so the device path resizes in float32 and rounds; torch's CPU
    uint8 kernel computes the same filter with fixed-point weights, so the two differ by rounding: at most
    one level."""
    image = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (53, 71, 3), dtype=np.uint8))
    for crop in (Crop((3, 5, 40, 50), flip=True), Crop((2.4, 3.7, 45.1, 60.3), whole_first=True)):
        on_cpu, as_on_gpu = torch.empty(16, 16, 3, dtype=torch.uint8), torch.empty(16, 16, 3, dtype=torch.uint8)
        resize_crop_into(image, crop, on_cpu)
        resize_crop_into(image.float(), crop, as_on_gpu)  # a float image takes the path a CUDA image takes
        assert (on_cpu.int() - as_on_gpu.int()).abs().max() <= 1


def test_a_crop_is_fitted_to_the_image_the_decoder_gave():
    crop = Crop((10, 20, 30, 40), flip=True)
    assert crop.fitted(40, 60, (40, 60)) is crop
    assert crop.fitted(80, 30, (40, 60)).box == (20.0, 10.0, 60.0, 20.0)
    out = torch.empty(8, 8, 3, dtype=torch.uint8)
    resize_crop_into(torch.zeros(5, 5, 3, dtype=torch.uint8), Crop((1, 1, 30, 40)), out)  # past the image: no error
    assert (out == 0).all()


# ---------------------------------------------------------------------------------------------
# Decoding on the device, run on the CPU
# ---------------------------------------------------------------------------------------------


def write_mixed_tree(root: Path) -> Path:
    """Photo-like JPEGs, a CMYK JPEG and PNG bytes named .JPEG (decoded by the workers when the device
    decodes), and a JPEG whose header is fine and whose data is truncated; returns that one."""
    write_tree(root, "validation", [3, 3], size=(48, 40))
    save(smooth_image().convert("CMYK"), root / "validation" / "c0" / "cmyk.JPEG")
    save(smooth_image(), root / "validation" / "c1" / "png.JPEG", "PNG")
    bad = root / "validation" / "c1" / "truncated.JPEG"
    save(smooth_image(), bad)
    bad.write_bytes(bad.read_bytes()[:-200])
    return bad


@pytest.mark.parametrize("train", [True, False])
def test_the_device_path_on_the_cpu_gives_the_workers_pixels(tmp_path, train):
    """The GPU path's batches (the workers send JPEGs and crops, the main process decodes them with
    TorchCodec's batched call on `device` and resizes there), with device="cpu", equal the batches the
    workers decode whole with the same crops: the same decoder and the same resize."""
    bad = write_mixed_tree(tmp_path)
    bad.unlink()
    if train:
        write_tree(tmp_path, "train", [4, 4], size=(48, 40))
        save(smooth_image().convert("CMYK"), tmp_path / "train" / "c0" / "cmyk.JPEG")
    common = dict(train=train, batch_size=4, image_size=16, workers=1, seed=9, decoder=ImageDecoder(use_native=False))
    records = records_in(tmp_path, "train" if train else "validation")
    host = [batch for batch in ImageNetBatches(records, **common).epoch(0)]
    device = ImageNetBatches(records, **common, device_decoding=torch.device("cpu"))
    on_device = list(device.epoch(0))
    assert len(on_device) == len(host) > 1
    for (images, labels), (host_images, host_labels) in zip(on_device, host):
        assert torch.equal(labels, host_labels) and torch.equal(images, host_images)


def test_the_device_path_decodes_a_jpeg_nvjpeg_rejects_on_the_host_or_drops_it(tmp_path):
    bad = write_mixed_tree(tmp_path)
    source = ImageNetBatches(records_in(tmp_path, "validation"), train=False, batch_size=5, image_size=16, workers=0,
                             device_decoding=torch.device("cpu"))
    batch = source.loader.dataset[list(range(9))]
    assert isinstance(batch, DeviceBatch) and len(batch.host_rows) == 2  # the CMYK and the PNG bytes
    assert str(bad) in batch.sources
    # libjpeg decodes a truncated scan with a warning (grey rows below the data) where nvJPEG may
    # refuse it; either way the batch is whole. A JPEG that nothing decodes is named, or dropped:
    blob = bytearray(bad.read_bytes())
    blob[blob.index(b"\xff\xda") + 2:] = b"\x00" * (len(blob) - blob.index(b"\xff\xda") - 2)
    bad.write_bytes(bytes(blob[:blob.index(b"\xff\xda") + 4]))
    with pytest.raises(DataError, match=f"^{re.escape(str(bad))}: cannot decode image"):
        list(source.epoch(0))
    skipping = ImageNetBatches(records_in(tmp_path, "validation"), train=False, batch_size=5, image_size=16, workers=0,
                               skip_corrupt=True,
                               device_decoding=torch.device("cpu"))
    sizes = [len(labels) for _, labels in skipping.epoch(0)]
    assert sizes == [5, 3] and skipping.skipped_names == [str(bad)]


def test_one_undecodable_jpeg_does_not_fail_the_batched_call_for_the_others():
    good = [torch.frombuffer(bytearray(encoded(smooth_image(30 + i, 20))), dtype=torch.uint8) for i in range(3)]
    bad = torch.frombuffer(bytearray(encoded(smooth_image())[:150]), dtype=torch.uint8)
    crops = [Crop((0, 0, 20, 20))] * 4
    outs = [torch.zeros(8, 8, 3, dtype=torch.uint8) for _ in range(4)]
    failed = decode_crops_on_device([good[0], bad, good[1], good[2]], crops, [(20, 30), (40, 60), (20, 31), (20, 32)],
                                    outs, torch.device("cpu"))
    assert failed == [1]
    assert all(out.float().mean() > 20 for i, out in enumerate(outs) if i != 1) and (outs[1] == 0).all()


def test_device_batches_pin_their_host_tensors(monkeypatch):
    batch = DeviceBatch(labels=torch.tensor([1]), encoded=torch.zeros(10, dtype=torch.uint8), offsets=[0, 10],
                        device_rows=[0], crops=[Crop((0, 0, 1, 1))], sizes=[(1, 1)], sources=["a"],
                        host_images=torch.zeros(0, 8, 8, 3, dtype=torch.uint8), host_rows=[], image_size=8)
    pinned = SimpleNamespace(calls=0)

    def pin(self):
        pinned.calls += 1
        return self.clone()

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    copy = batch.pin_memory()
    assert pinned.calls == 3 and copy.offsets == batch.offsets and copy is not batch
