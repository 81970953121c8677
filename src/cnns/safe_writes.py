"""cnns's own writes into a run folder or an output file, in one place: each completes, or the folder is as it
was. Libraries that write files of their own (TensorBoard's event files, the profiler's traces, wandb's offline
folder) write them directly, into subfolders of the run folder that nothing of cnns reads back.

A run folder holds days of training, so no write may leave half a file behind when the disk fills (ENOSPC),
the quota runs out (EDQUOT), the device fails (EIO) or the folder vanishes. Four primitives, used by every
write site of cnns:

* `write_atomically(path, content)`: bytes, text, or a callable that writes to a file object, go to a
  temporary file in the same folder, which is fsynced and renamed over `path` (then the folder is fsynced, so
  the rename is durable too). A reader sees the old file or the new one, never a part.
* `write_atomically_by_name(path, produce)`: the same for libraries that write only to a file name they are
  given (ONNX, AOTInductor packages).
* `write_once(path, content)`: a missing file whose bytes are fixed, which several commands may write at once
  (the built-in dataset): linked into place from a temporary file, never replacing what another put there first.
* `append(path, data)`: one row or line added at the end; a failed append truncates the file back to its size
  before (or removes it if the append created it), so no row is ever cut short.

What a command may touch, enforced here for every write (`command_scope`, which `cnns.cli.run_script` enters
for every command): a write may create any file, but it replaces, truncates or appends to an existing file only
when this invocation created it, when it lies in a run folder the command owns (`own_run_folder`: train.py's new
folder, the folder restore.py, validation.py and weight_avg.py continue, each under its lock), or when it is an
output the user named (`check_output`: an output never replaces a file the command reads, and replaces any other
existing file only with `--overwrite`), or a file the command exists to refresh (`refreshes`: a run's plot).
Inside an owned folder no write goes through a symbolic link the command did not make, at any level below the
folder. Anything else is a ConfigError of one line, before a byte is written.

A failure is a `WriteError`: one line, ``cannot write <file>: <cause>``, which the command line turns into
``error: ...`` and exit 2. A library that turns the OSError into an exception of its own (torch.save raises
``RuntimeError: [enforce fail at inline_container.cc:...]`` when a write inside it fails) is seen through: the
OSError it was handling names the cause.

Every byte cnns writes itself goes through `os.write` (a library writing to a file name writes its own), and the
tests inject their faults there and at `os.fsync` and `os.replace` (tests/faults.py).
"""

from __future__ import annotations

import errno
import io
import os
import secrets
from contextlib import contextmanager
from fnmatch import fnmatch
from pathlib import Path
from typing import BinaryIO, Callable, Iterable, Iterator, Union

from cnns.errors import ConfigError, WriteError

Content = Union[bytes, str, Callable[[BinaryIO], None]]


def utf8(text: str) -> bytes:
    """Text as a run's files hold it, UTF-8. A path of bytes that are not UTF-8 (a folder named in Latin-1) is text
    with lone surrogates in Python, which UTF-8 cannot encode: they are written as escapes ("\\udcff"), so the file
    stays UTF-8 that every reader of a run takes."""
    return text.encode("utf-8", "backslashreplace")


def write_atomically(path: str | Path, content: Content) -> None:
    """`content` (bytes, text as UTF-8, or a callable writing to the file object it is given) as the whole
    of `path`, replacing it only once every byte is on the disk."""
    write_atomically_by_name(path, lambda temporary: _write_new_file(temporary, content))


def _write_new_file(path: Path, content: Content) -> None:
    """`content` as the new file `path` (refused if anything is there), through `os.write`."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as to any file
    with _Destination(fd) as destination:
        if callable(content):
            content(destination)
        else:
            destination.write(utf8(content) if isinstance(content, str) else content)


def write_atomically_by_name(path: str | Path, produce: Callable[[Path], None], suffix: str = ".tmp") -> None:
    """`produce(temporary)` writes the file under a temporary name in `path`'s folder (ending in `suffix`, for
    libraries that choose the format by it), which then replaces `path`."""
    path = Path(path)
    may_write(path)
    existed = os.path.lexists(path)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}{suffix}")
    try:
        produce(temporary)
        _fsync_file(temporary)
        os.replace(temporary, path)  # replaces a link at `path` itself, never what it points to
        if not existed:
            _scope.created.add(_key(path))
    except BaseException as exc:
        _remove(temporary)
        cause = disk_failure(exc)
        if cause is None:
            raise
        raise WriteError(path, cause) from None
    _fsync_folder(path.parent)


def write_once(path: str | Path, content: bytes) -> bool:
    """`content` as the missing file `path`, for files whose bytes are fixed (the built-in dataset, generated the
    same everywhere) that several commands may write at once: written under a temporary name, then linked into
    place, which fails if a file (or a link) is there by then. So a reader never sees part of it, nothing existing
    is replaced or written through, and the first writer's file stays. Returns whether this call wrote it."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        _write_new_file(temporary, content)
        _fsync_file(temporary)
        if not _link_unless_present(temporary, path):
            return False
        _scope.created.add(_key(path))
    except BaseException as exc:
        cause = disk_failure(exc)
        if cause is None:
            raise
        raise WriteError(path, cause) from None
    finally:
        _remove(temporary)
    _fsync_folder(path.parent)
    return True


