"""cnns.versions: the torch/torchvision/timm minimums come from pyproject.toml, versions sort as pip sorts
them, and an installed version below the range is one line that says what to run."""

from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

from cnns import versions
from cnns.cli import run_script
from cnns.versions import check_installed_versions, is_older, supported_minimums, version_key

ROOT = Path(__file__).resolve().parents[1]
MINIMUMS = {"torch": "2.11", "torchvision": "0.26", "timm": "1.0.29"}


def pyproject_lower_bounds() -> dict[str, str]:
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return dict(re.fullmatch(r"([A-Za-z0-9_.-]+)>=([^,;\s]+)", d.replace(" ", "")).groups()
                for d in dependencies if ">=" in d)


@pytest.mark.parametrize("older, newer", [
    ("2.10.1", "2.11"),
    ("2.11.0.dev20260101", "2.11"),       # a nightly of 2.11 comes before 2.11 itself, as pip has it
    ("2.11", "2.12.0.dev20260101"),       # ... and after 2.11
    ("2.12.0.dev20260101", "2.12.0a1"),
    ("2.12.0a1", "2.12.0b2"),
    ("2.12.0b2", "2.12.0rc1"),
    ("2.12.0rc1", "2.12.0"),
    ("2.12.0", "2.12.0.post1"),
    ("0.9", "0.26"),                      # numbers, not strings
    ("1.0.29", "1.0.31"),
    ("9.9", "1!0.1"),                     # an epoch outranks the release
])
def test_versions_sort_as_pep_440(older, newer):
    assert version_key(older) < version_key(newer)
    assert is_older(older, newer) is True and is_older(newer, older) is False


@pytest.mark.parametrize("version, same", [
    ("2.11.0+cu130", "2.11"),             # a local suffix (a GPU build) is the same release
    ("2.14.1+cpu", "2.14.1"),
    ("2.11.0", "2.11"),
    ("1.0RC1", "1.0rc1"),
    ("1.0-1", "1.0.post1"),
])
def test_local_suffixes_and_spellings_compare_equal(version, same):
    assert version_key(version) == version_key(same)
    assert is_older(version, same) is False


def test_a_string_that_is_not_a_version_is_not_judged():
    assert version_key("nightly") is None and is_older("nightly", "2.11") is None
    assert check_installed_versions({"torch": "custom", "torchvision": "0.26", "timm": "1.0.29"}, MINIMUMS) is None


def test_an_old_torch_is_one_line_naming_the_pip_command():
    line = check_installed_versions({"torch": "2.9.1", "torchvision": "0.26.0", "timm": "1.0.31"}, MINIMUMS)
    # torchvision pins its torch, so the two are upgraded together
    assert line == ("torch 2.9.1 is older than cnns supports (>=2.11): "
                    "pip install 'torch>=2.11' 'torchvision>=0.26'")


def test_a_cuda_torch_is_told_to_install_a_cuda_build_of_the_same_kind():
    line = check_installed_versions({"torch": "2.9.1+cu126", "torchvision": "0.24.1+cu126", "timm": "1.0.20"},
                                    MINIMUMS)
    assert "\n" not in line
    assert line == ("torch 2.9.1+cu126 is older than cnns supports (>=2.11); "
                    "torchvision 0.24.1+cu126 is older than cnns supports (>=0.26); "
                    "timm 1.0.20 is older than cnns supports (>=1.0.29): "
                    "pip install 'torch>=2.11' 'torchvision>=0.26' --index-url https://download.pytorch.org/whl/cu126"
                    " && pip install 'timm>=1.0.29'")


def test_a_missing_timm_and_the_lowest_supported_stack():
    assert check_installed_versions({"torch": "2.11.0+cu130", "torchvision": "0.26.0+cu130", "timm": None},
                                    MINIMUMS) == "timm is not installed (cnns needs >=1.0.29): pip install 'timm>=1.0.29'"
    # the lowest supported CUDA stack, and a nightly above it, are inside the range
    assert check_installed_versions({"torch": "2.11.0+cu130", "torchvision": "0.26.0+cu130", "timm": "1.0.29"},
                                    MINIMUMS) is None
    assert check_installed_versions({"torch": "2.12.0.dev20260101+cu130", "torchvision": "0.27.0.dev20260101",
                                     "timm": "1.0.29"}, MINIMUMS) is None


def test_this_environment_passes_the_check():
    assert set(supported_minimums()) == {"torch", "torchvision", "timm"}  # else the check below is empty
    assert check_installed_versions() is None


def test_the_minimums_are_pyprojects_from_metadata_and_from_the_source_tree(monkeypatch):
    bounds = pyproject_lower_bounds()
    expected = {name: bounds[name] for name in ("torch", "torchvision", "timm")}
    # The installed metadata is pyproject.toml's as of the last install (`make` reinstalls when it changes).
    assert supported_minimums() == expected

    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(versions.metadata, "requires", not_installed)
    supported_minimums.cache_clear()
    try:
        assert supported_minimums() == expected
    finally:
        supported_minimums.cache_clear()


def test_the_pinned_versions_lie_inside_the_ranges():
    pins = dict(line.split("==") for line in (ROOT / "constraints.txt").read_text().split()
                if "==" in line and not line.startswith("#"))
    bounds = pyproject_lower_bounds()
    assert {"torch", "torchvision", "timm"} <= set(pins) & set(bounds)
    assert [name for name in set(pins) & set(bounds) if is_older(pins[name], bounds[name])] == []


def test_the_command_line_stops_with_the_line_before_running_anything(monkeypatch, capsys):
    real = versions.installed_version
    monkeypatch.setattr(versions, "installed_version", lambda name: "2.9.1" if name == "torch" else real(name))
    assert run_script("train", ["--config", "no-such-config"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: torch 2.9.1 is older than cnns supports (>=") and err.count("\n") == 1
    assert "pip install 'torch>=" in err and "no-such-config" not in err
