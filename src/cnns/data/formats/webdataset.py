"""Image classification data as WebDataset tar shards, as the `webdataset` library's ShardWriter writes them and as
Hugging Face's ``timm/imagenet-1k-wds`` names them. A sample is the run of consecutive members that share a key (the
member's name up to the first dot of its base name, webdataset's rule): ``KEY.jpg`` (or .jpeg, .png, .webp) with the
encoded image and its 0-based class in the first of ``KEY.cls``, ``KEY.json`` (its ``label`` key, or the key the
set's ``_info.json`` names as its split's ``alt_label``, timm's declaration), ``KEY.txt``, ``KEY.idx``; other members
are ignored, and a member name given twice in one sample is refused (as the webdataset library does).

The shards are found by the usual conventions (`shard_set`): ``--data-dir`` a folder of shards (its ``train/``,
``val/``, ``validation/`` folders, or a split word in each shard's name: ``x-train-0000.tar``, ``x-val-0000.tar``),
a single shard file, a glob (``'shards/*.tar'``), a brace pattern (``'x-train-{0000..0146}.tar'``) or a list joined
by ``::`` (webdataset's own spelling, expanded by its `expand_urls`). A set whose names carry no split word is read
as whichever split a command asks for. The classes are those the labels hold (the largest + 1).

Read with the standard library's `tarfile`, by offsets, not with the `webdataset` library's pipeline: that decodes
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

import glob
import io
import json
import multiprocessing
import os
import re
import stat
import tarfile
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Iterable

import numpy as np

from cnns.bounded_reads import FILE_SIZE_OPTION, UnreadableFile, describe_size, file_size_limit, open_regular_file
from cnns.data.formats.base import TrainingBatch
from cnns.data.formats.imagenet import ImageNetFiles
from cnns.errors import DataError

SPLITS = ("train", "validation")
# A split word in a shard's name (a token between -, _ or .) or a split folder's name: webdataset's own ImageNet
# example writes imagenet-val-000000.tar, timm's sets imagenet1k-validation-0000.tar.
SPLIT_WORDS = {"train": "train", "training": "train", "val": "validation", "valid": "validation",
               "validation": "validation"}
SHARD_SUFFIX = ".tar"  # uncompressed: each image is read at its offset
TIMM_SHARD_NAME = re.compile(r"(?:.*-)?(train|validation)-(\d+)\.tar")  # timm/imagenet-1k-wds's names
INFO_FILES = ("_info.json", "info.json")  # where timm's wds reader looks for a set's splits
INFO_BYTES = 16 << 20
# webdataset's base_plus_ext: the key is the path up to the first dot of the base name.
MEMBER_NAME = re.compile(r"((?:.*/)?[^./]+)\.([^/]*)")
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")  # lower-cased; JPEG goes to the native region decoder
# Where a sample's class is, the first present: timm's .cls, a JSON sidecar's key, a text or index member.
LABEL_EXTENSIONS = ("cls", "json", "txt", "idx")
JSON_LABEL_KEY = "label"  # a set's _info.json declares another as its split's "alt_label" (timm's convention)
LABEL_BYTES = 32  # a class number in ASCII digits is a few bytes; a larger .cls/.txt/.idx member is not one
JSON_BYTES = 1 << 16
# Samples held by the training shuffle buffer: webdataset's default sample shuffle (5,000); about four of
# timm/imagenet-1k-wds's shards of ~1,250 samples, so a stretch of batches reads from about five shards.
SHUFFLE_BUFFER = 5000
SHARD_SIZE_UNLIMITED = 1 << 62  # a shard is never read whole: each image is bounded by --max-file-size instead
INDEX_THREADS = 16  # a few shards: their header reads overlapped
INDEX_PROCESSES_FROM = 32  # shards; from there they are indexed by processes (`_index_each`)
INDEX_PROCESSES = 16


# --- Finding the shards (names only)


@dataclass(frozen=True)
class ShardSet:
    """The shards `--data-dir` names, by split; an unsplit set (no split word or folder) serves both splits."""

    where: str  # --data-dir as given, for messages
    splits: dict[str, tuple[Path, ...]]
    unsplit: bool = False
    root: Path | None = None  # the folder holding the set (where its _info.json is), when there is one
    info: dict = field(default_factory=dict)  # the set's _info.json

    def shards(self, split: str) -> list[Path]:
        """The split's shards; DataError naming what was looked for when there are none."""
        found = self.splits.get(split)
        if not found:
            word = "val or validation" if split == "validation" else "train"
            raise DataError(f"{self.where}: no WebDataset {split} shards (a {word} folder of *.tar, or the "
                            f"word {word.replace(' or ', ' or -')} in the shard names: x-{split}-0000.tar)")
        return list(found)

    def label_key(self, split: str) -> str | None:
        """The JSON key the set's _info.json declares for the split's labels (timm's "alt_label"), or None."""
        entry = self.info.get("splits", {}).get(split) if isinstance(self.info.get("splits"), dict) else None
        key = entry.get("alt_label") if isinstance(entry, dict) else None
        return key if isinstance(key, str) and key else None