def _link_unless_present(temporary: Path, path: Path) -> bool:
    """`temporary` linked as `path` unless something is there already (False then)."""
    try:
        os.link(temporary, path)
        return True
    except FileExistsError:
        return False
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK):
            raise
    # A file system without hard links: a rename, which another writer of the same bytes may just precede
    if os.path.lexists(path):
        return False
    os.replace(temporary, path)
    return True


def append(path: str | Path, data: bytes | str) -> None:
    """`data` added at the end of `path` (created if missing); on failure the file is as it was.

    Not fsynced: a full disk or a quota fails the write itself, and an fsync a line (milliseconds on a real
    disk) would slow every printed step. A process that dies loses nothing appended (the kernel holds it);
    only a power cut can lose the last lines not yet on the disk, never a whole file or a checkpoint."""
    path = Path(path)
    data = utf8(data) if isinstance(data, str) else data
    may_write(path)
    try:
        fd, created = _open_for_append(path)
    except OSError as exc:
        raise WriteError(path, exc) from None
    if created:
        _scope.created.add(_key(path))
    size = None  # known once fstat answered: nothing to undo before
    try:
        size = os.fstat(fd).st_size
        _write_all(fd, data)
    except BaseException as exc:
        # A row cut short would be read as a row: take the part that was written back out (after a failed write,
        # or a signal that ended the command in the middle of it).
        if size is not None:
            _undo_append(path, fd, created, size)
        if isinstance(exc, OSError):
            raise WriteError(path, exc) from None
        raise
    finally:
        os.close(fd)


def size_before(path: str | Path) -> int | None:
    """The size of `path` now, None when it does not exist: what `restore_size` puts back."""
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return None


def restore_size(path: str | Path, size: int | None) -> None:
    """Undo appends to `path` since `size_before` gave `size` (None: remove the file). Truncation needs no
    space, so it works on a full disk; a failure here leaves the file as it is (a row at worst kept twice)."""
    try:
        if size is None:
            os.unlink(path)
        else:
            os.truncate(path, size)
    except OSError:
        pass


def disk_failure(exc: BaseException) -> OSError | None:
    """The OSError behind `exc`: itself, or the one it was raised while handling (torch.save wraps the
    OSError of a failed write into a RuntimeError of its own). None for anything else (a bug, an interrupt)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, OSError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


class _Destination(io.RawIOBase):
    """A temporary file's descriptor as a binary file object whose every write goes through `_write_all`.

    It offers no fileno(), so libraries (PIL) write through write() rather than to the descriptor itself."""

    def __init__(self, fd: int):
        super().__init__()
        self._fd = fd

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        _write_all(self._fd, view)
        return len(view)

    def close(self) -> None:
        if not self.closed:
            try:
                os.close(self._fd)
            finally:
                super().close()


def _write_all(fd: int, data) -> None:
    """os.write until every byte is written: a short write (a disk filling up) is followed by the write
    that reports why."""
    view = memoryview(data).cast("B")
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _open_for_append(path: Path) -> tuple[int, bool]:
    """(descriptor, whether this call created the file). O_NOFOLLOW: a link at `path` is an error (ELOOP), never a
    way to append to the file it points to; O_EXCL creates no file through one either."""
    nofollow = getattr(os, "O_NOFOLLOW", 0)
    try:
        return os.open(path, os.O_WRONLY | os.O_APPEND | nofollow), False
    except FileNotFoundError:
        return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL | nofollow, 0o666), True


def _undo_append(path: Path, fd: int, created: bool, size: int) -> None:
    try:
        if created:
            os.unlink(path)
        else:
            os.ftruncate(fd, size)
    except OSError:
        pass


def _fsync_file(path: Path) -> None:
    """The file's bytes on the disk before it takes the final name (a crash then leaves the old file, never
    an empty new one). A folder (a library may write one) needs no flushing of its own here."""
    if path.is_dir():
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_folder(folder: Path) -> None:
    """Make the rename itself durable (POSIX); a no-op where folders cannot be opened or synced."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _remove(temporary: Path) -> None:
    try:
        temporary.unlink()
    except FileNotFoundError:
        pass
    except IsADirectoryError:
        import shutil

        shutil.rmtree(temporary, ignore_errors=True)
    except OSError:
        pass


