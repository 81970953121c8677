"""Opening a data file without trusting it: the one rule every reader of images, TFRecords and CIFAR files follows.

A path named on a command line or found in a data folder may be anything: a symlink to /dev/zero (read for ever,
until the kernel kills the process), a FIFO (open() waits for a writer that never comes), a directory named
x.jpg, a sparse 20 GB file (one read() of it is a MemoryError). So a data file is

* looked at with stat() first, and refused unless it is a regular file: nothing else is ever opened;
* opened with O_NONBLOCK, and checked again on the open descriptor (fstat), so a file swapped for a FIFO between
  the stat and the open can neither block the open nor be read;
* refused when it is larger than the limit (`--max-file-size`, DEFAULT_FILE_SIZE_LIMIT), before a byte is read;
* read for the size it has (plus one byte, to see it grew), and no further than the limit plus one byte, so a file
  that grows after the stat is still bounded and a small file reserves no more memory than it holds.

Each refusal is an `UnreadableFile` (a DataError): one line naming the file and the reason.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO

from cnns.errors import DataError

# Far above any real photograph (the decoders' pixel limit, 13400 x 13400, is 537 MB even as uncompressed RGB)
# and above every CIFAR file (CIFAR-100's train.bin is 154 MB); far below what would exhaust a machine's memory.
DEFAULT_FILE_SIZE_LIMIT = 1 << 30
FILE_SIZE_OPTION = "--max-file-size"

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


class UnreadableFile(DataError):
    """A data file that is not read: not a regular file, larger than the limit, or refused by the system."""

    def __init__(self, path: str | os.PathLike, reason: str) -> None:
        self.path = str(path)
        self.reason = reason
        super().__init__(f"{path}: cannot read: {reason}")


def file_size_limit(limit: int | None) -> int:
    """The limit in bytes: `limit` as --max-file-size gave it, or the default where it was not given (None)."""
    return DEFAULT_FILE_SIZE_LIMIT if limit is None else limit


def describe_size(size: int) -> str:
    """Bytes in the 1024-based units `--max-file-size` takes: "20 GiB", "1.5 MiB", "900 bytes"."""
    value = float(size)
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.3g} {unit}" if unit != "bytes" else f"{size} bytes"
        value /= 1024
    return f"{value:.3g} TiB"


def _not_regular(path: str | os.PathLike, mode: int) -> str | None:
    """Why a file of this mode is not read (what it is, and where a symlink leads), or None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    kind = next((name for test, name in _KINDS if test(mode)), "not a file")
    target = os.path.realpath(path)
    where = f" ({target})" if target != os.path.abspath(path) else ""
    return f"not a regular file but {kind}{where}"


def check_regular_file(path: str | os.PathLike, limit: int | None = None) -> int:
    """The size of the regular file at `path` (symlinks followed), found without opening it; UnreadableFile when it
    is missing, something other than a regular file, or larger than `limit` (file_size_limit)."""
    try:
        status = os.stat(path)
    except OSError as error:
        raise UnreadableFile(path, error.strerror or str(error)) from None
    _check_status(path, status, limit)
    return status.st_size


def _check_status(path: str | os.PathLike, status: os.stat_result, limit: int | None) -> None:
    reason = _not_regular(path, status.st_mode)
    limit = file_size_limit(limit)
    if reason is None and status.st_size > limit:
        reason = _too_large(status.st_size, limit)
    if reason is not None:
        raise UnreadableFile(path, reason)


def _too_large(size: int, limit: int) -> str:
    shown = (describe_size(size), describe_size(limit))
    if shown[0] == shown[1]:  # rounded alike: in bytes, so that the message does not say 3.1 KiB > 3.1 KiB
        shown = (f"{size} bytes", f"{limit} bytes")
    return (f"{shown[0]}, more than the {shown[1]} {FILE_SIZE_OPTION} allows (a corrupt or foreign file, or give a "
            f"larger {FILE_SIZE_OPTION})")


def open_regular_file(path: str | os.PathLike, limit: int | None = None) -> BinaryIO:
    """`path` opened for binary reading, once it is known to be a regular file no larger than `limit`
    (check_regular_file, then again on the open descriptor); UnreadableFile otherwise."""
    descriptor, _ = _open_checked(path, limit)
    try:
        return os.fdopen(descriptor, "rb")
    except BaseException:
        os.close(descriptor)
        raise


def read_bounded(path: str | os.PathLike, limit: int | None = None) -> bytes:
    """The whole of a regular file no larger than `limit` bytes (file_size_limit; module docstring); UnreadableFile
    otherwise.

    On the descriptor itself (os.read), not through a Python file object: a worker reads every image this way, and
    the file object's own system calls (another fstat, an isatty ioctl, a seek) cost as much as reading a photo
    from the page cache."""
    limit = file_size_limit(limit)
    descriptor, status = _open_checked(path, limit)
    try:
        # What the file holds now, plus one byte that shows whether it grew since: the stat's size is not trusted,
        # but asking for the whole limit would make Python reserve the limit (1 GiB by default) for every small
        # image, and fail outright under an address-space limit below it.
        expected = status.st_size
        parts = _read_up_to(descriptor, min(expected, limit) + 1)
        got = sum(map(len, parts))
        if expected < got <= limit:  # it grew: read on, a chunk at a time, still no further than the limit
            parts += _read_up_to(descriptor, limit + 1 - got, chunk=_GROWN_CHUNK)
    except OSError as error:
        raise UnreadableFile(path, error.strerror or str(error)) from None
    finally:
        os.close(descriptor)
    data = parts[0] if len(parts) == 1 else b"".join(parts)
    if len(data) > limit:
        raise UnreadableFile(path, f"more than the {describe_size(limit)} {FILE_SIZE_OPTION} allows (it grew while it "
                                   "was read)")
    return data


_GROWN_CHUNK = 1 << 20  # a file that grows while it is read is read on in pieces this size, never the limit at once


def _open_checked(path: str | os.PathLike, limit: int | None) -> tuple[int, os.stat_result]:
    """(a descriptor for reading `path`, its status), once the path and then the open file itself are known to be
    a regular file no larger than `limit` (the second look catches a file replaced since the first)."""
    check_regular_file(path, limit)
    descriptor = _open_without_waiting(path)
    try:
        status = os.fstat(descriptor)
        _check_status(path, status, limit)
        return descriptor, status
    except OSError as error:
        os.close(descriptor)
        raise UnreadableFile(path, error.strerror or str(error)) from None
    except BaseException:
        os.close(descriptor)
        raise


def _open_without_waiting(path: str | os.PathLike) -> int:
    """A descriptor for reading `path`; O_NONBLOCK so that a file replaced by a FIFO since the stat cannot make the
    open wait for a writer (the fstat that follows refuses it). It changes nothing for a regular file."""
    try:
        return os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as error:
        raise UnreadableFile(path, error.strerror or str(error)) from None


def _read_up_to(descriptor: int, size: int, chunk: int | None = None) -> list[bytes]:
    """Up to `size` bytes from the descriptor, in the pieces os.read gave (fewer only at the end of the file)."""
    parts: list[bytes] = []
    while size > 0:
        part = os.read(descriptor, size if chunk is None else min(size, chunk))
        if not part:
            break
        parts.append(part)
        size -= len(part)
    return parts or [b""]


__all__ = ["DEFAULT_FILE_SIZE_LIMIT", "FILE_SIZE_OPTION", "UnreadableFile", "check_regular_file", "describe_size",
           "file_size_limit", "open_regular_file", "read_bounded"]
