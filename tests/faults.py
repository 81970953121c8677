"""Faults of a failing disk, injected where every write of cnns goes: `os.write`, `os.fsync` and `os.replace`,
which `cnns.safe_writes` alone calls (SQLite's I/O-error tests are the model)."""

from __future__ import annotations

import errno
import fnmatch
import os
from pathlib import Path


class DiskFault:
    """Fails the `n`-th `operation` (write, fsync or replace) on the files named like `name` (a glob; their
    temporary files too), as a full disk does: the failing write stores half its bytes first, as a disk filling
    up part-way through a write does. Every other call passes through."""

    def __init__(self, name: str, operation: str = "write", n: int = 1, error: int = errno.ENOSPC):
        self.name, self.operation, self.n, self.error = name, operation, n, error
        self.count, self.fired_on = 0, None
        self._write, self._fsync, self._replace = os.write, os.fsync, os.replace

    def install(self, monkeypatch) -> "DiskFault":
        monkeypatch.setattr(os, "write", self.write)
        monkeypatch.setattr(os, "fsync", self.fsync)
        monkeypatch.setattr(os, "replace", self.replace)
        return self

    @property
    def cause(self) -> str:
        return os.strerror(self.error)

    def write(self, fd: int, data) -> int:
        if self._fails("write", _path_of(fd)):
            half = memoryview(data).cast("B")[: len(data) // 2]
            if len(half):
                self._write(fd, half)
            raise OSError(self.error, self.cause)
        return self._write(fd, data)

    def fsync(self, fd: int) -> None:
        if self._fails("fsync", _path_of(fd)):
            raise OSError(self.error, self.cause)
        self._fsync(fd)

    def replace(self, source, destination) -> None:
        if self._fails("replace", str(destination)):
            raise OSError(self.error, self.cause)
        self._replace(source, destination)

    def _fails(self, operation: str, path: str) -> bool:
        base = os.path.basename(path)
        if (self.fired_on is not None or operation != self.operation
                or not (fnmatch.fnmatch(base, self.name) or fnmatch.fnmatch(base, f".{self.name}.*"))):
            return False
        self.count += 1
        if self.count < self.n:
            return False
        self.fired_on = Path(path)
        return True


def _path_of(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""
