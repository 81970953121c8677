"""ImageNet as TFRecord shards (``train-00000-of-01024``, ``validation-00000-of-00128``, in the folder or its
``imagenet-data/``), each record a tf.train.Example with the encoded image and its label (`cnns.data.tfrecord_reader`)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from cnns.data.formats.base import TrainingBatch
from cnns.data.formats.imagenet import ImageNetFiles
from cnns.errors import DataError


class TFRecords(ImageNetFiles):
    name = "tfrecord"
    reads = "the TFRecord record's image bytes"
    files = "TFRecords (train-*-of-*)"

    def recognise(self, folder: Path) -> bool:
        """Shards of either split in the folder or its imagenet-data/."""
        from cnns.data.tfrecord_reader import find_shards

        for split in ("train", "validation"):
            try:
                find_shards(folder, split)
                return True
            except DataError:
                pass
        return False

    def records(self, folder: Path, split: str, size_limit: int | None = None):
        from cnns.data.tfrecord_reader import TFRecordDataset

        return TFRecordDataset(folder, split, size_limit=size_limit)

    def check(self, folder: Path, splits: list[str], batch: TrainingBatch, *, decode: bool,
              size_limit: int | None) -> None:
        for split in splits:
            data, source = check_tfrecord_split(folder, split, batch if split == "train" else None, size_limit)
            if decode:
                self.check_first_image(data, source)


def check_tfrecord_split(folder: Path, split: str, batch: TrainingBatch | None,
                         size_limit: int | None = None) -> tuple[bytes, str]:
    """Every shard of the split is a regular file that begins with a whole TFRecord, no longer than `size_limit`
    (--max-file-size), holding an ImageNet tf.train.Example, and the training split holds one batch (shards are
    indexed, headers only, until it does). Returns the first image's bytes and where they come from."""
    from cnns.data.tfrecord_reader import find_shards, first_example, index_records

    shards = find_shards(folder, split)
    first = None
    with ThreadPoolExecutor(max_workers=min(16, len(shards))) as pool:  # I/O-bound: one read per shard
        # each image let go once seen: only the first is kept
        for example in pool.map(lambda shard: first_example(shard, size_limit), shards):
            first = first or example
    if first is None:
        raise DataError(f"{folder}: every {split} TFRecord shard is empty ({len(shards)} of them: "
                        f"{shards[0].name} ...)")
    if batch is not None:
        needed, records = batch.images_needed(), 0
        for path in shards:
            records += len(index_records(path))
            if records >= needed:
                break
        else:
            batch.check_fits(batch.kept(records), records, folder)
    return first


TFRECORDS = TFRecords()
