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

The decoder (jpeg.cpp) is built when the package is installed where libjpeg-turbo's headers are found
(setup.py). Where it was not, ``available()`` is False and the loader decodes whole images with its general
decoder. That decoder is also the fallback per image: ``UnsupportedJpeg`` for colour spaces this path does
not convert (CMYK, YCCK), ``JpegError`` for data libjpeg reports as corrupt or truncated, warnings included;
given the same bytes, the general decoder then decodes or rejects them as it does every other image.
"""

from __future__ import annotations

import ctypes
from typing import Union

import numpy as np
import torch

from cnns.kernels import DOUBLE, INT, INT64, POINTER, load_build

# What the decoder reads the JPEG from: the whole file's bytes.
JpegBytes = Union[bytes, bytearray, memoryview, np.ndarray, torch.Tensor]


class JpegError(ValueError):
    """Bytes that libjpeg cannot read as a JPEG (corrupt, truncated, not a JPEG)."""


class UnsupportedJpeg(JpegError):
    """A JPEG whose colour space the region decoder does not convert (CMYK, YCCK)."""


class TooManyPixels(ValueError):
    """A header declaring more pixels than allowed; the message is "height width"."""


# jpeg.cpp's Status codes, as the exceptions they raise (0: done).
STATUS_ERRORS = {1: JpegError, 2: UnsupportedJpeg, 3: TooManyPixels, 4: ValueError, 5: RuntimeError}
MESSAGE_BYTES = 512

# The training crop's draw as decode_training_into and training_crop take it: (seed, epoch, index) of the
# sample, each below 2**64, then the constants of cnns.data.image_loader.training_crop: area range, log-aspect
# range, aspect range, tries, and the stream's label of sample_generator.
CropDraw = tuple[int, int, int, float, float, float, float, float, float, int, int]

UINT64 = ctypes.c_uint64
_DRAW = (UINT64, UINT64, UINT64, DOUBLE, DOUBLE, DOUBLE, DOUBLE, DOUBLE, DOUBLE, INT, UINT64)
_MESSAGE = (ctypes.c_char_p, INT64)


class _Decoder:
    """The entry points of the built jpeg.cpp."""

    def __init__(self, library):
        self.name = library.name
        self.header = library.entry("cnns_jpeg_header", INT, POINTER, INT64, POINTER, *_MESSAGE)
        self.decode_resized_into = library.entry("cnns_jpeg_decode_resized_into", INT, POINTER, INT64, POINTER,
                                                 INT64, INT64, DOUBLE, DOUBLE, DOUBLE, DOUBLE, INT, INT, POINTER,
                                                 *_MESSAGE)
        self.training_crop = library.entry("cnns_jpeg_training_crop", INT, INT64, INT64, *_DRAW, POINTER, *_MESSAGE)
        self.decode_training_into = library.entry("cnns_jpeg_decode_training_into", INT, POINTER, INT64, POINTER,
                                                  INT64, INT64, *_DRAW, INT64, POINTER, *_MESSAGE)


_library = load_build("jpeg")
_ext: _Decoder | None = _Decoder(_library) if _library is not None else None


def available() -> bool:
    """Whether the region decoder was built and loads here."""
    return _ext is not None


def _call(entry, *arguments) -> None:
    """Calls a C entry point with a message buffer after ``arguments``; raises the exception its status names."""
    message = ctypes.create_string_buffer(MESSAGE_BYTES)
    status = entry(*arguments, message, MESSAGE_BYTES)
    if status:
        raise STATUS_ERRORS.get(status, RuntimeError)(message.value.decode("utf-8", "replace"))


def _bytes(data: JpegBytes) -> tuple[np.ndarray, int]:
    """The bytes as a uint8 numpy array sharing their memory (no copy; a tensor's memory is shared) and its
    address."""
    if isinstance(data, torch.Tensor):
        if data.dtype != torch.uint8 or data.dim() != 1 or data.device.type != "cpu":
            raise ValueError(f"JPEG data must be a 1-D uint8 CPU tensor, got {data.dtype} {tuple(data.shape)} "
                             f"on {data.device}")
        array = data.contiguous().numpy()
    elif isinstance(data, np.ndarray):
        if data.dtype != np.uint8 or data.ndim != 1 or not data.flags.c_contiguous:
            raise ValueError("JPEG data must be contiguous bytes (bytes, memoryview or a 1-D uint8 array)")
        array = data
    else:
        try:
            array = np.frombuffer(data, dtype=np.uint8)
        except (TypeError, ValueError, BufferError) as exc:
            raise ValueError("JPEG data must be contiguous bytes (bytes, memoryview or a 1-D uint8 array)") from exc
    return array, array.ctypes.data


def header(data: JpegBytes) -> tuple[int, int, int]:
    """(height, width, components) read from the JPEG's header alone. JpegError where the header cannot be
    read; UnsupportedJpeg for CMYK / YCCK JPEGs."""
    _require()
    array, pointer = _bytes(data)
    dims = (ctypes.c_int64 * 3)()
    _call(_ext.header, pointer, array.size, dims)
    return dims[0], dims[1], dims[2]


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
    array, pointer = _bytes(data)
    pixels = _pixels(out)
    spent = (ctypes.c_int64 * 3)()
    _call(_ext.decode_resized_into, pointer, array.size, pixels.ctypes.data, pixels.shape[0], pixels.shape[1],
          float(top), float(left), float(height), float(width), bool(flip), bool(read_around_box), spent)
    return (spent[0], spent[1], spent[2]) if timings else None


def training_crop(height: int, width: int, draw: CropDraw) -> tuple[int, int, int, int, bool]:
    """(top, left, height, width, flip) of the training crop that ``draw`` gives an image of (height, width):
    ``cnns.data.image_loader.training_crop`` of ``sample_generator(seed, epoch, index)``, bit for bit (numpy's PCG64
    stream and Generator draws, the same double arithmetic), drawn natively."""
    _require()
    crop = (ctypes.c_int64 * 5)()
    _call(_ext.training_crop, height, width, *draw, crop)
    return crop[0], crop[1], crop[2], crop[3], bool(crop[4])


def decode_training_into(data: JpegBytes, out: torch.Tensor | np.ndarray, draw: CropDraw, max_pixels: int,
                         timings: bool = False) -> tuple[int, int, int, int] | None:
    """One training image in one call: the header read, the crop drawn from its size (``training_crop``),
    the crop's region decoded, resized and flipped into ``out`` as ``decode_resized_into`` does. ``out``: a
    contiguous uint8 [H, W, 3] CPU tensor or numpy array. TooManyPixels (message "height width"), before any
    decoding, where the header declares more than ``max_pixels``; JpegError / UnsupportedJpeg as
    ``decode_resized_into``. With ``timings``, the nanoseconds (header + draw, decode, resize, flip)."""
    _require()
    array, pointer = _bytes(data)
    pixels = _checked_array(out) if isinstance(out, np.ndarray) else _pixels(out)
    spent = (ctypes.c_int64 * 4)()
    _call(_ext.decode_training_into, pointer, array.size, pixels.ctypes.data, pixels.shape[0], pixels.shape[1],
          *draw, max_pixels, spent)
    return (spent[0], spent[1], spent[2], spent[3]) if timings else None


def _checked_array(out: np.ndarray) -> np.ndarray:
    """out itself, after checking it is a writable, C-contiguous uint8 [H, W, 3] array."""
    if (out.dtype != np.uint8 or out.ndim != 3 or out.shape[2] != 3 or out.shape[0] < 1 or out.shape[1] < 1
            or not out.flags.c_contiguous or not out.flags.writeable):
        raise ValueError("out must be a contiguous uint8 [H, W, 3] buffer")
    return out


def _pixels(out: torch.Tensor) -> np.ndarray:
    """out's memory as a numpy array (shared, not copied), after checking it is what the decoder writes."""
    if (out.dtype != torch.uint8 or out.dim() != 3 or out.shape[2] != 3 or out.device.type != "cpu"
            or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous uint8 CPU tensor [H, W, 3], got {out.dtype} {tuple(out.shape)} "
                         f"on {out.device}{'' if out.is_contiguous() else ', not contiguous'}")
    return _checked_array(out.detach().numpy())


def _require() -> None:
    if _ext is None:
        raise RuntimeError("cnns's region JPEG decoder is not built here (libjpeg-turbo's headers were not found "
                           "when the package was installed): check cnns.kernels.jpeg.available() first")
