"""ImageNet as a folder tree of image files: ``train/<class>/*.JPEG`` and ``validation/<class>/*``
(or ``val/<class>/*``). Classes are the sub-folder names, sorted, so class indices match
torchvision's ImageFolder and the usual synset order (n01440764 = 0, ...)."""

from __future__ import annotations

import functools
import io
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch.utils.data import Dataset

from cnns.bounded_reads import read_bounded
from cnns.data.batches import shuffled
from cnns.errors import DataError

# Real ImageNet has only .JPEG files (a few of them are really PNG or CMYK JPEG); the rest are for
# other trees laid out the same way. TorchCodec's decode_image reads JPEG, PNG, WebP and GIF (and
# AVIF, HEIC where its libraries are installed); PIL does the rest.
IMAGE_EXTENSIONS = frozenset({".jpeg", ".jpg", ".png", ".webp", ".bmp", ".gif"})
SPLIT_FOLDERS = {"train": ("train",), "validation": ("validation", "val")}

ImageTransform = Callable[[bytes, str], torch.Tensor]


# The largest image decoded: PIL's own decompression-bomb limit (twice Image.MAX_IMAGE_PIXELS), about
# 13400 x 13400, 537 MB of RGB pixels. ImageNet's largest photos are under a tenth of it; a corrupt
# header can declare 65535 x 65535 (12.9 GB), which the decoders would allocate before failing.
MAX_IMAGE_PIXELS = 178_956_970


def decode_rgb(data: bytes, source: str) -> torch.Tensor:
    """Encoded image bytes -> uint8 [3, H, W], HWC in memory (``.permute(1, 2, 0)`` is contiguous), in
    the file's stored orientation. TorchCodec's decoder finds the format from the bytes, whatever the
    file's extension, and converts grayscale, CMYK JPEGs, palette and 16-bit PNGs to 8-bit RGB itself;
    PIL is the fallback for formats it does not read. DataError naming `source` when neither can decode
    the bytes, or when the header declares more than MAX_IMAGE_PIXELS pixels."""
    check_declared_size(data, source)
    if may_hold_frames(data):  # its first frame only, by design: see `may_hold_frames`
        return _decode_rgb_with_pil(data, source, None)
    try:
        image = whole_image_decoder().decode(stored_orientation(data))
    except (RuntimeError, ValueError) as first_error:
        return _decode_rgb_with_pil(data, source, first_error)
    if image.dim() == 4:  # frames `may_hold_frames` did not foresee: the first (decoded, but bounded above)
        image = image[0]
    return image


def may_hold_frames(data: bytes) -> bool:
    """Whether the bytes are a GIF or an animated WebP (its VP8X header's animation flag): images whose frames
    TorchCodec decodes all at once, each at the canvas's size, while the pixel limit holds one of them (12 one-pixel
    frames on an 8000 x 8000 canvas, a few hundred bytes, took 3 GB). PIL decodes them a frame at a time, so the
    first frame alone is decoded: the cost is the one canvas the header declares, checked before."""
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return True
    return data[:4] == b"RIFF" and data[8:16] == b"WEBPVP8X" and len(data) > 20 and bool(data[20] & 0x02)


@dataclass(frozen=True)
class WholeImageDecoder:
    name: str
    decode: Callable[[bytes], torch.Tensor]  # encoded bytes -> uint8 [3, H, W] (or [N, 3, H, W] for animations)


def _torchcodec_image(data: bytes) -> torch.Tensor:
    from torchcodec.decoders import decode_image

    return decode_image(data, mode="RGB")


def _torchvision_image(data: bytes) -> torch.Tensor:
    from torchvision.io import ImageReadMode, decode_image

    return decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)


@functools.lru_cache(maxsize=1)
def whole_image_decoder() -> WholeImageDecoder:
    """TorchCodec's decoder, the maintained one; torchvision's where TorchCodec does not load (its builds
    follow torch's releases, so a machine that keeps an older CUDA torch may have none that loads)."""
    try:
        from torchcodec.decoders import decode_image  # noqa: F401 - loads TorchCodec's libraries
    except (ImportError, OSError, RuntimeError):
        return WholeImageDecoder("torchvision", _torchvision_image)
    return WholeImageDecoder("TorchCodec", _torchcodec_image)


_APP15 = 0xEF  # an application segment no decoder reads


