"""The README's claims about the suite: every test it names as the proof of a row exists."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def defined_tests(path: Path) -> set[str]:
    return {node.name for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}


def test_every_test_the_readme_names_exists():
    named = set(re.findall(r"`?(test_\w+\.py)::(test_\w+)", (ROOT / "README.md").read_text()))
    assert len(named) > 50  # the option table's column, at least
    missing = sorted(f"{file}::{name}" for file, name in named
                     if not (ROOT / "tests" / file).is_file() or name not in defined_tests(ROOT / "tests" / file))
    assert not missing, f"the README names tests that do not exist: {missing}"
