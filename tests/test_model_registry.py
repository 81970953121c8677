"""The model registry (issue 69): each family one entry in `cnns.models`, read by everything else.

Nothing outside `cnns.models` spells a family's key, display name or run-name tag in a string (the option table,
the defaults, the run name, the header, the export all read the entry); the seed's families keep their run names;
a family added as one file and one registry line trains; `cnns models` lists the names --model takes, as timm's
list_models does, and an unknown name is one line with the nearest names.
"""

from __future__ import annotations

import ast
import csv
import json
import re
from pathlib import Path

import pytest
import timm

import scripts
from digit_records import write_digits_cifar10
from tiny_family import TINY

from cnns.models import ModelSpec, build_model, count_parameters, register_family
from cnns.models.families import registered_families
from cnns.models.family import unregister_family

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "cnns"


def family_spellings() -> re.Pattern:
    """Every family's key, display name and run-name tag (its prefix without a size), as whole words."""
    words = set()
    for family in registered_families():
        if family.named:
            continue
        words |= {family.key, family.display, family.prefix(family.key, "").rstrip("-")}
    assert {"resnet", "ResNeXt", "RN", "RNX", "EfficientNet"} <= words  # the reader found the seed's families
    return re.compile(r"(?<![\w.])(" + "|".join(sorted(map(re.escape, words), key=len, reverse=True)) + r")(?![a-z])",
                      re.IGNORECASE)


def strings_outside_docstrings(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every string constant of a module (f-strings' parts too) but its docstrings."""
    tree = ast.parse(path.read_text(), str(path))
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant) and isinstance(node.body[0].value.value, str)}
    return [(node.lineno, node.value) for node in ast.walk(tree) if isinstance(node, ast.Constant)
            and isinstance(node.value, str) and id(node) not in docstrings]


def test_no_module_outside_models_spells_a_family_name():
    """Family names live in their entries: a string in any other module naming one (a comparison with
    "efficientnet", a "ResNet depth" in a help text, an "RNX" tag) is a family spread over the house again."""
    pattern = family_spellings()
    found = [f"{path.relative_to(PACKAGE.parent)}:{line}: {text!r}"
             for path in sorted(PACKAGE.rglob("*.py")) if path.relative_to(PACKAGE).parts[0] != "models"
             for line, text in strings_outside_docstrings(path) if pattern.search(text)]
    assert not found, "family names spelled outside cnns.models:\n" + "\n".join(found)


def test_the_scan_finds_a_family_name_where_one_is(tmp_path):
    """Guards the scan itself: a comparison with a family key and a tag in an f-string are found, a docstring not."""
    module = tmp_path / "m.py"
    module.write_text('"""ResNet in a docstring."""\nx = arch == "efficientnet"\ny = f"RNX{size}_bs"\nz = "layer1"\n')
    pattern = family_spellings()
    assert [line for line, text in strings_outside_docstrings(module) if pattern.search(text)] == [2, 3]


SEED_RUN_NAMES = [
    (("--dataset", "cifar-10"), "RN20_bs32_BN_16.16"),
    (("--dataset", "cifar-10", "--model", "resnext", "--no-stochastic-rounding"), "RNX29_bs32_BN_16.16_noSR"),
    (("--dataset", "imagenet", "--model", "resnet", "--model-size", "50", "--gradient-accumulation-count", "4"),
     "RN50_bs4x4a_GN32_16.16"),
    (("--dataset", "imagenet", "--model", "efficientnet", "--model-size", "b4", "--gradient-accumulation-count", "16"),
     "EfficientNet-B4_bs4x16a_GN4_380x380"),
    (("--dataset", "cifar-10", "--model", "efficientnet"), "EfficientNet-cifar_bs8_GN4"),
]


@pytest.mark.parametrize("argv, name", SEED_RUN_NAMES)
def test_the_seed_families_keep_their_run_names(argv, name, capfd, monkeypatch):
    monkeypatch.setenv("DATA_DIR", "/nowhere/cifar-10")
    extra = ("--synthetic-data",) if "imagenet" in argv else ()
    printed = json.loads(scripts.run_here(capfd, "train.py", *argv, *extra, "--print-config").stdout)
    assert printed["name"] == name