def stored_orientation(data: bytes) -> bytes:
    """JPEG bytes whose EXIF segment (APP1 "Exif") is relabelled as an application segment no decoder
    reads; other bytes unchanged (the copy is made only when there is such a segment).

    TorchCodec applies a JPEG's EXIF orientation; libjpeg-turbo (the native region decoder, nvJPEG's
    host side), torchvision's and TensorFlow's decoders do not, and crops are drawn from the header's
    size, which is the stored one. Hidden from TorchCodec, every decoder gives the same stored pixels,
    as the models trained on ImageNet saw them."""
    if data[:2] != b"\xff\xd8":
        return data
    position = 2
    while position + 10 <= len(data) and data[position] == 0xFF:
        marker = data[position + 1]
        if marker == 0xDA or 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            return data  # a frame or the scan: past the header segments
        length = int.from_bytes(data[position + 2:position + 4], "big")
        if marker == 0xE1 and data[position + 4:position + 10] == b"Exif\x00\x00":
            relabelled = bytearray(data)
            relabelled[position + 1] = _APP15
            return bytes(relabelled)
        position += 2 + length
    return data


def check_declared_size(data: bytes, source: str) -> tuple[int, int] | None:
    """The (width, height) the header declares (None when it cannot be read without decoding); DataError
    when it is more than MAX_IMAGE_PIXELS pixels, before any decoder allocates them."""
    size = declared_size(data)
    if size is not None and size[0] * size[1] > MAX_IMAGE_PIXELS:
        raise DataError(f"{source}: cannot decode image (its header declares {size[0]} x {size[1]} pixels, "
                        f"more than the limit of {MAX_IMAGE_PIXELS}: corrupt, or not a photo)")
    return size


def _decode_rgb_with_pil(data: bytes, source: str, first_error: Exception | None) -> torch.Tensor:
    """The first frame (PIL loads no other until asked) as uint8 [3, H, W]; `first_error`: why TorchCodec did not
    decode it (None where it was not asked)."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as image:
            array = np.array(image.convert("RGB"))
    # PIL's format plugins raise many types for corrupt bytes (OSError, SyntaxError, ValueError,
    # struct.error, IndexError, DecompressionBombError, ...): every one means "not a decodable image".
    except Exception as error:  # noqa: BLE001
        first = f"{_reason(first_error)}; " if first_error is not None else ""
        raise DataError(f"{source}: cannot decode image ({first}PIL: {_reason(error)})") from None
    return torch.from_numpy(array).permute(2, 0, 1)  # HWC in memory, like torchvision's decoder


def _reason(error: Exception) -> str:
    """The first sentence of a decoder's message, without TorchCodec's C++ source location
    ("read_header_and_start, /path/DecodeJpeg.cpp:208, ...") or PIL's object address."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    text = re.sub(r"^\w+, \S+\.(?:cpp|h):\d+, ", "", text)
    text = re.sub(r" <_io\.BytesIO object at 0x[0-9a-fA-F]+>", "", text)
    return text.split(". ")[0].rstrip(".")[:200]  # the first sentence: TorchCodec's go on to suggest other APIs


