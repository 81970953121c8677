"""The documentation's claims about the suite: every test the README or a docs page names as the proof of a claim exists
(docs/options.md names one for each option), and the figures docs/outputs.md gives are the cadence's."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NAMED = re.compile(r"`?(test_\w+\.py)::(test_\w+)")


def defined_tests(path: Path) -> set[str]:
    return {node.name for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}


def test_every_test_the_documentation_names_exists():
    assert len(set(NAMED.findall((ROOT / "docs" / "options.md").read_text()))) > 50  # the option table's column
    missing = sorted(f"{page.relative_to(ROOT)}: {file}::{name}" for page in PAGES
                     for file, name in set(NAMED.findall(page.read_text()))
                     if not (ROOT / "tests" / file).is_file() or name not in defined_tests(ROOT / "tests" / file))
    assert not missing, f"the documentation names tests that do not exist: {missing}"


def test_the_default_cifar10_checkpoints_docs_outputs_gives_are_the_cadence_s():
    """"a default CIFAR-10 run (1,562 updates an epoch) saves at 1,562, 3,124, ...": the figures docs/outputs.md gives,
    against the run length the defaults resolve to for CIFAR-10's 50,000 training images."""
    from cnns.config import RunConfig, resolve
    from cnns.config.table import option_defaults
    from cnns.engine.cadence import RunLength

    said = re.search(r"a default CIFAR-10\s+run \(([\d,]+) updates an epoch\) saves at ([\d,]+), ([\d,]+),",
                     (ROOT / "docs" / "outputs.md").read_text())
    assert said, "docs/outputs.md no longer states the default CIFAR-10 checkpoints"
    per_epoch, first, second = (int(text.replace(",", "")) for text in said.groups())
    options = resolve({**option_defaults("train"), "dataset": "cifar-10", "synthetic_data": True, "seed": 1})
    length = RunLength.resolve(RunConfig.from_options(options), 50_000)
    assert length.iterations_per_epoch == per_epoch
    assert [p for p in range(1, second + 1) if length.checkpoint_due(p)] == [first, second]