def natural_key(path: Path) -> list:
    """Shard numbers compared as numbers (x-9.tar before x-10.tar), then by name."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", str(path))]


def split_of(path: Path) -> str | None:
    """The split a shard belongs to: its folder's name (train/, val/, validation/), else a split word in its name."""
    if path.parent.name.lower() in ("train", "val", "validation"):
        return SPLIT_WORDS[path.parent.name.lower()]
    for token in re.split(r"[-_.]", path.name[:-len(SHARD_SUFFIX)].lower()):
        if token in SPLIT_WORDS:
            return SPLIT_WORDS[token]
    return None


def _listing(folder: Path) -> list[Path]:
    try:
        return list(folder.iterdir())
    except OSError:
        return []


def _tars(paths: Iterable[Path]) -> list[Path]:
    return [path for path in paths if path.name.endswith(SHARD_SUFFIX) and not path.name.startswith(".")]


def shard_paths(spec: str) -> tuple[list[Path], Path | None] | None:
    """(the shard files `spec` names, the folder holding them) from names only; None when `spec` names no tar file.
    A list or brace pattern keeps its given order; a folder's or a glob's shards are in shard-number order."""
    path = Path(spec)
    if path.is_dir():  # a folder is a folder, whatever its name holds ([, {, ::)
        found = _tars(_listing(path))
        for name in ("train", "val", "validation"):
            found += _tars(_listing(path / name)) if (path / name).is_dir() else []
        return (sorted(found, key=natural_key), path) if found else None
    if "::" in spec or re.search(r"\{[^}]*(\.\.|,)[^}]*\}", spec):
        from webdataset.shardlists import expand_urls  # webdataset's own expansion of "::" lists and braces

        paths = [Path(url) for url in expand_urls(spec)]
        if not paths or not all(path.name.endswith(SHARD_SUFFIX) for path in paths):
            return None
        parents = {path.parent for path in paths}
        return paths, parents.pop() if len(parents) == 1 else None
    if glob.has_magic(spec):
        paths = sorted(_tars(Path(name) for name in glob.glob(spec)), key=natural_key)
        parents = {path.parent for path in paths}
        return (paths, parents.pop() if len(parents) == 1 else None) if paths else None
    return ([path], path.parent) if path.name.endswith(SHARD_SUFFIX) else None


def shard_set(spec: str | os.PathLike) -> ShardSet | None:
    """The WebDataset shards `spec` (--data-dir) names, by split, from names only; None when it names none. Where
    some shards carry a split and others do not, those others are not the set's (a stray archive beside it)."""
    found = shard_paths(str(spec))
    if found is None:
        return None
    paths, root = found
    splits: dict[str, list[Path]] = {}
    for path in paths:
        split = split_of(path)
        if split is not None:
            splits.setdefault(split, []).append(path)
    unsplit = not splits
    if unsplit:
        splits = {split: list(paths) for split in SPLITS}
    return ShardSet(str(spec), {split: tuple(found) for split, found in splits.items()}, unsplit, root,
                    read_info(root) if root is not None else {})


