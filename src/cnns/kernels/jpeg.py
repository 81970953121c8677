"""Decoding only the region of a JPEG that a crop needs, resized and flipped straight into a batch.

``decode_resized_into(data, out, box, flip)`` decodes the part of the JPEG under ``box`` (libjpeg-turbo's
``jpeg_crop_scanline`` and ``jpeg_skip_scanlines``, stopping after the last row the resize reads; the DCT
scaled by 1/2 or 1/4 where the box is at least 2x or 4x the output in both dimensions), resizes the box to
``out``'s size with the antialiased bilinear filter of PIL and torchvision's ``antialias=True`` uint8
resize, flips it left-right when asked, and writes the pixels into ``out`` (uint8 [H, W, 3], for example one
image ``batch[i]`` of a shared-memory batch): one native call per image, without the GIL. The filter reads
only pixels of the box (rounded outwards to whole pixels), which is torchvision's crop-then-resize for an
integer box (training's random resized crop); ``read_around_box=True`` gives resize-then-crop instead
(evaluation's resize and centre crop, whose box is fractional).

The extension (jpeg.cpp) is built when the package is installed where libjpeg-turbo's headers are found
(setup.py). Where it was not, ``available()`` is False and the loader decodes whole images with its general
decoder. That decoder is also the fallback per image: ``UnsupportedJpeg`` for colour spaces this path does
not convert (CMYK, YCCK), ``JpegError`` for data libjpeg reports as corrupt or truncated, warnings included;
given the same bytes, the general decoder then decodes or rejects them as it does every other image.
"""

from __future__ import annotations

from typing import Union

import numpy as np
import torch

from cnns.kernels import load_build

_ext = load_build("jpeg")

# What the decoder reads the JPEG from: the whole file's bytes.
JpegBytes = Union[bytes, bytearray, memoryview, np.ndarray, torch.Tensor]

if _ext is not None:
    JpegError = _ext.JpegError
    UnsupportedJpeg = _ext.UnsupportedJpeg
else:  # pragma: no cover - depends on the installation (no libjpeg-turbo headers at install time)

    class JpegError(ValueError):
        """Bytes that libjpeg cannot read as a JPEG (corrupt, truncated, not a JPEG)."""

    class UnsupportedJpeg(JpegError):
        """A JPEG whose colour space the region decoder does not convert (CMYK, YCCK)."""

# Whether this build draws training crops itself (decode_training_into, training_crop): a build made before
# they existed lacks them, and the loader then draws in Python and calls decode_resized_into (the same pixels).
TRAINING_DRAW = _ext is not None and hasattr(_ext, "decode_training_into")

if TRAINING_DRAW:
    TooManyPixels = _ext.TooManyPixels
else:

    class TooManyPixels(ValueError):
        """A header declaring more pixels than allowed; the message is "height width"."""

# The training crop's draw as decode_training_into and training_crop take it: (seed, epoch, index) of the
# sample, each below 2**64, then the constants of cnns.data.imagenet.training_crop: area range, log-aspect
# range, aspect range, tries, and the stream's label of sample_generator.
CropDraw = tuple[int, int, int, float, float, float, float, float, float, int, int]


def available() -> bool:
    """Whether the region decoder was built and imports here."""
    return _ext is not None


def _buffer(data: JpegBytes) -> bytes | bytearray | memoryview | np.ndarray:
    """The bytes as an object with the buffer protocol, without copying (a tensor's memory is shared)."""
    if isinstance(data, torch.Tensor):
        if data.dtype != torch.uint8 or data.dim() != 1 or data.device.type != "cpu":
            raise ValueError(f"JPEG data must be a 1-D uint8 CPU tensor, got {data.dtype} {tuple(data.shape)} "
                             f"on {data.device}")
        return data.contiguous().numpy()
    return data


def header(data: JpegBytes) -> tuple[int, int, int]:
    """(height, width, components) read from the JPEG's header alone. JpegError where the header cannot be
    read; UnsupportedJpeg for CMYK / YCCK JPEGs."""
    _require()
    return _ext.header(_buffer(data))


def decode_resized_into(data: JpegBytes, out: torch.Tensor, box: tuple[float, float, float, float], flip: bool,
                        timings: bool = False, read_around_box: bool = False) -> tuple[int, int, int] | None:
    """Decode the region ``box`` = (top, left, height, width) of the JPEG (source pixels, fractions allowed),
    resize it to ``out``'s size (antialiased bilinear), flip it left-right when ``flip``, write it into ``out``
    (a contiguous uint8 CPU tensor [H, W, 3], which may be a view into a batch).

    The filter reads the box's pixels only (rounded outwards to whole pixels): torchvision's crop then
    resize. With ``read_around_box`` it also reads the pixels around the box that its support reaches (inside
    the image), as resizing the whole image and then cropping the box's image does: evaluation's resize to
    the short side then centre crop, given the crop's box in source pixels.

    With ``timings``, returns the nanoseconds spent (decoding, resizing, flipping) measured inside the call;
    the flip is folded into the resize's column order, so its share is that reordering alone. JpegError for
    corrupt or truncated data, UnsupportedJpeg for CMYK / YCCK; ValueError for a box outside the image or an
    ``out`` of another kind."""
    _require()
    top, left, height, width = box
    return _ext.decode_resized_into(_buffer(data), _pixels(out), float(top), float(left), float(height),
                                    float(width), bool(flip), bool(read_around_box), bool(timings))


def training_crop(height: int, width: int, draw: CropDraw) -> tuple[int, int, int, int, bool]:
    """(top, left, height, width, flip) of the training crop that ``draw`` gives an image of (height, width):
    ``cnns.data.imagenet.training_crop`` of ``sample_generator(seed, epoch, index)``, bit for bit (numpy's PCG64
    stream and Generator draws, the same double arithmetic), drawn natively."""
    _require()
    return _ext.training_crop(height, width, *draw)


def decode_training_into(data: JpegBytes, out: torch.Tensor | np.ndarray, draw: CropDraw, max_pixels: int,
                         timings: bool = False) -> tuple[int, int, int, int] | None:
    """One training image in one call: the header read, the crop drawn from its size (``training_crop``),
    the crop's region decoded, resized and flipped into ``out`` as ``decode_resized_into`` does. ``out``: a
    contiguous uint8 [H, W, 3] CPU tensor or numpy array. TooManyPixels (message "height width"), before any
    decoding, where the header declares more than ``max_pixels``; JpegError / UnsupportedJpeg as
    ``decode_resized_into``. With ``timings``, the nanoseconds (header + draw, decode, resize, flip)."""
    _require()
    return _ext.decode_training_into(_buffer(data), out if isinstance(out, np.ndarray) else _pixels(out), *draw,
                                     max_pixels, timings)


def _pixels(out: torch.Tensor) -> np.ndarray:
    """out's memory as a numpy array (shared, not copied), after checking it is what the decoder writes."""
    if (out.dtype != torch.uint8 or out.dim() != 3 or out.shape[2] != 3 or out.device.type != "cpu"
            or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous uint8 CPU tensor [H, W, 3], got {out.dtype} {tuple(out.shape)} "
                         f"on {out.device}{'' if out.is_contiguous() else ', not contiguous'}")
    return out.detach().numpy()


def _require() -> None:
    if _ext is None:
        raise RuntimeError("cnns's region JPEG decoder is not built here (libjpeg-turbo's headers were not found "
                           "when the package was installed): check cnns.kernels.jpeg.available() first")
