"""ImageNet as WebDataset tar shards: ``<prefix>-train-NNNN.tar`` and ``<prefix>-validation-NNNN.tar`` (any prefix,
or none), the layout of Hugging Face's ``timm/imagenet-1k-wds``. A sample is the run of consecutive members that
share a key (the member's name up to the first dot of its base name, webdataset's rule): ``KEY.jpg`` (or .jpeg,
.png, .webp) with the encoded image and ``KEY.cls`` with its 0-based class in ASCII digits; other members
(``KEY.json``, ...) are ignored.

Read with the standard library's `tarfile`, by offsets, not with the `webdataset` library: its pipeline decodes
in its own stages and orders samples by worker, where the loader (`cnns.data.image_loader`) needs each image's bytes
for the native region decoder and an order that is a function of (seed, epoch) alone, so that a restore
continues at the same sample and R replicas with accumulation A see what one process with R x A sees
(`cnns.data.batches.ShardPlan`). So the shards are indexed once, tar headers and the tiny label members only
(`index_shard`), and each image is read at its offset.

The training order is WebDataset's own, made from the index: the shards in an order drawn from (seed, epoch), each
read through in its stored order, through a shuffle buffer of SHUFFLE_BUFFER samples drawn from the same stream
(`training_order`). The replicas and the DataLoader's workers then deal that order out (ShardPlan, a worker per
batch), so no sample is read twice and every one is read in each epoch (but for the last part-global-batch that
every training source leaves out), and the reads of a stretch of batches fall in the few shards the buffer spans
instead of anywhere in the dataset (TFRecords' uniform shuffle). Evaluation reads the shards in order.
"""

from __future__ import annotations

import io
import multiprocessing
import os
import re
import stat
import tarfile
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Iterable

import numpy as np

from cnns.bounded_reads import FILE_SIZE_OPTION, UnreadableFile, describe_size, file_size_limit, open_regular_file
from cnns.data.formats.base import TrainingBatch
from cnns.data.formats.imagenet import ImageNetFiles
from cnns.errors import DataError

SHARD_NAME = re.compile(r"(?:.*-)?(train|validation)-(\d+)\.tar")
# webdataset's base_plus_ext: the key is the path up to the first dot of the base name.
MEMBER_NAME = re.compile(r"((?:.*/)?[^./]+)\.([^/]*)")
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")  # lower-cased; JPEG goes to the native region decoder
LABEL_EXTENSION = "cls"
LABEL_BYTES = 32  # a class number in ASCII digits is a few bytes; a larger .cls member is not one
# Samples held by the training shuffle buffer: webdataset's default sample shuffle (5,000); about four of
# timm/imagenet-1k-wds's shards of ~1,250 samples, so a stretch of batches reads from about five shards.
SHUFFLE_BUFFER = 5000
SHARD_SIZE_UNLIMITED = 1 << 62  # a shard is never read whole: each image is bounded by --max-file-size instead
INDEX_THREADS = 16  # a few shards: their header reads overlapped
INDEX_PROCESSES_FROM = 32  # shards; from there they are indexed by processes (`_index_each`)
INDEX_PROCESSES = 16


def find_shards(folder: Path, split: str) -> list[Path]:
    """The split's shards in `folder`, in shard-number order (then by name); DataError when there are none."""
    found = [(int(match.group(2)), path.name, path) for path in _listing(folder)
             if (match := SHARD_NAME.fullmatch(path.name)) and match.group(1) == split]
    if not found:
        raise DataError(f"{folder}: no WebDataset {split} shards (*-{split}-NNNN.tar)")
    return [path for *_, path in sorted(found)]


def _listing(folder: Path) -> list[Path]:
    try:
        return list(folder.iterdir())
    except OSError:
        return []


# --- The index: tar headers and label members only


@dataclass(frozen=True)
class ShardIndex:
    """One shard's samples in stored order: where each image's bytes are, its class and its member's name."""

    offsets: np.ndarray  # int64, the image member's data
    sizes: np.ndarray  # int64
    labels: np.ndarray  # int64, 0-based
    names: np.ndarray  # bytes, the image member's name (for messages)