def read_info(root: Path) -> dict:
    """The set's _info.json (timm's wds reader's description of its splits), {} where there is none or it is not
    a JSON object (timm's reader then falls back likewise)."""
    for name in INFO_FILES:
        try:
            with open_regular_file(root / name, INFO_BYTES) as file:
                info = json.loads(file.read(INFO_BYTES))
        except (DataError, OSError, ValueError):
            continue
        return info if isinstance(info, dict) else {}
    return {}


def find_shards(spec: str | os.PathLike, split: str) -> list[Path]:
    """The split's shards `spec` names, in order; DataError when there are none."""
    found = shard_set(spec)
    if found is None:
        raise DataError(f"{spec}: no WebDataset shards (*.tar)")
    return found.shards(split)


# --- The index: tar headers and label members only


@dataclass(frozen=True)
class ShardIndex:
    """One shard's samples in stored order: where each image's bytes are, its class and its member's name."""

    offsets: np.ndarray  # int64, the image member's data
    sizes: np.ndarray  # int64
    labels: np.ndarray  # int64, 0-based
    names: np.ndarray  # bytes, the image member's name (for messages)
    label_names: np.ndarray  # bytes, the label member's name (for messages)


INDEX_FIELDS = ("offsets", "sizes", "labels", "names", "label_names")


def index_shard(path: Path | str, label_key: str | None = None) -> ShardIndex:
    """Every sample of the shard, from its tar headers and label members; DataError naming the shard and the
    member for a damaged or cut-short tar, a member name given twice in a sample, an image without its label
    (or a label without its image), and a label that is not a class number (0 or more). `label_key`: the JSON
    key the set declares (`ShardSet.label_key`), None for the first of LABEL_EXTENSIONS present."""
    samples: list[tuple[int, int, int, bytes, bytes]] = []
    with open_regular_file(path, SHARD_SIZE_UNLIMITED) as file:
        file_size = os.fstat(file.fileno()).st_size
        if hasattr(os, "posix_fadvise"):
            # Headers are an image apart: read-ahead would pull in every image for nothing.
            os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
        for key, members in _samples(str(path), file, file_size):
            samples.append(_sample(str(path), file, key, members, label_key))
    columns = zip(*samples) if samples else ((), (), (), (), ())
    return ShardIndex(*(np.array(column, dtype=np.bytes_ if name.endswith("names") else np.int64)
                        for column, name in zip(columns, INDEX_FIELDS)))


def index_split(shards: list[Path], label_key: str | None = None) -> tuple[np.ndarray, ShardIndex]:
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
    return _cached_split(tuple(identities), label_key)


@lru_cache(maxsize=4)  # a run's two splits: the class count, the checks before the run and the loader index once
def _cached_split(identities: tuple[tuple[str, int, int], ...], label_key: str | None) -> tuple[np.ndarray, ShardIndex]:
    """(each sample's shard number, the samples), keyed by every shard's path, size and time: a shard rewritten
    since is indexed again."""
    indexes = _index_each([path for path, *_ in identities], label_key)
    shard_ids = np.repeat(np.arange(len(indexes), dtype=np.int32), [len(index.offsets) for index in indexes])
    return shard_ids, ShardIndex(*(np.concatenate([getattr(index, name) for index in indexes])
                                   for name in INDEX_FIELDS))


def _index_each(paths: list[str], label_key: str | None = None) -> list[ShardIndex]:
    """Indexing costs one core about 45 us per sample in tarfile's header parsing (about a minute for ImageNet's
    1.28 M samples from the page cache), so a large set is indexed by processes, one per core (threads would
    take turns at the interpreter; they serve a few shards, overlapping their reads)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if len(paths) < INDEX_PROCESSES_FROM or cores < 2:
        with ThreadPoolExecutor(max_workers=min(INDEX_THREADS, len(paths))) as pool:
            return list(pool.map(lambda path: index_shard(path, label_key), paths))
    # forkserver: this process may hold threads (torch's) that a forked child would inherit mid-lock.
    context = multiprocessing.get_context("forkserver")
    with ProcessPoolExecutor(max_workers=min(cores, INDEX_PROCESSES), mp_context=context) as pool:
        found = list(pool.map(_index_or_error, paths, [label_key] * len(paths), chunksize=4))
    first_error = next((item for item in found if isinstance(item, str)), None)
    if first_error is not None:
        raise DataError(first_error)
    return found


def _index_or_error(path: str, label_key: str | None) -> ShardIndex | str:
    """In an indexing process: the index, or the error's one line (an exception crossing back would be rebuilt
    from its arguments, which not every DataError's are)."""
    try:
        return index_shard(path, label_key)
    except DataError as error:
        return str(error)


