"""Encoded image bytes -> the pixels of one crop, written straight into a row of a uint8 NHWC batch.

One decoder serves a run, chosen once and named in the run's header:

- The native decoder (`cnns.kernels.jpeg`, libjpeg-turbo), where it is built: the crop is drawn from the
  header's size, then only the crop's region of the JPEG is decoded (partial decoding, DCT-domain scaling
  where the crop is at least twice the output), resized and flipped, in one call into the batch row.
  Grey and YCbCr JPEGs; the others fall through to
- TorchCodec: the whole image decoded, then the crop cut and resized by torch's antialiased bilinear
  resize. CMYK / YCCK JPEGs, PNG, GIF and WebP whatever the file's extension, a JPEG the native decoder
  refuses, and every image where the native decoder is not built. PIL reads the formats TorchCodec does
  not (`cnns.data.imagefolder.decode_rgb`).
- On a CUDA run (--decode-device), the workers only read the files and draw the crops; the main process
  decodes each batch's JPEGs at once with nvJPEG (TorchCodec's ``decode_jpeg(list, device=...)``, or
  torchvision's, which has the same call, where TorchCodec cannot decode on the GPU) and crops and
  resizes them on the GPU (`DeviceBatch.finish`). Files nvJPEG does not take are decoded by the workers
  as above and travel as pixels.

TorchCodec's builds follow torch's releases, so a machine that keeps an older CUDA torch may have no
TorchCodec that loads: torchvision, which ships with every torch, then decodes (`whole_image_decoder`,
`device_jpeg_decoder`), and the run's header names the library.

Orientation: the pixels are the file's stored ones, as libjpeg-turbo gives them; TorchCodec would apply
a JPEG's EXIF orientation, so `cnns.data.imagefolder.decode_rgb` hides that segment from it (see
`stored_orientation`).
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass, field, replace
from types import ModuleType
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from cnns.data import dali_probe
from cnns.data.imagefolder import MAX_IMAGE_PIXELS, decode_rgb, jpeg_frame, whole_image_decoder
from cnns.errors import ConfigError, DataError, first_line

CropBox = tuple[float, float, float, float]  # top, left, height, width, in source pixels


@dataclass(frozen=True)
class Crop:
    """Which part of the image becomes the output, and whether it is mirrored.

    `box` is resized to the output's size. A decoder that has the whole image in hand cuts the box out
    first and resizes it (RandomResizedCrop's order) unless `whole_first`, which resizes the whole image
    by the box's scale and then cuts the box out: "resize the short side, then crop the centre", whose box
    has fractional edges in source pixels. The native decoder resizes the box, clamped to it, either way
    (the two differ only where the antialiasing filter reaches over the box's edge)."""

    box: CropBox
    flip: bool = False
    whole_first: bool = False
    # The resampler (evaluation's --eval-interpolation): "bilinear" is torch's antialiased bilinear (the native
    # decoder's too); "bicubic" is PIL's antialiased bicubic, which timm's eval transform resizes with, done on
    # the whole decoded image (no region decoder, no DCT scaling: the pixels timm's PIL path sees).
    interpolation: str = "bilinear"

    def fitted(self, height: int, width: int, expected: tuple[int, int]) -> "Crop":
        """The crop scaled onto an image of (height, width) when the decoder gave another size than the
        header declared (`expected`): never outside the image, whatever the header said."""
        if (height, width) == expected:
            return self
        sy, sx = height / expected[0], width / expected[1]
        top, left, box_height, box_width = self.box
        return replace(self, box=(top * sy, left * sx, box_height * sy, box_width * sx))


Placement = Callable[[int, int], Crop]  # (height, width) of the image -> its crop


# ----------------------------------------------------------------------------------------------
# Pixels: the whole image decoded, then cropped and resized with torch
# ----------------------------------------------------------------------------------------------


def decode_whole(data: bytes, source: str) -> torch.Tensor:
    """Encoded bytes -> uint8 [H, W, 3] (contiguous), in the file's stored orientation. DataError naming
    `source` when no decoder reads them or the header declares too many pixels."""
    return decode_rgb(data, source).permute(1, 2, 0)


def _resize(image: torch.Tensor, size: tuple[int, int], interpolation: str = "bilinear") -> torch.Tensor:
    """uint8 [h, w, 3] -> uint8 [size[0], size[1], 3]: torch's antialiased bilinear resize (what
    torchvision's resize runs for tensors), or PIL's bicubic (what torchvision's resize runs for PIL images, timm's
    eval transform: bitwise its pixels). On the CPU torch's uint8 kernel works in place of channels-last
    memory; elsewhere (CUDA has no uint8 kernel, nor PIL) it resizes in float32 and rounds."""
    if tuple(image.shape[:2]) == tuple(size):
        return image
    if interpolation == "bicubic" and image.device.type == "cpu":
        from PIL import Image

        pixels = Image.fromarray(image.contiguous().numpy()).resize((size[1], size[0]), Image.Resampling.BICUBIC)
        return torch.from_numpy(np.asarray(pixels).copy())
    batch = image.permute(2, 0, 1).unsqueeze(0)  # NCHW, channels-last in memory
    if image.device.type == "cpu" and image.dtype == torch.uint8:
        batch = batch.contiguous(memory_format=torch.channels_last)
        resized = F.interpolate(batch, size=size, mode="bilinear", antialias=True, align_corners=False)
    else:
        resized = F.interpolate(batch.float(), size=size, mode=interpolation, antialias=True, align_corners=False)
        resized = resized.round_().clamp_(0, 255).to(torch.uint8)
    return resized[0].permute(1, 2, 0)


def resize_crop_into(image: torch.Tensor, crop: Crop, out: torch.Tensor) -> None:
    """Write `crop` of the uint8 [H, W, 3] `image`, resized to out's [h, w, 3] and mirrored if asked, into
    `out` (on image's device)."""
    height, width = image.shape[:2]
    out_size = (out.shape[0], out.shape[1])
    top, left, box_height, box_width = crop.box
    if crop.whole_first:
        scale_y, scale_x = out_size[0] / box_height, out_size[1] / box_width
        whole = _resize(image, (max(1, round(height * scale_y)), max(1, round(width * scale_x))), crop.interpolation)
        row, column = round(top * scale_y), round(left * scale_x)
        resized = whole[row:row + out_size[0], column:column + out_size[1]]
    else:
        row, column = min(height - 1, int(top)), min(width - 1, int(left))
        region = image[row:max(row + 1, round(top + box_height)), column:max(column + 1, round(left + box_width))]
        resized = _resize(region, out_size, crop.interpolation)
    if tuple(resized.shape[:2]) != out_size:  # a box reaching past a lying header's image: fill what is there
        resized = _resize(resized, out_size, crop.interpolation)
    out.copy_(resized.flip(1) if crop.flip else resized)


# ----------------------------------------------------------------------------------------------
# The decoder of a run
# ----------------------------------------------------------------------------------------------


@functools.cache
def native_jpeg() -> ModuleType | None:
    """`cnns.kernels.jpeg` where it is built and usable here, else None."""
    try:
        from cnns.kernels import jpeg
    except ImportError:
        return None
    return jpeg if jpeg.available() else None


NATIVE_NAME = "libjpeg-turbo (region + DCT scaling, cnns native)"


@dataclass
class DecodeClock:
    """Nanoseconds in each stage of `ImageDecoder.decode_into`, summed over the images decoded with this clock
    (what `cnns bench-data`'s account of one image reads): the header read and the crop drawn, decode, crop +
    resize, flip (the native decoder's own clocks inside its one call; the whole-image path mirrors as it
    resizes, so its flip is inside resize), and how many images were decoded whole."""

    header: int = 0
    decode: int = 0
    resize: int = 0
    flip: int = 0
    whole: int = 0

    def add(self, header: int, decode: int, resize: int, flip: int, whole: int) -> None:
        self.header, self.decode, self.resize = self.header + header, self.decode + decode, self.resize + resize
        self.flip, self.whole = self.flip + flip, self.whole + whole


class ImageDecoder:
    """Encoded bytes + where to crop -> pixels in a batch row: the native region decoder for the JPEGs it
    takes when it is built, the whole image by TorchCodec (PIL for other formats) for the rest.

    Holds no module, only whether to use the native one, so it pickles into DataLoader workers however
    they are started."""

    def __init__(self, use_native: bool | None = None) -> None:
        self.use_native = native_jpeg() is not None if use_native is None else use_native

    @property
    def name(self) -> str:
        whole = f"{whole_image_decoder().name} (whole image)"
        if self.use_native:
            return f"{NATIVE_NAME}; {whole} for other files"
        return f"{whole}; the native region decoder is not built"

    def decode_into(self, data: bytes, source: str, place: Placement, out: torch.Tensor | np.ndarray,
                    clock: DecodeClock | None = None) -> None:
        """Draw the crop with `place(height, width)` and write its pixels into `out` (uint8 [h, w, 3], a CPU
        tensor or numpy array). DataError naming `source` when the bytes cannot be decoded. `place` may be called
        twice (a JPEG the native decoder gives up on, or whose crop asks for another resampler than its bilinear
        one, is decoded whole): it must give the same crop for the same size. With `clock`, the time of each stage
        is added to it."""
        out = torch.from_numpy(out) if isinstance(out, np.ndarray) else out
        native = native_jpeg() if self.use_native else None
        start = time.perf_counter_ns()
        if native is not None and data[:2] == b"\xff\xd8":
            try:
                height, width, _ = native.header(data)
                _check_pixels(height, width, source)
                crop = place(height, width)
                if crop.interpolation == "bilinear":  # its resampler; another is the whole-image path's
                    if clock is None:
                        native.decode_resized_into(data, out, crop.box, crop.flip)
                    else:
                        drawn = time.perf_counter_ns()
                        clock.add(drawn - start, *native.decode_resized_into(data, out, crop.box, crop.flip,
                                                                               timings=True), whole=0)
                    return
            except native.JpegError:  # CMYK / YCCK, or bytes it rejects: decoded whole, or the fault named
                pass
        self._decode_whole_into(data, source, place, out, clock)

    def decode_training_into(self, data: bytes, source: str, draw: tuple, place: Placement,
                             out: torch.Tensor | np.ndarray, clock: DecodeClock | None = None) -> None:
        """`decode_into` for a training crop that `draw` describes (`cnns.kernels.jpeg.CropDraw`, the same crop
        as `place` draws): the native decoder reads the header, draws the crop and decodes it in one call; the
        whole-image path draws with `place`. `out` may also be a numpy array (a row of a batch's numpy view)."""
        native = native_jpeg() if self.use_native else None
        if native is not None and data[:2] == b"\xff\xd8":
            try:
                times = native.decode_training_into(data, out, draw, MAX_IMAGE_PIXELS, clock is not None)
            except native.TooManyPixels as error:
                _check_pixels(*(int(part) for part in str(error).split()), source)
                raise  # not reached: the size is over the limit
            except native.JpegError:  # CMYK / YCCK, or bytes it rejects: decoded whole, or the fault named
                pass
            else:
                if clock is not None:
                    clock.add(*times, whole=0)
                return
        self._decode_whole_into(data, source, place, torch.from_numpy(out) if isinstance(out, np.ndarray) else out,
                                clock)

    @staticmethod
    def _decode_whole_into(data: bytes, source: str, place: Placement, out: torch.Tensor,
                           clock: DecodeClock | None) -> None:
        start = time.perf_counter_ns()
        image = decode_whole(data, source)
        decoded = time.perf_counter_ns()
        crop = place(image.shape[0], image.shape[1])
        drawn = time.perf_counter_ns()
        resize_crop_into(image, crop, out)
        if clock is not None:
            clock.add(drawn - decoded, decoded - start, time.perf_counter_ns() - drawn, 0, whole=1)


def _check_pixels(height: int, width: int, source: str) -> None:
    if height * width > MAX_IMAGE_PIXELS:
        raise DataError(f"{source}: cannot decode image (its header declares {width} x {height} pixels, "
                        f"more than the limit of {MAX_IMAGE_PIXELS}: corrupt, or not a photo)")


# ----------------------------------------------------------------------------------------------
# Decoding on the GPU
# ----------------------------------------------------------------------------------------------


def device_jpeg_size(data: bytes, source: str) -> tuple[int, int] | None:
    """(height, width) of a JPEG nvJPEG decodes (grey or three components), from its header; None for
    every other file, which the workers decode themselves."""
    frame = jpeg_frame(data)
    if frame is None or frame[2] not in (1, 3) or frame[0] == 0 or frame[1] == 0:
        return None
    _check_pixels(frame[1], frame[0], source)
    return frame[1], frame[0]


@dataclass
class DeviceBatch:
    """A batch as the workers leave it for decoding on the device: the encoded JPEGs one after another
    in one tensor (shared memory, like the pixels of a CPU batch) with their crops, and the rows the
    workers decoded themselves (files nvJPEG does not take) as pixels."""

    labels: torch.Tensor  # int64 [B]
    encoded: torch.Tensor  # uint8 [total bytes]: the JPEGs for the device, one after another
    offsets: list[int]  # JPEG i is encoded[offsets[i]:offsets[i + 1]]
    device_rows: list[int]  # the batch row each JPEG fills
    crops: list[Crop]
    sizes: list[tuple[int, int]]  # (height, width) each header declared
    sources: list[str]  # each JPEG's file, for messages
    host_images: torch.Tensor  # uint8 [m, H, W, 3]: the rows the workers decoded
    host_rows: list[int]
    image_size: int
    skipped: list[str] = field(default_factory=list)  # --skip-corrupt-images: dropped by the workers

    def pin_memory(self) -> "DeviceBatch":
        """Called by the DataLoader's pinning thread (pin_memory=True): page-locked copies, so the copies
        to the device run asynchronously."""
        return replace(self, labels=self.labels.pin_memory(), encoded=self.encoded.pin_memory(),
                       host_images=self.host_images.pin_memory())

    def finish(self, device: torch.device, skip_corrupt: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
        """(uint8 [B', H, W, 3] images on `device`, int64 labels on `device`, names of the images dropped):
        the JPEGs decoded at once by nvJPEG, each crop resized on the device into its row. A
        JPEG the batched call cannot decode is retried alone, then decoded on the host; one that nothing
        decodes is a DataError, or with `skip_corrupt` dropped (the batch shrinks) and named."""
        rows = len(self.labels)
        images = torch.empty((rows, self.image_size, self.image_size, 3), dtype=torch.uint8, device=device)
        if self.host_rows:
            images[torch.tensor(self.host_rows, device=device)] = self.host_images.to(device, non_blocking=True)
        encoded = [self.encoded[self.offsets[i]:self.offsets[i + 1]] for i in range(len(self.device_rows))]
        failed = decode_crops_on_device(encoded, self.crops, self.sizes, [images[row] for row in self.device_rows],
                                        device)
        skipped = list(self.skipped)
        dropped = []
        for i in failed:
            try:
                image = decode_whole(bytes(encoded[i].cpu().numpy()), self.sources[i])
            except DataError:
                if not skip_corrupt:
                    raise
                skipped.append(self.sources[i])
                dropped.append(self.device_rows[i])
                continue
            resize_crop_into(image.to(device), self.crops[i].fitted(*image.shape[:2], self.sizes[i]),
                             images[self.device_rows[i]])
        labels = self.labels.to(device, non_blocking=True)
        if dropped:
            keep = torch.tensor(sorted(set(range(rows)) - set(dropped)), device=device)
            images, labels = images[keep], labels[keep]
        return images, labels, skipped


def decode_crops_on_device(encoded: Sequence[torch.Tensor], crops: Sequence[Crop], sizes: Sequence[tuple[int, int]],
                           outs: Sequence[torch.Tensor], device: torch.device) -> list[int]:
    """Decode the JPEGs (1-D uint8 host tensors) on `device` in one call of its decoder
    (`device_jpeg_decoder`), and write each crop, resized, into its `outs` row there. Returns the positions
    of the JPEGs it could not decode (the batched call fails as a whole on one bad file, so then each is
    tried alone). Written for CUDA (nvJPEG); both libraries decode on the CPU through the same call, which
    is how it is tested without a GPU."""
    if not encoded:
        return []
    decoder = device_jpeg_decoder(device)
    if isinstance(decoder, str):
        raise ConfigError(f"cannot decode JPEGs on {device} here ({decoder})")
    try:
        decoded: list[torch.Tensor | None] = list(decoder.decode(list(encoded), device))
    except (RuntimeError, ValueError):
        decoded = []
        for data in encoded:
            try:
                decoded.append(decoder.decode([data], device)[0])
            except (RuntimeError, ValueError):
                decoded.append(None)
    failed = []
    for i, (image, crop, size, out) in enumerate(zip(decoded, crops, sizes, outs)):
        if image is None:
            failed.append(i)
            continue
        image = image.permute(1, 2, 0)
        resize_crop_into(image, crop.fitted(image.shape[0], image.shape[1], size), out)
    return failed


# ----------------------------------------------------------------------------------------------
# CPU or GPU: the choice
# ----------------------------------------------------------------------------------------------

DECODE_DEVICES = ("auto", "cpu", "cuda", "dali")


@dataclass(frozen=True)
class DecodeRates:
    """What --decode-device auto weighs on a GPU without the hardware path: images/s the CPU decoder delivers
    on the run's worker cores (measured), and images/s the training step takes (None where no model is run)."""

    cpu_images_per_second: float
    workers: int
    step_images_per_second: float | None


@dataclass(frozen=True)
class DecodeChoice:
    device: str  # "cpu" (the workers decode), "cuda" (nvJPEG on the run's GPU) or "dali" (cnns.data.dali)
    reason: str  # why, for the header line
    library: str = ""  # which library's nvJPEG decodes on the GPU (DeviceJpegDecoder.name), when device is cuda


def local_gpu_processes() -> int:
    """Training processes on this node, one GPU each (torchrun's LOCAL_WORLD_SIZE; 1 for a plain run)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


@dataclass(frozen=True)
class DeviceJpegDecoder:
    name: str  # the library, for the run's header
    decode: Callable[[list[torch.Tensor], torch.device], list[torch.Tensor]]  # JPEG bytes -> uint8 [3, H, W]


def _torchcodec_jpegs(encoded: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    from torchcodec.decoders import decode_jpeg

    return list(decode_jpeg(encoded, mode="RGB", device=device))


def _torchvision_jpegs(encoded: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    from torchvision.io import ImageReadMode, decode_jpeg

    return list(decode_jpeg(encoded, mode=ImageReadMode.RGB, device=device))


# In the order tried: TorchCodec, the maintained decoders; torchvision's nvJPEG where TorchCodec cannot
# decode on the device (no TorchCodec build for this torch, or one without CUDA).
DEVICE_JPEG_DECODERS = (DeviceJpegDecoder("TorchCodec", _torchcodec_jpegs),
                        DeviceJpegDecoder("torchvision", _torchvision_jpegs))


def _tiny_jpeg() -> torch.Tensor:
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (16, 16), (90, 160, 30)).save(buffer, "JPEG")
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


@functools.lru_cache(maxsize=None)
def device_jpeg_decoder(device: torch.device) -> DeviceJpegDecoder | str:
    """The first of DEVICE_JPEG_DECODERS that decodes a tiny JPEG on `device`, or why none does (one line).
    Cached: what is installed does not change while the process runs."""
    reasons = []
    for decoder in DEVICE_JPEG_DECODERS:
        try:
            decoder.decode([_tiny_jpeg()], device)
        except Exception as error:  # noqa: BLE001 - any failure means "not here", said in one line
            reasons.append(f"{decoder.name}: {first_line(error)}")
            continue
        return decoder
    return "; ".join(reasons)


def choose_decode_device(requested: str, device: torch.device, *,
                         rates: Callable[[], DecodeRates] | None = None,
                         find: Callable[[torch.device], DeviceJpegDecoder | str] = device_jpeg_decoder,
                         hardware: Callable[[torch.device], bool] | None = None,
                         dali_missing: Callable[[], str | None] | None = None) -> DecodeChoice:
    """Where the run's images are decoded, for --decode-device `requested` on a run on `device`.

    "cpu": the workers decode. "cuda": the main process decodes with nvJPEG on the run's GPU (ConfigError when
    the run is not on one, or no library decodes there: `find`). "dali": NVIDIA DALI (`cnns.data.dali`), on
    the run's GPU or on the CPU (ConfigError naming the extra where DALI does not load). "auto", from what the
    machine has and what it measures, never from a core count:

    1. a run on the CPU: the workers;
    2. a GPU with hardware JPEG decoders (`hardware`) and DALI installed: DALI there, which leaves the compute
       units to the model;
    3. otherwise the CPU decoder where its measured rate on the run's workers covers the step's (`rates`),
       else nvJPEG on the GPU where a library decodes there, else the CPU decoder all the same.

    The checks are injected for tests; by default they are `cnns.data.dali`'s and `measured_rates`."""
    hardware = hardware or dali_probe.has_hardware_jpeg_decoder
    dali_missing = dali_missing or dali_probe.dali_missing
    if requested not in DECODE_DEVICES:
        raise ConfigError(f"--decode-device must be one of {', '.join(DECODE_DEVICES)}, got {requested!r}")
    if requested == "cpu":
        return DecodeChoice("cpu", "--decode-device cpu")
    if requested == "dali":
        if (why := dali_missing()) is not None:
            raise ConfigError(f"--decode-device dali needs NVIDIA DALI, which does not load here ({why}): "
                              f"{dali_probe.INSTALL}")
        return DecodeChoice("dali", "--decode-device dali")
    if device.type != "cuda":
        if requested == "cuda":
            raise ConfigError(f"--decode-device cuda needs a run on a CUDA GPU; this run is on {device}")
        return DecodeChoice("cpu", f"--decode-device auto: the run is on {device.type}")
    if requested == "cuda":
        decoder = find(device)
        if isinstance(decoder, str):
            raise ConfigError(f"--decode-device cuda: cannot decode JPEGs on {device} here ({decoder})")
        return DecodeChoice("cuda", "--decode-device cuda", decoder.name)
    return choose_from_rates(device, hardware(device), dali_missing(), rates, find)


def choose_from_rates(device: torch.device, hardware_decoder: bool, dali_missing: str | None,
                      rates: Callable[[], DecodeRates] | None,
                      find: Callable[[torch.device], DeviceJpegDecoder | str]) -> DecodeChoice:
    """--decode-device auto on a GPU (`choose_decode_device`'s rule 2 and 3), with the reason for the header."""
    if hardware_decoder and dali_missing is None:
        return DecodeChoice("dali", f"--decode-device auto: {device} has a hardware JPEG decoder and DALI is "
                                    "installed")
    without = ("DALI, which would decode on its hardware JPEG decoder, does not load" if hardware_decoder
               else "no hardware JPEG decoder on this GPU")
    if rates is None:
        return DecodeChoice("cpu", f"--decode-device auto: {without}; the step's rate is not known here")
    measured = rates()
    cpu = f"the CPU decoder's {measured.cpu_images_per_second:,.0f} images/s on {measured.workers} workers"
    if measured.step_images_per_second is None:
        return DecodeChoice("cpu", f"--decode-device auto: {without}; {cpu}, the step's rate not known here")
    step = f"the step's estimated {measured.step_images_per_second:,.0f}"
    if measured.cpu_images_per_second >= measured.step_images_per_second:
        return DecodeChoice("cpu", f"--decode-device auto: {without}; {cpu} cover {step}")
    decoder = find(device)
    if isinstance(decoder, str):
        return DecodeChoice("cpu", f"--decode-device auto: {cpu} fall short of {step}, but JPEGs cannot be "
                                   f"decoded on {device} here ({decoder})")
    return DecodeChoice("cuda", f"--decode-device auto: {without}; {cpu} fall short of {step}", decoder.name)


def decoding_header(choice: DecodeChoice, decoder: ImageDecoder, device: torch.device) -> str:
    """The run's header line saying how its images are decoded."""
    if choice.device == "dali":
        return (f"{dali_probe.describe(device)}; files DALI is not given (CMYK JPEGs, other formats) by cnns's CPU "
                f"decoder in the main process ({choice.reason})")
    if choice.device == "cuda":
        return (f"Images decoded on {device} by nvJPEG ({choice.library}, whole images in batches), cropped and resized "
                f"there; files nvJPEG does not take by {decoder.name} in the workers ({choice.reason})")
    return f"Images decoded by {decoder.name} ({choice.reason})"
