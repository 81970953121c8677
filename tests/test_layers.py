"""The package reads top to bottom: no import circles, and nothing below the command line imports it.

Every `import` and `from ... import` of a `cnns` module anywhere in a file counts, at module level
or inside a function: an import deferred to call time is still a dependency, and a circle through
one still means neither module can be understood without the other. Read with the standard
library's `ast`, so the check needs no import of the package.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "cnns"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imported_modules(path: Path) -> list[tuple[str, int]]:
    """(cnns module, line) for every import of one: `from a.b import c` is a.b.c when c is a module,
    else a.b."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:  # `import cnns.a.b` names cnns.a.b; a name inside it
                target = target.rpartition(".")[0]
            if target and target != name:
                found.append((target, node.lineno))
    return found


GRAPH = {name: imported_modules(path) for name, path in MODULES.items()}


def cycles(graph: dict[str, list[tuple[str, int]]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target, _ in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_graph_is_read_from_every_module():
    # Guards the reader itself: a parser that found nothing would pass every check below.
    assert {"cnns.cli", "cnns.cli.runs", "cnns.runfolder.run_folder", "cnns.commands.train", "cnns.engine.setup"} <= set(GRAPH)
    assert any(target == "cnns.cli.parsing" for target, _ in GRAPH["cnns.cli"])
    assert any(target == "cnns.runfolder.run_folder" for target, _ in GRAPH["cnns.deploy.restored_model"])
    assert sum(len(edges) for edges in GRAPH.values()) > 150


def test_no_import_circles():
    found = cycles(GRAPH)
    lines = []
    for component in found:
        members = set(component)
        for name in component:
            for target, line in GRAPH[name]:
                if target in members:
                    lines.append(f"{MODULES[name].relative_to(SRC.parent)}:{line} imports {target}")
    assert not found, "import circles:\n" + "\n".join(lines)


def test_nothing_below_the_command_line_imports_it():
    upward = [f"{MODULES[name].relative_to(SRC.parent)}:{line} imports {target}"
              for name, edges in GRAPH.items() if not (name == "cnns.cli" or name.startswith("cnns.cli."))
              and name != "cnns.__main__"
              for target, line in edges if target == "cnns.cli" or target.startswith("cnns.cli.")]
    assert not upward, "imports of cnns.cli from below it:\n" + "\n".join(upward)


def test_the_cycle_finder_finds_a_circle_and_names_its_members():
    graph = {"a": [("b", 1)], "b": [("c", 2)], "c": [("a", 3), ("d", 4)], "d": []}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": [("b", 1)], "b": []}) == []


def test_layers_named_in_the_readme_hold():
    """The floor table of docs/architecture.md, as code: each folder may import only the layers below it."""
    below = {
        "cnns.cli": None,  # the top floor: anything
        "cnns.commands": {"cnns.bench", "cnns.deploy", "cnns.engine", "cnns.runfolder.run_folder", "cnns.runfolder.classes", "cnns.init_weights", "cnns.parallel", "cnns.data",
                          "cnns.models", "cnns.config", "cnns.devices", "cnns.precision", "cnns.runfolder.checkpoint",
                          "cnns.runfolder.log", "cnns.runfolder.lock", "cnns.profiling", "cnns.errors", "cnns.commands"},
        "cnns.bench": {"cnns.deploy", "cnns.engine", "cnns.runfolder.run_folder", "cnns.init_weights", "cnns.parallel", "cnns.data", "cnns.models",
                       "cnns.config", "cnns.devices", "cnns.precision", "cnns.runfolder.checkpoint", "cnns.runfolder.log",
                       "cnns.kernels", "cnns.profiling", "cnns.errors", "cnns.bench"},
        "cnns.deploy": {"cnns.engine", "cnns.runfolder.run_folder", "cnns.parallel", "cnns.data", "cnns.models", "cnns.config",
                        "cnns.precision", "cnns.runfolder.checkpoint", "cnns.errors", "cnns.deploy"},
        "cnns.engine": {"cnns.runfolder.run_folder", "cnns.init_weights", "cnns.parallel", "cnns.data", "cnns.models", "cnns.kernels",
                        "cnns.config", "cnns.devices", "cnns.precision", "cnns.optim", "cnns.stochastic_rounding",
                        "cnns.lr_schedules",
                        "cnns.runfolder.checkpoint", "cnns.runfolder.log", "cnns.runfolder.plots", "cnns.profiling", "cnns.errors", "cnns.engine"},
        "cnns.runfolder.options": {"cnns.runfolder.run_folder", "cnns.config", "cnns.errors"},
        "cnns.runfolder.classes": {"cnns.data", "cnns.config", "cnns.errors"},
        "cnns.runfolder": {"cnns.errors"},
        "cnns.runfolder.run_folder": {"cnns.data", "cnns.models", "cnns.config", "cnns.runfolder.classes",
                                  "cnns.runfolder.checkpoint", "cnns.runfolder.log", "cnns.runfolder.lock",
                      "cnns.errors"},
        "cnns.init_weights": {"cnns.models", "cnns.runfolder.checkpoint", "cnns.errors"},
        "cnns.parallel": {"cnns.models", "cnns.config", "cnns.devices", "cnns.precision", "cnns.optim", "cnns.errors",
                          "cnns.parallel"},
        "cnns.config": {"cnns.data", "cnns.models", "cnns.devices", "cnns.precision", "cnns.optim", "cnns.errors",
                        "cnns.config"},
        "cnns.data": {"cnns.devices", "cnns.errors", "cnns.data", "cnns.kernels"},
        "cnns.models": {"cnns.errors", "cnns.models"},
        **{leaf: {"cnns.errors", leaf} for leaf in ("cnns.precision", "cnns.devices", "cnns.versions",
                                                  "cnns.lr_schedules", "cnns.runfolder.checkpoint", "cnns.runfolder.log", "cnns.runfolder.plots",
                                                  "cnns.profiling", "cnns.runfolder.lock")},
        "cnns.optim": {"cnns.errors", "cnns.kernels", "cnns.stochastic_rounding", "cnns.optim"},
        "cnns.stochastic_rounding": {"cnns.errors", "cnns.kernels", "cnns.stochastic_rounding"},
        "cnns.kernels": {"cnns.errors", "cnns.profiling", "cnns.kernels"},
    }

    # cnns.safe_writes (the write primitives) and cnns.bounded_reads (the bounded reads) are the ground floor with cnns.errors:
    # every floor writes and reads what it did not make through them.
    for allowed in below.values():
        if allowed is not None:
            allowed.update({"cnns.safe_writes", "cnns.bounded_reads"})
    below["cnns.safe_writes"] = {"cnns.errors", "cnns.safe_writes"}
    below["cnns.bounded_reads"] = {"cnns.errors", "cnns.bounded_reads"}

    def layer(module: str) -> str:
        """A top-level module or package of cnns; in cnns.runfolder, whose modules stand on several floors (its
        files are the ground floor, its folder reads runs with the configuration), each module."""
        parts = module.split(".")
        return ".".join(parts[:3] if parts[1:2] == ["runfolder"] and len(parts) > 2 else parts[:2])

    missing = {layer(name) for name in GRAPH if name.count(".") >= 1} - set(below) - {"cnns.__main__", "cnns.errors"}
    assert not missing, f"layers missing from the table: {sorted(missing)}"

    wrong = []
    for name, edges in GRAPH.items():
        allowed = below.get(layer(name))
        if allowed is None:
            continue
        wrong += [f"{MODULES[name].relative_to(SRC.parent)}:{line} imports {target}"
                  for target, line in edges if layer(target) not in allowed]
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


def test_only_the_command_line_imports_the_benchmarks():
    """bench/ is a leaf: the training path never reaches it, only `cnns benchmark` and its kin (and train.py's
    --dataset-benchmark, a command of its own) do."""
    wrong = [f"{MODULES[name].relative_to(SRC.parent)}:{line} imports {target}"
             for name, edges in GRAPH.items() if not name.startswith(("cnns.cli", "cnns.commands", "cnns.bench"))
             for target, line in edges if target.startswith("cnns.bench")]
    assert not wrong, "imports of cnns.bench outside the command line:\n" + "\n".join(wrong)


def test_the_engine_reads_no_raw_options():
    """Below the commands, code reads the typed RunConfig; its flat `arguments` are only written (arguments.json,
    W&B) and compared between processes."""
    allowed = {"cnns.runfolder.run_folder", "cnns.runfolder.log", "cnns.parallel.world"}
    readers = []
    for name, path in MODULES.items():
        if name.startswith(("cnns.cli", "cnns.commands", "cnns.config")) or name in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr in ("arguments", "options") and \
                    isinstance(node.value, ast.Name) and node.value.id == "cfg":
                readers.append(f"{MODULES[name].relative_to(SRC.parent)}:{node.lineno} reads cfg.{node.attr}")
    assert not readers, "raw options read below the commands:\n" + "\n".join(readers)