def _samples(path: str, file: io.BufferedReader, file_size: int) -> Iterable[tuple[str, dict[str, tarfile.TarInfo]]]:
    """(key, {extension: member}) of each run of consecutive regular members sharing a key; DataError for a
    member name met twice in one sample (webdataset's group_by_keys refuses it: which one is the sample's?)."""
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
            extension = match.group(2).lower()
            if extension in members:
                raise DataError(f"{path}: sample {key} holds {members[extension].name} twice (a member name given "
                                "twice in one sample: which is the sample's is not known)")
            members[extension] = member
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
            label_key: str | None) -> tuple[int, int, int, bytes, bytes]:
    image = next((members[ext] for ext in IMAGE_EXTENSIONS if ext in members), None)
    if image is None:
        present = ", ".join(member.name for member in members.values())
        raise DataError(f"{path}: sample {key} has no image ({key}.jpg): only {present}")
    extensions = ("json",) if label_key is not None else LABEL_EXTENSIONS
    json_key = label_key or JSON_LABEL_KEY
    for extension in extensions:
        label = members.get(extension)
        if label is None:
            continue
        value = _label_value(path, file, label, json_key, declared=label_key is not None)
        if value is not None:
            return image.offset_data, image.size, value, os.fsencode(image.name), os.fsencode(label.name)
    wanted = [f"{key}.{ext}" if ext != "json" else f"{key}.json's {json_key!r}" for ext in extensions]
    raise DataError(f"{path}: member {image.name} has no label ({', '.join(wanted[:-1])}{' or ' if wanted[:-1] else ''}"
                    f"{wanted[-1]})")