def check_output(path: str | Path, reads: Iterable[str | Path], overwrite: bool, option: str = "--out") -> None:
    """An output never replaces a file the command reads, and replaces any other existing file only when the
    user asked for it (`--overwrite`): a ConfigError of one line, before anything is written."""
    path = Path(path)
    for source in reads:
        if _same_file(path, Path(source)):
            raise ConfigError(f"{option} {path} is {source}, which this command reads: choose another file")
    if (path.exists() or path.is_symlink()) and not overwrite:
        raise ConfigError(f"{option} {path} exists: give --overwrite to replace it")
    _scope.outputs.add(_key(path))


def refreshes(path: str | Path, reads: Iterable[str | Path], option: str = "--out") -> None:
    """`path` is a file this command exists to make again whenever it runs (a run's training.png for `cnns plot`,
    as its help says): it may replace it without --overwrite, though never a file the command reads."""
    check_output(path, reads, overwrite=True, option=option)


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (or cannot be looked at): not the same file
        return False


# ----------------------------------------------------------------------------------------------
# What a command may touch (the module docstring's rule)


class _Scope:
    """One command's claims: the files it created, the run folders it owns, the outputs the user named."""

    def __init__(self, active: bool):
        self.active = active
        self.created: set[str] = set()
        self.owned: list[str] = []
        self.outputs: set[str] = set()


_scope = _Scope(active=False)  # outside a command (a library call, a test of a primitive) nothing is refused


@contextmanager
def command_scope() -> Iterator[None]:
    """The span of one command: every write in it follows the rule of what a command may touch."""
    global _scope
    previous, _scope = _scope, _Scope(active=True)
    try:
        yield
    finally:
        _scope = previous


_run_file_patterns: tuple[str, ...] = ()  # what a run writes in its folder: cnns.runfolder.log declares it


def declare_run_files(patterns: Iterable[str]) -> None:
    """The names (fnmatch patterns) of the files and folders a run writes in its folder (`cnns.runfolder.log`, which owns
    the layout): `own_run_folder` refuses a link planted under any of them before the command writes anything."""
    global _run_file_patterns
    _run_file_patterns = tuple(dict.fromkeys((*_run_file_patterns, *patterns)))


def own_run_folder(folder: str | Path) -> None:
    """The command owns `folder` (a run folder it made or continues, under its lock) from now on: it may replace and
    append to the files in it, though never through a symbolic link below it. A link in place of a file the run
    writes is refused here, before the command writes anything (the lock file included)."""
    folder = Path(folder)
    try:
        links = sorted(entry.name for entry in folder.iterdir() if entry.is_symlink() and
                       any(fnmatch(entry.name, pattern) for pattern in (*_run_file_patterns, ".lock")))
    except OSError:  # missing or unreadable: the command's own checks and writes say so
        links = []
    if links:
        raise ConfigError(f"{folder / links[0]} is a symbolic link in the run folder {folder}: cnns writes a run's "
                          "files only where the run made them; remove the link")
    _scope.owned.append(os.path.abspath(folder))


def may_write(path: str | Path) -> None:
    """ConfigError of one line unless this command may write `path` (module docstring); nothing is written."""
    if not _scope.active:
        return
    key = _key(Path(path))
    folder = next((f for f in _scope.owned if key.startswith(f.rstrip(os.sep) + os.sep)), None)
    if folder is not None:
        _refuse_links_below(Path(folder), Path(key))
        return
    if key in _scope.created or key in _scope.outputs or not os.path.lexists(key):
        return
    raise ConfigError(f"{path} exists and this command did not make it: it is left as it is (choose another path, "
                      "or remove it first)")


def _refuse_links_below(folder: Path, path: Path) -> None:
    """A symbolic link at or above `path` inside the owned `folder` (a file, or a sub-folder such as tensorboard/ or
    instance_1/) is refused: a write there would land wherever the link points."""
    current = folder
    for part in path.relative_to(folder).parts:
        current = current / part
        if current.is_symlink():
            raise ConfigError(f"{current} is a symbolic link in the run folder {folder}: cnns writes a run's files "
                              "only where the run made them; remove the link")


def _key(path: Path) -> str:
    """The path as the rule compares it: absolute, with no link resolved (a link is a file of its own here)."""
    return os.path.abspath(path)
