"""Each data format is one module behind one interface (`cnns.data.formats`), and nothing else asks which dataset
a run has (issue 51): the `--dataset` choices, the model defaults, the class count, the folder's recognition, the
checks before a run and the batch sources all read the registry. The scan reads every module with `ast`."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from cnns.data import formats
from cnns.data.formats import DATASETS, FORMATS, DataFormat, Dataset, FormatSources, TrainingBatch
from cnns.errors import ConfigError, DataError

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "cnns"
DATA = PACKAGE / "data"  # the formats and the readers they use, which name their own record layouts


def dataset_names_spelled(source: str) -> list[int]:
    """The lines of `source` that spell a dataset's name as a string."""
    return sorted({node.lineno for node in ast.walk(ast.parse(source))
                   if isinstance(node, ast.Constant) and node.value in DATASETS})


def test_the_scan_finds_a_dataset_name_however_it_is_used():
    bad = ('a = cfg.data.dataset == "imagenet"\n'
           'b = o["dataset"] in ("cifar-10", "builtin")\n'
           'c = {"cifar-100": 100}\n'
           'd = f(dataset="cifar-10")\n')
    assert dataset_names_spelled(bad) == [1, 2, 3, 4]
    assert dataset_names_spelled('a = DATASETS[name].cifar_sized\nb = "cifar"\n') == []


def test_no_module_outside_the_data_formats_names_a_dataset():
    offences = [f"{path.relative_to(PACKAGE.parent)}:{line}"
                for path in sorted(PACKAGE.rglob("*.py")) if DATA not in path.parents
                for line in dataset_names_spelled(path.read_text())]
    assert offences == [], "ask cnns.data.formats instead:\n" + "\n".join(offences)


def write_each_format(root: Path) -> dict[str, Path]:
    """A small folder of every format recognised from its contents, by the project's own writers."""
    from cnns.data.drawn_shapes import draw_shapes
    from cnns.data.cifar_records import write_cifar10, write_cifar100
    from cnns.data.jpegtree import make_jpeg_tree

    images, labels = draw_shapes(12, seed=3)
    layouts = ("tfrecord", "folder", "webdataset", "huggingface-parquet", "huggingface-arrow")
    folders = {name: root / name for name in ("cifar-10", "cifar-100", *layouts)}
    write_cifar10(folders["cifar-10"], (images[:8], labels[:8]), (images[8:], labels[8:]))
    write_cifar100(folders["cifar-100"], (images[:8], labels[:8] * 7), (images[8:], labels[8:] * 7))
    for layout in layouts:
        make_jpeg_tree(folders[layout], 8, classes=3, validation_images=3, seed=1, layout=layout)
    return folders


@pytest.fixture(scope="module")
def each_format(tmp_path_factory) -> dict[str, Path]:
    return write_each_format(tmp_path_factory.mktemp("formats"))


def test_each_format_recognises_its_own_folder_and_no_other(each_format):
    assert sorted(each_format) == sorted(f.name for f in FORMATS if not f.named_only)  # every format is here
    for written, folder in each_format.items():
        assert formats.format_of_folder(folder).name == written
        assert [f.name for f in FORMATS if not f.named_only and f.recognise(folder)] == [written]
    assert formats.format_of_folder(each_format["folder"].parent / "nothing") is None


def test_each_format_counts_and_names_its_classes(each_format):
    assert formats.classes_in_folder("imagenet", str(each_format["folder"])) == 3  # its class folders
    assert formats.classes_in_folder("imagenet", str(each_format["tfrecord"])) == 1000  # the dataset's
    assert formats.classes_in_folder("cifar-100", str(each_format["cifar-100"])) == 100
    assert formats.classes_in_folder(None, None) == 10  # not known yet: CIFAR-10's, whose defaults apply
    names, source = formats.class_names("imagenet", each_format["folder"])
    assert len(names) == 3 and names == sorted(names) and source.endswith("train")
    assert formats.class_names("imagenet", each_format["tfrecord"]) is None  # TFRecords carry none
    assert formats.class_names("builtin", None)[0][0] == "circle"  # drawn, so known without the folder


