"""An error keeps its meaning across processes: a bad file met in a DataLoader worker reaches the user as the same one
line and exit code as in one process (`cnns.errors.HandedBack`), whatever the error's constructor takes.

Each kind of bad input is planted in a small JPEG tree where the checks before the run do not look (not the first
image), so it is met while training, and trained through 0, 1 and 2 worker processes; the lines are compared."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

import scripts
from test_bad_input import IMAGENET_RUN
from test_tfrecord import colour_jpeg, colour_of


def jpeg_tree(root: Path) -> Path:
    """train/ and validation/ with two class folders of two JPEGs each; the last training image is the one a case
    spoils (sorted last: the checks before the run decode the first)."""
    for split in ("train", "validation"):
        for index in range(4):
            path = root / split / f"n0{index % 2}" / f"{index}.JPEG"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(colour_jpeg(colour_of(index)))
    return root


def _dangling_link(image: Path) -> list[str]:
    image.unlink()
    image.symlink_to(image.parent / "gone.JPEG")  # a file deleted from the tree while a run reads it looks the same
    return []


def _undecodable(image: Path) -> list[str]:
    image.write_bytes(image.read_bytes()[:50])
    return []


def _too_large(image: Path) -> list[str]:
    image.write_bytes(image.read_bytes() + bytes(4096))
    return ["--max-file-size", str(len(image.read_bytes()) - 1)]


def _a_folder(image: Path) -> list[str]:
    image.unlink()
    image.mkdir()
    return []


KINDS = {"dangling symbolic link": (_dangling_link, "cannot read"), "undecodable JPEG": (_undecodable, "cannot decode"),
         "file over --max-file-size": (_too_large, "--max-file-size"), "folder named .JPEG": (_a_folder, "cannot read")}


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_bad_file_met_in_a_worker_is_the_same_line_as_in_one_process(kind, tmp_path, capfd):
    spoil, words = KINDS[kind]
    root = jpeg_tree(tmp_path / "tree")
    extra = spoil(root / "train" / "n01" / "3.JPEG")
    ends = {}
    for workers in (0, 1, 2):
        out = scripts.run_here(capfd, "train.py", *IMAGENET_RUN, "--micro-batch-size", "4", "--no-validation",
                               "--data-dir", str(root), "--pipeline-num-parallel", str(workers), *extra,
                               "--logs-path", str(tmp_path / f"run{workers}"), cwd=tmp_path, expect=None)
        ends[workers] = (out.returncode, out.stderr.strip().replace(f"run{workers}", "run"))
        # Met while training (the checks before the run did not look there), where the workers read it.
        assert (tmp_path / f"run{workers}" / "arguments.json").exists(), (workers, out.stderr[-2000:])
    code, line = ends[0]
    assert code == 2 and len(line.splitlines()) == 1 and words in line and "bug in cnns" not in line, ends
    assert ends[1] == ends[0] and ends[2] == ends[0], ends


def _error_classes() -> list[type]:
    """Every CnnsError class of cnns: the modules that define one (found in the source) imported, their subclasses
    walked."""
    import importlib
    import re

    from cnns.errors import CnnsError

    source = Path(__file__).resolve().parents[1] / "src"
    for path in sorted((source / "cnns").rglob("*.py")):
        if re.search(r"^class \w+\((\w+Error|CnnsError|UnreadableFile|RunFolderInUse)\)", path.read_text(), re.M):
            importlib.import_module(".".join(path.relative_to(source).with_suffix("").parts))
    found, todo = [], [CnnsError]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return sorted(found, key=lambda cls: f"{cls.__module__}.{cls.__qualname__}")


ERROR_CLASSES = _error_classes()


@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=lambda cls: cls.__qualname__)
def test_every_error_class_crosses_a_process_as_itself(cls):
    """Pickled and rebuilt (what a worker's result and a replica's message go through): the same class, line and
    attributes, whatever arguments the class's constructor takes."""
    import inspect

    from cnns.errors import CnnsError

    parameters = [parameter for parameter in list(inspect.signature(cls.__init__).parameters.values())[1:]
                  if parameter.default is inspect.Parameter.empty
                  and parameter.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    error = cls(*(OSError(28, "No space left on device") if parameter.name == "cause" else f"<{parameter.name}>"
                  for parameter in parameters))
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is cls and isinstance(again, CnnsError) and str(again) == str(error)
    shown = {key: str(value) for key, value in vars(error).items()}
    assert {key: str(value) for key, value in vars(again).items()} == shown


def test_a_bad_file_met_by_one_replica_ends_the_run_with_its_line(tmp_path, capfd):
    """Two replicas, each with a worker: the replica that meets the file says its line and the run ends with its
    exit code; the replica its launcher stops then is not a bug (its workers got the SIGTERM first, which torch
    reports as an error of its own). The stopped replica still says it was interrupted: a second line, as
    replicas without workers say (cnns.parallel.launch cannot tell the launcher's stop from a user's)."""
    root = jpeg_tree(tmp_path / "tree")
    _dangling_link(root / "train" / "n01" / "3.JPEG")
    argv = [*IMAGENET_RUN, "--micro-batch-size", "2", "--no-validation", "--data-dir", str(root), "--replicas", "2",
            "--logs-path", str(tmp_path / "run")]
    alone = scripts.run_here(capfd, "train.py", *argv, "--pipeline-num-parallel", "0", cwd=tmp_path, expect=None)
    workers = scripts.run_here(capfd, "train.py", *argv, "--pipeline-num-parallel", "1", "--logs-path",
                               str(tmp_path / "run1"), cwd=tmp_path, expect=None)
    line = f"error: {root / 'train' / 'n01' / '3.JPEG'}: cannot read: No such file or directory"
    for out in (alone, workers):
        assert out.returncode == 2 and line in out.stderr.splitlines(), out.stderr[-2000:]
        assert "a bug in cnns" not in out.stderr, out.stderr[-2000:]
