"""The torch, torchvision and timm versions cnns supports, and one line when an installed one is older.

pyproject.toml is the only place the minimums are written: they are read back from the installed
distribution's requirements (`importlib.metadata.requires("cnns")`), or, from a source tree that was
never installed, from pyproject.toml beside it. A GPU machine keeps its own CUDA build of torch
(`pip install -e .` with ranges, or `--no-deps`), so what is installed may be anything; the command
line checks it once before a command runs and names what to run instead of failing deep inside.

Versions are compared and requirement lines read by `packaging`, pip's own library (a dependency of timm's
huggingface_hub, declared in pyproject.toml too); local suffixes are ignored (2.11.0+cu130 is 2.11.0) and a
pre-release comes before its release (2.12.0.dev20260101 < 2.12.0 but > 2.11), as pip orders them.
"""

from __future__ import annotations

import re
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Mapping

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

CHECKED = ("torch", "torchvision", "timm")


def version_key(version: str) -> Version | None:
    """The public version (its local suffix dropped), ordered as pip orders them, or None for a string that is
    not a version."""
    try:
        return Version(Version(version).public)
    except InvalidVersion:
        return None


def is_older(installed: str, minimum: str) -> bool | None:
    """Whether `installed` sorts before `minimum`; None when either is not a version (nothing to say)."""
    have, need = version_key(installed), version_key(minimum)
    if have is None or need is None:
        return None
    return have < need


def _minimums_from(requirements: list[str]) -> dict[str, str]:
    """{name: lower bound} of the checked packages among requirement lines (an extra's lines excluded)."""
    found = {}
    for line in requirements:
        try:
            requirement = Requirement(line)
        except InvalidRequirement:
            continue
        if requirement.marker is not None and "extra" in str(requirement.marker):
            continue
        name = canonicalize_name(requirement.name)
        bounds = [spec.version for spec in requirement.specifier if spec.operator == ">="]
        if name in CHECKED and bounds:
            found[name] = bounds[0]
    return found


def _pyproject_requirements() -> list[str]:
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    try:
        import tomllib  # Python 3.11+; a never-installed tree on 3.10 goes unchecked
    except ImportError:
        return []
    try:
        return list(tomllib.loads(pyproject.read_text())["project"]["dependencies"])
    except (OSError, KeyError, ValueError):
        return []


@lru_cache(maxsize=1)
def supported_minimums() -> dict[str, str]:
    """{'torch': '2.11', 'torchvision': '0.26', 'timm': '1.0.29'}: pyproject.toml's lower bounds, as
    installed; empty when neither the metadata nor pyproject.toml can be read (then nothing is checked)."""
    try:
        requirements = metadata.requires("cnns") or []
    except metadata.PackageNotFoundError:
        requirements = _pyproject_requirements()
    return _minimums_from(requirements)


def installed_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _index_url(version: str | None) -> str | None:
    """PyTorch's wheel index for the build an installed torch is (2.11.0+cu130 -> .../whl/cu130), so
    that the command keeps a CUDA (or ROCm, XPU, CPU-only) build the same kind."""
    local = version.partition("+")[2].lower() if version else ""
    if re.fullmatch(r"cu\d+|rocm\d+(?:\.\d+)*|xpu|cpu", local):
        return f"https://download.pytorch.org/whl/{local}"
    return None


def check_installed_versions(installed: Mapping[str, str | None] | None = None,
                             minimums: Mapping[str, str] | None = None) -> str | None:
    """None when torch, torchvision and timm are new enough, else one line naming each that is not
    (older or missing) and the pip command that fixes it. `installed` and `minimums` default to this
    environment's and pyproject.toml's."""
    minimums = supported_minimums() if minimums is None else minimums

    def have_of(name: str) -> str | None:
        return installed_version(name) if installed is None else installed.get(name)

    problems, torch_family, others = [], [], []
    for name in CHECKED:
        if name not in minimums:
            continue
        have, need = have_of(name), minimums[name]
        if have is None:
            problems.append(f"{name} is not installed (cnns needs >={need})")
        elif is_older(have, need):
            problems.append(f"{name} {have} is older than cnns supports (>={need})")
        else:
            continue
        (others if name == "timm" else torch_family).append(name)
    if not problems:
        return None
    if torch_family:
        # torchvision pins the torch it was built for: upgrade the two together, so that pip picks a
        # matching pair (from the same index) instead of leaving one behind or replacing the CUDA torch.
        torch_family = [f"'{name}>={minimums[name]}'" for name in ("torch", "torchvision") if name in minimums]
    others = [f"'{name}>={minimums[name]}'" for name in others]
    commands = []
    if torch_family:
        index_url = _index_url(have_of("torch")) or _index_url(have_of("torchvision"))
        commands.append("pip install " + " ".join(torch_family) + (f" --index-url {index_url}" if index_url else ""))
    if others:
        commands.append("pip install " + " ".join(others))
    return "; ".join(problems) + ": " + " && ".join(commands)