def test_the_checks_before_a_run_go_to_the_folder_s_format(each_format):
    one = TrainingBatch.of(2, 1, 1, 100)
    for name, folder in each_format.items():
        formats.check_data(None, str(folder), ["train", "validation"], one, outputs=1000, decode=True,
                           size_limit=None)
    with pytest.raises(ConfigError, match="has 100 classes, more than the model's 10 outputs"):
        formats.check_data("cifar-100", str(each_format["cifar-100"]), ["train"], one, outputs=10, decode=True,
                           size_limit=None)
    with pytest.raises(DataError, match="fewer than one global batch of 16 \\(micro-batch 8 x replicas 2\\)"):
        formats.check_data(None, str(each_format["cifar-10"]), ["train"], TrainingBatch.of(8, 1, 2, 100),
                           outputs=10, decode=True, size_limit=None)
    with pytest.raises(DataError, match="no cifar-100 binary files found in"):
        formats.find_format("cifar-100", each_format["cifar-10"])
    with pytest.raises(DataError, match="no imagenet files found in .*: expected TFRecords"):
        formats.find_format("imagenet", each_format["cifar-10"])
    with pytest.raises(DataError, match="cannot infer the dataset in .*; name it with --dataset"):
        formats.find_format(None, each_format["cifar-10"].parent)


def test_the_dataset_is_read_from_the_folder_s_path_by_the_longest_name():
    assert formats.dataset_named_in_path("/data/CIFAR-100-binary") == "cifar-100"
    assert formats.dataset_named_in_path("/data/cifar10") == "cifar-10"
    assert formats.dataset_named_in_path("/datasets/imagenet/") == "imagenet"
    assert formats.dataset_named_in_path("/data/mine") is None


class Stripes(DataFormat):
    """A format no module knows of: 48x48 images of 4 classes, one per line of `stripes.txt`."""

    name = "stripes"
    dataset = Dataset("stripes", num_classes=4, cifar_sized=True, train_images=100, eval_images=20,
                      path_words=("stripes",))

    def __init__(self):
        self.checked: list = []

    def recognise(self, folder: Path) -> bool:
        return (folder / "stripes.txt").is_file()

    def check(self, folder, splits, batch, *, decode, size_limit):
        self.checked.append((folder, splits, batch.size))

    def sources(self, data, folder, request):
        return FormatSources(None, None)


def test_a_format_added_to_the_registry_reaches_the_options_the_defaults_and_the_checks(tmp_path, monkeypatch):
    """The one place: a format's entry in `FORMATS` (and its dataset's in `DATASETS`) is all the command line,
    the defaults and the checks read."""
    from cnns.cli.parsing import resolve_command_line
    from cnns.commands.checks import check_data_before_writing

    stripes = Stripes()
    monkeypatch.setattr(formats, "FORMATS", (*FORMATS, stripes))
    monkeypatch.setitem(DATASETS, "stripes", stripes.dataset)
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "stripes.txt").write_text("a\nb\nc\nd\n")
    run = resolve_command_line("train", ["--data-dir", str(folder), "--model-size", "8", "--iterations", "1"])
    assert run.config.data.dataset == "stripes"  # recognised from its contents
    assert run.config.model.num_classes == 4 and run.config.data.image_size == 32  # its facts, CIFAR-sized defaults
    assert resolve_command_line("train", ["--dataset", "stripes", "--data-dir", str(folder), "--model-size", "8",
                                          "--iterations", "1"]).config.data.dataset == "stripes"  # a choice
    check_data_before_writing(run.config)
    assert stripes.checked == [(folder, ["train", "validation"], run.config.train.global_batch_size)]
    with pytest.raises(ConfigError, match="image-size is not supported for CIFAR-sized datasets"):
        resolve_command_line("train", ["--data-dir", str(folder), "--image-size", "48"])