def index_shard(path: Path | str, num_classes: int) -> ShardIndex:
    """Every sample of the shard, from its tar headers and label members; DataError naming the shard and the
    member for a damaged or cut-short tar, an image without its label (or a label without its image), and a
    label that is not a class number in 0..num_classes - 1."""
    samples: list[tuple[int, int, int, bytes]] = []
    with open_regular_file(path, SHARD_SIZE_UNLIMITED) as file:
        file_size = os.fstat(file.fileno()).st_size
        if hasattr(os, "posix_fadvise"):
            # Headers are an image apart: read-ahead would pull in every image for nothing.
            os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
        for key, members in _samples(str(path), file, file_size):
            samples.append(_sample(str(path), file, key, members, num_classes))
    offsets, sizes, labels, names = zip(*samples) if samples else ((), (), (), ())
    return ShardIndex(np.array(offsets, dtype=np.int64), np.array(sizes, dtype=np.int64),
                      np.array(labels, dtype=np.int64), np.array(names, dtype=np.bytes_))


def index_split(shards: list[Path], num_classes: int) -> tuple[np.ndarray, ShardIndex]:
    """The samples of all `shards`, in shard order, with `shard_ids` beside them."""
    identities = []
    for path in shards:
        try:
            status = os.stat(path)
        except OSError:
            status = None
        if status is None or not stat.S_ISREG(status.st_mode):
            open_regular_file(path, SHARD_SIZE_UNLIMITED).close()  # the one line naming what it is instead
        identities.append((str(path), status.st_size, status.st_mtime_ns))
    return _cached_split(tuple(identities), num_classes)


@lru_cache(maxsize=2)  # a run's two splits: the checks before the run and the loader index each once
def _cached_split(identities: tuple[tuple[str, int, int], ...], num_classes: int) -> tuple[np.ndarray, ShardIndex]:
    """(each sample's shard number, the samples), keyed by every shard's path, size and time: a shard rewritten
    since is indexed again."""
    indexes = _index_each([path for path, *_ in identities], num_classes)
    shard_ids = np.repeat(np.arange(len(indexes), dtype=np.int32), [len(index.offsets) for index in indexes])
    return shard_ids, ShardIndex(*(np.concatenate([getattr(index, field) for index in indexes])
                                   for field in ("offsets", "sizes", "labels", "names")))


def _index_each(paths: list[str], num_classes: int) -> list[ShardIndex]:
    """Indexing costs one core about 45 us per sample in tarfile's header parsing (about a minute for ImageNet's
    1.28 M samples from the page cache), so a large set is indexed by processes, one per core (threads would
    take turns at the interpreter; they serve a few shards, overlapping their reads)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if len(paths) < INDEX_PROCESSES_FROM or cores < 2:
        with ThreadPoolExecutor(max_workers=min(INDEX_THREADS, len(paths))) as pool:
            return list(pool.map(lambda path: index_shard(path, num_classes), paths))
    # forkserver: this process may hold threads (torch's) that a forked child would inherit mid-lock.
    context = multiprocessing.get_context("forkserver")
    with ProcessPoolExecutor(max_workers=min(cores, INDEX_PROCESSES), mp_context=context) as pool:
        found = list(pool.map(_index_or_error, paths, [num_classes] * len(paths), chunksize=4))
    first_error = next((item for item in found if isinstance(item, str)), None)
    if first_error is not None:
        raise DataError(first_error)
    return found


def _index_or_error(path: str, num_classes: int) -> ShardIndex | str:
    """In an indexing process: the index, or the error's one line (an exception crossing back would be rebuilt
    from its arguments, which not every DataError's are)."""
    try:
        return index_shard(path, num_classes)
    except DataError as error:
        return str(error)