def declared_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from the header of JPEG, PNG, GIF or WebP bytes, without decoding; None when
    the format is another or the header cannot be read (the decoder then reports the problem)."""
    if data[:2] == b"\xff\xd8":
        frame = jpeg_frame(data)
        return frame[:2] if frame is not None else None
    if data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) >= 24:
        return struct.unpack(">II", data[16:24])
    if data[:6] in (b"GIF87a", b"GIF89a") and len(data) >= 10:
        return struct.unpack("<HH", data[6:10])
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP" and len(data) >= 30:
        chunk = data[12:16]
        if chunk == b"VP8X":
            return (int.from_bytes(data[24:27], "little") + 1, int.from_bytes(data[27:30], "little") + 1)
        if chunk == b"VP8 ":
            width, height = struct.unpack("<HH", data[26:30])
            return width & 0x3FFF, height & 0x3FFF
        if chunk == b"VP8L":
            bits = int.from_bytes(data[21:25], "little")
            return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    return None


# Start-of-frame markers, which hold the image size: C0-CF except DHT (C4), JPG (C8) and DAC (CC).
_JPEG_FRAME_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}


def jpeg_frame(data: bytes) -> tuple[int, int, int] | None:
    """(width, height, colour components: 1 grey, 3 YCbCr or RGB, 4 CMYK or YCCK) from the first
    start-of-frame of JPEG bytes, walking the header segments before it; None when there is none."""
    if data[:2] != b"\xff\xd8":
        return None
    position = 2
    for _ in range(256):
        while position < len(data) and data[position] == 0xFF:  # a marker, after any fill bytes
            position += 1
        if position + 9 > len(data) or data[position - 1] != 0xFF:
            return None
        marker = data[position]
        if marker in _JPEG_FRAME_MARKERS:
            height, width, components = struct.unpack(">HHB", data[position + 4:position + 9])
            return width, height, components
        if marker == 0xD9 or marker == 0xDA:  # end of image, or scan data before any frame: no size
            return None
        if 0xD0 <= marker <= 0xD8 or marker == 0x01:  # standalone markers, no length
            position += 1
            continue
        position += 1 + struct.unpack(">H", data[position + 1:position + 3])[0]
    return None


def find_split_folder(root: str | os.PathLike, split: str) -> Path | None:
    """root/train for "train"; root/validation or root/val for "validation"; None if absent."""
    if split not in SPLIT_FOLDERS:
        raise ValueError(f"split must be one of {tuple(SPLIT_FOLDERS)}, got {split!r}")
    for name in SPLIT_FOLDERS[split]:
        folder = Path(root) / name
        if folder.is_dir():
            return folder
    return None


def list_classes(split_folder: Path) -> list[str]:
    """Sorted names of the class sub-folders (hidden ones skipped)."""
    with os.scandir(split_folder) as entries:
        return sorted(e.name for e in entries if e.is_dir() and not e.name.startswith("."))


def list_images(class_folder: Path) -> list[Path]:
    """Image files of one class folder, sorted by name so the order is the same on every machine. Every entry
    named as an image is listed, whatever it is: one that is not a regular file (a FIFO, a device, a directory
    named x.jpg) is then named when it is read (`cnns.bounded_reads`), as a corrupt image is, never silently left
    out."""
    with os.scandir(class_folder) as entries:
        names = [e.name for e in entries
                 if not e.name.startswith(".") and os.path.splitext(e.name)[1].lower() in IMAGE_EXTENSIONS]
    return [class_folder / name for name in sorted(names)]


def _default_decode(data: bytes, source: str) -> torch.Tensor:
    return decode_rgb(data, source)


class ImageFolderDataset(Dataset):
    """Map-style dataset over ``root/<split folder>/<class>/<image>``.

    item i -> (transform(file bytes, file name), class index), the default transform decoding to
    uint8 [3, H, W]; `read(i)` gives the bytes undecoded, which imagenet.py's batch loader decodes
    straight into its batch. Class indices come from the
    training folder when there is one, so a validation tree with a missing class keeps the same
    numbering; a validation class that training lacks is a DataError.

    Attributes: classes (names, in index order) and targets (int64 array, one class per image).
    The file names are kept as one numpy bytes array rather than 1.3 M Path objects: it is ~40 MB
    instead of ~400 MB, and forked DataLoader workers do not copy it page by page as they touch
    Python objects' reference counts.
    """

    def __init__(self, root: str | os.PathLike, split: str, transform: ImageTransform | None = None,
                 size_limit: int | None = None) -> None:
        self.size_limit = size_limit  # the largest image file read (--max-file-size)
        folder = find_split_folder(root, split)
        if folder is None:
            names = " or ".join(f"{name}/" for name in SPLIT_FOLDERS[split])
            raise DataError(f"{root}: no {names} folder of class sub-folders")
        self.root = folder
        self._root_text = str(folder)  # paths joined as text: a Path per image costs as much as a syscall
        self.transform = transform or _default_decode
        self.classes = self._class_names(Path(root), folder)
        class_index = {name: index for index, name in enumerate(self.classes)}
        relative_paths: list[bytes] = []
        targets: list[int] = []
        for name in list_classes(folder):
            if name not in class_index:
                raise DataError(f"{folder / name}: class folder not present in the training folder")
            images = list_images(folder / name)
            relative_paths.extend(os.fsencode(f"{name}/{path.name}") for path in images)
            targets.extend([class_index[name]] * len(images))
        if not relative_paths:
            raise DataError(
                f"{folder}: no image files in class sub-folders (expected {folder}/<class>/<image>; "
                "a flat folder of images must first be sorted into one folder per class)"
            )
        self._relative_paths = np.array(relative_paths, dtype=np.bytes_)
        self.targets = np.array(targets, dtype=np.int64)

    @staticmethod
    def _class_names(root: Path, folder: Path) -> list[str]:
        train_folder = find_split_folder(root, "train")
        classes = list_classes(train_folder if train_folder is not None else folder)
        if not classes:
            raise DataError(
                f"{train_folder or folder}: no class sub-folders (expected one folder of images per class; "
                "the official flat validation folder must first be sorted into class folders)"
            )
        return classes

    def __len__(self) -> int:
        return len(self.targets)

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def where(self) -> str:
        return str(self.root)

    def training_order(self, indices: np.ndarray, seed: int, epoch: int) -> np.ndarray:
        """Any order reads as cheaply as another: one file per image."""
        return shuffled(indices, seed, epoch)

    def path(self, index: int) -> Path:
        return Path(self.source(index))

    def source(self, index: int) -> str:
        """Where image `index` is, for messages (and for reading it)."""
        return os.path.join(self._root_text, os.fsdecode(self._relative_paths[index]))

    def read(self, index: int) -> tuple[bytes, int, str]:
        """(the file's encoded bytes, its class, its path for messages): what the batch loader decodes.
        UnreadableFile (a DataError) for a file that is not a regular one or is larger than the limit."""
        path = self.source(index)
        return read_bounded(path, self.size_limit), int(self.targets[index]), path

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        data, label, source = self.read(index)
        return self.transform(data, source), label