def _label_value(path: str, file: io.BufferedReader, label: tarfile.TarInfo, json_key: str,
                 declared: bool = False) -> int | None:
    """The class a label member holds: ASCII digits (.cls, .txt, .idx), or a JSON object's `json_key`; None for a
    JSON sidecar without the key (timm's hold a file name), unless the set `declared` the key."""
    is_json = label.name.lower().endswith(".json")
    limit = JSON_BYTES if is_json else LABEL_BYTES
    text = os.pread(file.fileno(), min(label.size, limit + 1), label.offset_data)
    try:
        if label.size > limit:
            raise ValueError
        if is_json:
            found = json.loads(text)
            if not isinstance(found, dict) or json_key not in found:
                if not declared:
                    return None
                raise DataError(f"{path}: member {label.name} has no {json_key!r} key (the key the set's "
                                "_info.json names as the split's alt_label)")
            value = found[json_key]
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError
        else:
            value = int(text.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        shown = text[:LABEL_BYTES] if not is_json else text[:80]
        raise DataError(f"{path}: member {label.name} is not a class number: {shown!r}") from None
    if value < 0:
        raise DataError(f"{path}: member {label.name} holds class {value}: classes are numbered from 0 (a sample "
                        "without a class cannot be trained on)")
    return value


# --- The reader the loader is handed


class ShardRecords:
    """One split's samples over all its shards, in shard order: the loader's reader (`cnns.data.image_loader`'s
    ImageRecords). Holds the index, not open files, so it crosses to DataLoader workers as it is."""

    def __init__(self, shards: list[Path], where: str, num_classes: int, size_limit: int | None = None,
                 label_key: str | None = None) -> None:
        self.shards = shards
        self.num_classes = num_classes
        self.where = where
        self.size_limit = size_limit  # the largest image read (--max-file-size)
        self.shard_ids, index = index_split(self.shards, label_key)
        self.offsets, self.sizes, self.names = index.offsets, index.sizes, index.names
        # Not `targets`: the shards mix the classes, so --dataset-percentage-to-use takes the first samples.
        self.labels = index.labels
        if len(self.labels) and int(self.labels.max()) >= num_classes:
            at = int(np.argmax(self.labels))
            raise DataError(f"{self.shards[self.shard_ids[at]]}: member {os.fsdecode(index.label_names[at])} holds "
                            f"class {int(self.labels[at])}, outside 0..{num_classes - 1}")

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
        return shard_local_order(indices, self.shard_ids, len(self.shards), SHUFFLE_BUFFER, seed, epoch)


def shard_local_order(indices: np.ndarray, shard_ids: np.ndarray, shards: int, buffer: int, seed: int,
                      epoch: int) -> np.ndarray:
    """`indices` as a streaming reader takes them, drawn from (seed, epoch): the shards (`shard_ids` each sample's)
    in a shuffled order, each read through in stored order, through a shuffle buffer of `buffer` samples."""
    from cnns.data.batches import mix_seed

    rng = np.random.Generator(np.random.PCG64(mix_seed(seed, epoch)))
    place = np.empty(shards, dtype=np.int64)
    place[rng.permutation(shards)] = np.arange(shards)
    stream = indices[np.argsort(place[shard_ids[indices]], kind="stable")]
    return buffer_shuffle(stream, buffer, rng)


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
    files = "WebDataset shards (*.tar)"
    names_files = True

    def recognise(self, folder: Path) -> bool:
        """Shards `folder` (--data-dir) names (`shard_set`); in a folder that is also a folder tree of class
        folders, only shards named as timm's (x-train-0000.tar): a stray archive beside a tree is not a set."""
        found = shard_set(folder)
        if found is None:
            return False
        if found.root == folder and folder.is_dir():
            from cnns.data.formats.folder_tree import FolderTree

            if FolderTree.split_classes(folder) is not None:
                return any(TIMM_SHARD_NAME.fullmatch(path.name) for path in _listing(folder))
        return True

    def shard_set(self, folder: Path) -> ShardSet:
        found = shard_set(folder)
        if found is None:
            raise DataError(self.missing(folder))
        return found

    def missing(self, folder: Path) -> str:
        return (f"no WebDataset shards found in {folder} (a folder of *.tar shards, its train/ and val/ folders, a "
                "shard file, a glob, a brace pattern or a list joined by ::)")

    def classes(self, folder: Path) -> int:
        """The classes the labels hold: the largest label over the splits' shards, plus one (the shards' headers
        and label members are read: what the checks and the loader read anyway, indexed once)."""
        found = self.shard_set(folder)
        largest = -1
        for split in SPLITS:
            if found.splits.get(split):
                _, index = index_split(found.shards(split), found.label_key(split))
                largest = max(largest, int(index.labels.max()) if len(index.labels) else -1)
        return largest + 1 if largest >= 0 else self.dataset.num_classes

    def records(self, folder: Path, split: str, size_limit: int | None = None) -> ShardRecords:
        found = self.shard_set(folder)
        return ShardRecords(found.shards(split), found.where, self.classes(folder), size_limit,
                            found.label_key(split))

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


def write_info(root: str | os.PathLike, name: str, splits: dict[str, list[tuple[str, int]]], num_classes: int) -> None:
    """The set's _info.json, as timm's wds reader (`timm.data.create_dataset("wds/...")`) reads it: each split's
    shard names (relative to `root`), their sample counts and the total; `num_classes` beside them. Written whole
    or not at all."""
    from cnns.safe_writes import write_atomically

    info = {"name": name, "num_classes": num_classes, "splits": {
        split: {"name": split, "filenames": [shard for shard, _ in shards],
                "shard_lengths": [count for _, count in shards], "num_samples": sum(count for _, count in shards)}
        for split, shards in splits.items()}}
    write_atomically(Path(root) / INFO_FILES[0], (json.dumps(info, indent=1) + "\n").encode())