def _samples(path: str, file: io.BufferedReader, file_size: int) -> Iterable[tuple[str, dict[str, tarfile.TarInfo]]]:
    """(key, {extension: member}) of each run of consecutive regular members sharing a key."""
    key, members, last = None, {}, None
    try:
        tar = tarfile.open(fileobj=file, mode="r:")
        while (member := tar.next()) is not None:
            tar.members.clear()  # tarfile keeps every member it has read: the index needs none of them
            last = member.name
            if member.offset_data + member.size > file_size:  # tarfile would take the cut for the end
                raise DataError(f"{path}: cut short: member {member.name} runs past the end of the "
                                f"{file_size}-byte file")
            match = MEMBER_NAME.fullmatch(member.name)
            if not member.isfile() or match is None:
                continue
            if match.group(1) != key:
                if key is not None:
                    yield key, members
                key, members = match.group(1), {}
            members[match.group(2).lower()] = member
        _check_end(path, file, tar.offset, file_size, last)
    except tarfile.TarError as error:
        where = f"after member {last}" if last is not None else "at its start"
        raise DataError(f"{path}: not a readable tar file ({error}) {where}") from None
    if key is not None:
        yield key, members


def _check_end(path: str, file: io.BufferedReader, offset: int, file_size: int, last: str | None) -> None:
    """tarfile ends its reading quietly at a damaged header or a cut after a member's data, as at the end of the
    archive: so the archive's end-of-archive block (zeros) must be where it stopped, or every sample after it
    would be lost without a word."""
    block = os.pread(file.fileno(), tarfile.BLOCKSIZE, offset)
    if len(block) == tarfile.BLOCKSIZE and not any(block):
        return
    after = f"after member {last}" if last is not None else "at its start"
    if len(block) == 0:
        raise DataError(f"{path}: cut short {after} (no end-of-archive block)")
    raise DataError(f"{path}: not a readable tar file (a damaged header at byte offset {offset}) {after}")