@pytest.fixture
def digits(tmp_path_factory) -> Path:
    return write_digits_cifar10(tmp_path_factory.mktemp("digits"))


def accuracies(run: Path) -> tuple[list[float], float]:
    with open(run / "training.csv") as file:
        losses = [float(row["loss_batch"]) for row in csv.DictReader(file)]
    with open(run / "validation.csv") as file:
        validated = [float(row["val_acc"]) for row in csv.DictReader(file)]
    return losses, validated[-1]


def test_a_family_added_in_one_file_and_one_line_trains(digits, tmp_path, capfd):
    """tests/tiny_family.py is the whole family; the registry line is the one below. --model takes it, --help and
    the run name say it, and it learns the digits."""
    register_family(TINY)
    try:
        assert "tinynet" in scripts.run_here(capfd, "train.py", "--help").stdout
        assert count_parameters(build_model(ModelSpec("tinynet", "m", 10, 32))) == 3 * 16 * 9 + 2 * 16 + \
            16 * 32 * 9 + 2 * 32 + 32 * 10 + 10
        run = tmp_path / "run"
        scripts.run_here(capfd, "train.py", "--model", "tinynet", "--model-size", "m", "--data-dir", str(digits), "--epochs", "3",
                         "--optimiser", "momentum", "--abs-learning-rate", "0.4", "--warmup-epochs", "0",
                         "--logs-per-epoch", "4", "--precision", "32.32", "--pipeline-num-parallel", "0",
                         "--seed", "3", "--logs-path", str(run))
        assert json.loads((run / "arguments.json").read_text())["name"] == "TinyM_bs32_BN"
        losses, accuracy = accuracies(run)
        # Measured: loss 2.55 -> 1.77, 29.6 % on the 297 held-out digits (chance: 10 %).
        assert losses[-1] < 0.8 * losses[0] and accuracy > 20.0, (losses, accuracy)
    finally:
        unregister_family(TINY.key)


def test_cnns_models_lists_the_names_as_timm_does(capfd):
    listed = scripts.run_here(capfd, "models", "convnext_at*").stdout.split()
    assert listed == timm.list_models("convnext_at*") and "convnext_atto" in listed
    assert scripts.run_here(capfd, "models", "res*").stdout.split()[:2] == ["resnet", "resnext"]


def test_an_unknown_model_is_one_line_with_the_nearest_names(capfd, tmp_path, monkeypatch):
    monkeypatch.setenv("DATA_DIR", "/nowhere/cifar-10")
    done = scripts.run_here(capfd, "train.py", "--model", "convnext_attx", "--log-dir", str(tmp_path), expect=2)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "unknown model 'convnext_attx'; nearest: convnext_atto" in lines[0]
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("options, words", [
    (("--model", "convnext_atto", "--model-size", "18"), "takes no --model-size"),
    (("--model", "convnext_atto", "--group-norm"), "has none"),
    (("--model", "convnext_atto", "--replicas", "2", "--BN-span", "2"),
     "--BN-span 2 spans the statistics of batch norms over replicas, and convnext_atto has none (it normalises"),
])
def test_what_a_timm_model_cannot_take_is_one_line(options, words, capfd, tmp_path, monkeypatch):
    monkeypatch.setenv("DATA_DIR", "/nowhere/cifar-10")
    done = scripts.run_here(capfd, "train.py", *options, "--dataset", "imagenet", "--synthetic-data",
                            "--image-size", "32", "--iterations", "1", "--log-dir", str(tmp_path), expect=2)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], done.stderr
    assert not any(tmp_path.iterdir())


def test_docs_models_names_every_family_and_the_load_line_export_prints():
    """docs/models.md's table has a row per family, and its timm load line is the one `cnns export` prints."""
    from cnns.commands.export import timm_usage_line

    text = (PACKAGE.parents[1] / "docs" / "models.md").read_text()
    for family in registered_families():
        if not family.named:
            assert f"| `{family.key}` |" in text, family.key
    line = timm_usage_line(Path("FOLDER")).split("  #")[0]
    for statement in line.removeprefix("import timm; ").split("; "):
        assert statement.replace("'", '"').replace(".eval()", "").split(" = ")[1] in text.replace(".eval()", ""), \
            statement
