"""`cnns convert fashion-mnist|mnist|digits --out DIR`: a small public image set written as CIFAR-10 binaries
(`cnns.data.as_cifar`), which `train.py --data-dir DIR` then trains on as on CIFAR-10."""

from __future__ import annotations

import argparse

from cnns.config.strict_parser import StrictParser
from pathlib import Path

from cnns.data.as_cifar import (DEBIAN_FASHION_MNIST, DIGIT_CLASSES, FASHION_MNIST_CLASSES, GreySet, cifar10_files,
                                digits_splits, idx_split)
from cnns.errors import ConfigError
from cnns.safe_writes import check_output, write_atomically

# Each source: (what it is, the folder it is read from by default or None, its class names).
SOURCES = {
    "fashion-mnist": ("Zalando's Fashion-MNIST, its four IDX files (Debian: apt-get install dataset-fashion-mnist)",
                      DEBIAN_FASHION_MNIST, FASHION_MNIST_CLASSES),
    "mnist": ("LeCun's MNIST digits, its four IDX files", None, DIGIT_CLASSES),
    "digits": ("scikit-learn's 8x8 handwritten digits (bundled with it: nothing is read from disk)", None,
               DIGIT_CLASSES),
}


def _parser() -> argparse.ArgumentParser:
    parser = StrictParser(
        prog="cnns convert",
        description="Write a small public image set as CIFAR-10 binaries (data_batch_1..5.bin, test_batch.bin, "
                    "batches.meta.txt): each grey image enlarged by the largest whole factor that fits 32 px, centred "
                    "on black, in all three colour planes. Then: train.py --data-dir OUT.",
        epilog="sources: " + "; ".join(f"{name}: {about}" for name, (about, _, _) in SOURCES.items()))
    parser.add_argument("source", choices=sorted(SOURCES), help="the image set to convert")
    parser.add_argument("--out", type=Path, required=True, metavar="DIR", help="the folder to write (made if missing)")
    parser.add_argument("--from", dest="from_dir", type=Path, metavar="DIR",
                        help=f"the folder of the IDX files (train-images-idx3-ubyte[.gz] and the other three); "
                             f"fashion-mnist reads {DEBIAN_FASHION_MNIST} unless given; digits reads no folder")
    parser.add_argument("--overwrite", action="store_true", help="replace CIFAR files already in --out")
    return parser


def convert_main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    _, default_folder, class_names = SOURCES[args.source]
    train, test = _splits(args.source, args.from_dir or default_folder)
    files = cifar10_files(train, test, class_names)
    reads = [Path(split.source) for split in (train, test)]
    for name in files:  # every output checked before the first is written
        check_output(args.out / name, reads, args.overwrite, option="--out")
    args.out.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        write_atomically(args.out / name, content)
    print(f"Wrote {args.source} as CIFAR-10 binaries to {args.out}: {len(train.labels)} training and "
          f"{len(test.labels)} test images, 10 classes ({', '.join(class_names)})")
    print(f"Train on it: python3 train.py --data-dir {args.out}")
    return 0


def _splits(source: str, folder: Path | None) -> tuple[GreySet, GreySet]:
    if source == "digits":
        if folder is not None:
            raise ConfigError("digits come with scikit-learn: leave out --from")
        return digits_splits()
    if folder is None:
        raise ConfigError(f"{source} needs --from DIR, the folder of its four IDX files")
    if not folder.is_dir():
        raise ConfigError(f"--from {folder}: no such folder"
                          + (" (Debian: apt-get install dataset-fashion-mnist)" if source == "fashion-mnist" else ""))
    return idx_split(folder, "train"), idx_split(folder, "test")