def _sample(path: str, file: io.BufferedReader, key: str, members: dict[str, tarfile.TarInfo],
            num_classes: int) -> tuple[int, int, int, bytes]:
    image = next((members[ext] for ext in IMAGE_EXTENSIONS if ext in members), None)
    label = members.get(LABEL_EXTENSION)
    if image is None:
        present = ", ".join(member.name for member in members.values())
        raise DataError(f"{path}: sample {key} has no image ({key}.jpg): only {present}")
    if label is None:
        raise DataError(f"{path}: member {image.name} has no label ({key}.{LABEL_EXTENSION})")
    text = os.pread(file.fileno(), min(label.size, LABEL_BYTES + 1), label.offset_data)
    try:
        if label.size > LABEL_BYTES:
            raise ValueError
        value = int(text.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        raise DataError(f"{path}: member {label.name} is not a class number: {text[:LABEL_BYTES]!r}") from None
    if not 0 <= value < num_classes:
        raise DataError(f"{path}: member {label.name} holds class {value}, outside 0..{num_classes - 1}")
    return image.offset_data, image.size, value, os.fsencode(image.name)


# --- The reader the loader is handed


class ShardRecords:
    """One split's samples over all its shards, in shard order: the loader's reader (`cnns.data.image_loader`'s
    ImageRecords). Holds the index, not open files, so it crosses to DataLoader workers as it is."""

    def __init__(self, folder: Path, split: str, num_classes: int, size_limit: int | None = None) -> None:
        self.shards = find_shards(folder, split)
        self.num_classes = num_classes
        self.where = str(folder)
        self.size_limit = size_limit  # the largest image read (--max-file-size)
        self.shard_ids, index = index_split(self.shards, num_classes)
        self.offsets, self.sizes, self.names = index.offsets, index.sizes, index.names
        # Not `targets`: the shards mix the classes, so --dataset-percentage-to-use takes the first samples.
        self.labels = index.labels

    def __len__(self) -> int:
        return len(self.offsets)

    def source(self, index: int) -> str:
        return f"{self.shards[self.shard_ids[index]]}: member {os.fsdecode(self.names[index])}"

    def read(self, index: int) -> tuple[bytes, int, str]:
        source, size, limit = self.source(index), int(self.sizes[index]), file_size_limit(self.size_limit)
        if size > limit:
            raise UnreadableFile(source, f"an image of {describe_size(size)}, more than the {describe_size(limit)} "
                                         f"{FILE_SIZE_OPTION} allows (corrupt, or give a larger {FILE_SIZE_OPTION})")
        with open_regular_file(self.shards[self.shard_ids[index]], SHARD_SIZE_UNLIMITED) as file:
            data = os.pread(file.fileno(), size, int(self.offsets[index]))
        if len(data) < size:
            raise DataError(f"{source}: cut short (the shard changed since it was indexed)")
        return data, int(self.labels[index]), source

    def training_order(self, indices: np.ndarray, seed: int, epoch: int) -> np.ndarray:
        """WebDataset's order, drawn from (seed, epoch): the shards shuffled, each read in stored order, through
        a shuffle buffer of SHUFFLE_BUFFER samples."""
        from cnns.data.batches import mix_seed

        rng = np.random.Generator(np.random.PCG64(mix_seed(seed, epoch)))
        place = np.empty(len(self.shards), dtype=np.int64)
        place[rng.permutation(len(self.shards))] = np.arange(len(self.shards))
        stream = indices[np.argsort(place[self.shard_ids[indices]], kind="stable")]
        return buffer_shuffle(stream, SHUFFLE_BUFFER, rng)


def buffer_shuffle(stream: np.ndarray, size: int, rng: np.random.Generator) -> np.ndarray:
    """A shuffle buffer over `stream`: the first `size` fill it; then each next one takes the place of a sample
    drawn from it, which comes out; the rest come out in a random order at the end."""
    if len(stream) <= size:
        return stream[rng.permutation(len(stream))]
    buffer = stream[:size].tolist()
    out = np.empty_like(stream)
    for position, (incoming, slot) in enumerate(zip(stream[size:].tolist(),
                                                    rng.integers(0, size, len(stream) - size).tolist())):
        out[position] = buffer[slot]
        buffer[slot] = incoming
    out[len(stream) - size:] = np.asarray(buffer, dtype=stream.dtype)[rng.permutation(size)]
    return out


# --- The format


class WebDatasetShards(ImageNetFiles):
    name = "webdataset"
    reads = "the tar member's image bytes"
    files = "WebDataset shards (*-train-NNNN.tar)"

    def recognise(self, folder: Path) -> bool:
        return any(SHARD_NAME.fullmatch(path.name) for path in _listing(folder))

    def records(self, folder: Path, split: str, size_limit: int | None = None) -> ShardRecords:
        return ShardRecords(folder, split, self.classes(folder), size_limit)

    def check(self, folder: Path, splits: list[str], batch: TrainingBatch, *, decode: bool,
              size_limit: int | None) -> None:
        """Every shard of each split indexed (its headers and labels: what the loader indexes anyway, cached),
        the training split holding `batch`, and with `decode` the first image decoded."""
        for split in splits:
            records = self.records(folder, split, size_limit)
            if len(records) == 0:
                raise DataError(f"{folder}: every {split} shard is empty ({len(records.shards)} of them: "
                                f"{records.shards[0].name} ...)")
            if split == "train":
                batch.check_fits(batch.kept(len(records)), len(records), folder)
            if decode:
                data, _, source = records.read(0)
                self.check_first_image(data, source)


WEBDATASET = WebDatasetShards()


def write_shard(path: str | os.PathLike, samples: Iterable[tuple[str, bytes, int]]) -> int:
    """A shard of (key, JPEG bytes, 0-based class) samples as KEY.jpg + KEY.cls, written whole or not at all;
    its size. What `--make-jpeg-tree --layout webdataset` writes (tests make theirs with GNU tar)."""
    from cnns.safe_writes import write_atomically

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for key, image, label in samples:
            for name, data in ((f"{key}.jpg", image), (f"{key}.cls", str(label).encode())):
                member = tarfile.TarInfo(name)
                member.size = len(data)
                tar.addfile(member, io.BytesIO(data))
    write_atomically(path, buffer.getvalue())
    return buffer.tell()
