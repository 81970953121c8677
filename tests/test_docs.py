"""The user documentation holds together: every relative link in README.md, CHANGELOG.md and docs/*.md names a file
that exists and, with an anchor, a heading that file has (GitHub's anchors); the README stays a landing page; the
recipe log's commands are the runs its table says they are, and the README's headline table quotes it."""

from __future__ import annotations

import json
import re
import shlex
from collections import Counter
from pathlib import Path

import pytest

import scripts

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks (a `#` there is a shell comment, a `[x](y)` is code)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: its text lower-cased, links reduced to their text, every character but
    letters, digits, `_`, `-` and spaces dropped, spaces made hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading's anchor; a repeated one gets -1, -2, ... as on GitHub."""
    seen: Counter[str] = Counter()
    found = set()
    for line in prose_lines(page.read_text()):
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            anchor = github_anchor(heading.group(1))
            found.add(anchor if not seen[anchor] else f"{anchor}-{seen[anchor]}")
            seen[anchor] += 1
    return found


def relative_links(page: Path) -> list[str]:
    return [target for line in prose_lines(page.read_text()) for target in LINK.findall(re.sub(r"`[^`]*`", "", line))
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target)]  # https:, mailto: ... are not checked here


def test_the_anchor_rule_is_github_s():
    assert github_anchor("Replicas: several processes, GPUs or hosts") == "replicas-several-processes-gpus-or-hosts"
    assert github_anchor("The input pipeline alone: `cnns bench-data`") == "the-input-pipeline-alone-cnns-bench-data"
    assert github_anchor("On an AVX-512 CPU (issue 54, 2026-11-28): 0.73x the limit") == \
        "on-an-avx-512-cpu-issue-54-2026-11-28-073x-the-limit"
    assert github_anchor("Graphcore's ImageNet results") == "graphcores-imagenet-results"


def broken_links(pages: list[Path], root: Path) -> list[str]:
    broken = []
    for page in pages:
        for target in relative_links(page):
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                broken.append(f"{page.relative_to(root)}: {target} (no such file)")
            elif anchor and (linked.suffix != ".md" or anchor not in anchors(linked)):
                broken.append(f"{page.relative_to(root)}: {target} (no such heading)")
    return broken


def test_the_link_check_finds_a_missing_file_and_a_missing_heading(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "b.md").write_text("# B page\n\n## Its part: `x`\n")
    page = tmp_path / "a.md"
    page.write_text("[ok](docs/b.md#its-part-x) [top](#a) [gone](docs/c.md) [no heading](docs/b.md#other)\n"
                    "`[in code](nowhere.md)` [web](https://example.org/x.md)\n\n# A\n\n```\n[fenced](nowhere.md)\n```\n")
    assert broken_links([page], tmp_path) == ["a.md: docs/c.md (no such file)", "a.md: docs/b.md#other (no such heading)"]


def test_every_relative_link_and_anchor_resolves():
    assert ROOT / "docs" / "options.md" in PAGES and len(PAGES) >= 10
    broken = broken_links(PAGES, ROOT)
    assert not broken, "\n".join(broken)


def test_the_readme_is_a_landing_page():
    """At most 32 KB; no commit ids or dates (history lives in docs/performance-history.md and CHANGELOG.md); every
    page of docs/ is linked from it."""
    text = (ROOT / "README.md").read_text()
    assert len(text.encode()) <= 32 * 1024
    assert not re.findall(r"\b20\d\d-\d\d-\d\d\b", text)
    assert not [word for word in re.findall(r"\b[0-9a-f]{7,40}\b", text) if re.search(r"[a-f]", word)
                and re.search(r"\d", word)]
    linked = {(ROOT / target.partition("#")[0]).resolve() for target in relative_links(ROOT / "README.md")}
    assert not [page.name for page in (ROOT / "docs").glob("*.md") if page.resolve() not in linked]


def test_the_licence_is_declared_where_tools_read_it():
    """pyproject.toml's SPDX expression is the LICENSE file's licence, and both files ship in the package's metadata;
    NOTICE keeps Graphcore's MIT notice for what is carried from its application."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "BSD-3-Clause" and set(project["license-files"]) == {"LICENSE", "NOTICE"}
    assert (ROOT / "LICENSE").read_text().startswith("BSD 3-Clause License")
    notice = (ROOT / "NOTICE").read_text()
    assert "Copyright (c) 2019 Graphcore Ltd." in notice and "The MIT License" in notice


# ---------------------------------------------------------------------------------------------------------------
# The recipe log

def table(page: Path, first_column: str) -> list[dict[str, str]]:
    """The rows of the markdown table whose first header cell is `first_column`, as dicts by header."""
    lines = prose_lines(page.read_text())
    start = next(i for i, line in enumerate(lines) if re.match(rf"^\|\s*{re.escape(first_column)}\s*\|", line))
    header = [cell.strip() for cell in lines[start].strip("|").split("|")]
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        rows.append(dict(zip(header, cells)))
    return rows


def make_train_command() -> list[str]:
    """What `make train` runs once the venv is there: the Makefile's own recipe line."""
    makefile = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^train: .*\n\t\$\(PY\) (.*)$", makefile, re.MULTILINE)
    assert recipe, "the Makefile has no train target running $(PY) ..."
    return shlex.split(recipe.group(1))


def recipe_argv(cell: str) -> list[str]:
    command = re.fullmatch(r"`([^`]*)`", cell)
    assert command, f"a recipe's command is one code span: {cell}"
    words = shlex.split(command.group(1))
    if words == ["make", "train"]:
        return make_train_command()
    assert words[:2] == ["python3", "train.py"], words
    return words[1:]


RECIPES = table(ROOT / "docs" / "recipes.md", "recipe")


def test_the_recipe_table_has_the_runs_the_issue_asks_for():
    names = [row["recipe"] for row in RECIPES]
    assert {"quick start", "digits", "Fashion-MNIST"} <= set(names)
    for row in RECIPES:
        if row["top-1"] != "pending":
            assert re.fullmatch(r"\d+\.\d %", row["top-1"]), row
            assert "AMD EPYC" in row["hardware"] or "GPU" in row["hardware"], row


@pytest.mark.parametrize("row", [row for row in RECIPES if row["command"].startswith("`")],
                         ids=lambda row: row["recipe"])
def test_each_recipe_command_resolves_to_the_run_its_row_describes(row, capfd):
    """The command, given --print-config (which reads no data), is the model, epochs and precision of its row."""
    script, *argv = recipe_argv(row["command"])
    assert script == "train.py"
    printed = json.loads(scripts.run_here(capfd, "train.py", *argv, "--print-config", cwd=ROOT).stdout)
    family, size = re.fullmatch(r"(ResNet|ResNeXt|EfficientNet)-(\w+)", row["model"].split(",")[0]).groups()
    assert (printed["model"], str(printed["model_size"])) == (family.lower(), size)
    assert printed["epochs"] == int(row["epochs"])
    assert printed["precision"] == row["model"].split(", ")[1]


def test_the_readme_quotes_the_recipe_log():
    """The README's headline rows hold the recipe log's figures, recipe by recipe."""
    logged = {row["recipe"]: row for row in RECIPES}
    quoted = table(ROOT / "README.md", "recipe")
    assert quoted and {row["recipe"] for row in quoted} <= set(logged)
    for row in quoted:
        assert (row["top-1"], row["epochs"], row["model"]) == \
               (logged[row["recipe"]]["top-1"], logged[row["recipe"]]["epochs"], logged[row["recipe"]]["model"]), row
        assert row["wall time (CPU time)"] == logged[row["recipe"]]["wall time (CPU time)"], row
