"""The precision policy is the only reader of --precision and --half-dtype (issue 51): every other part asks the
policy (`cnns.precision.PrecisionPolicy`) a named question instead of comparing the option's strings, so that a
precision mode is declared in one place. The scan reads every module of the package with `ast`."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from cnns.precision import PRECISIONS, PrecisionPolicy, describe_precision

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "cnns"
OWNER = PACKAGE / "precision.py"
# The option's raw values, wherever they are read: an attribute (cfg.precision.precision, p.half_dtype), a key
# (o["precision"]) or a lookup (o.get("half_dtype")).
OPTION_NAMES = {"precision", "half_dtype"}
STRING_METHODS = {"startswith", "endswith", "split", "rsplit", "partition", "removeprefix"}


def _reads_the_option(node: ast.AST) -> bool:
    if isinstance(node, ast.Attribute):
        return node.attr in OPTION_NAMES
    if isinstance(node, ast.Subscript):
        return isinstance(node.slice, ast.Constant) and node.slice.value in OPTION_NAMES
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
        return bool(node.args) and isinstance(node.args[0], ast.Constant) and node.args[0].value in OPTION_NAMES
    return False


def _is_string(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


def precision_string_uses(source: str) -> list[tuple[int, str]]:
    """(line, what) for each place `source` spells a precision mode or compares --precision / --half-dtype's string."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and node.value in PRECISIONS:
            found.append((node.lineno, f"the precision {node.value!r} spelled out"))
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(map(_reads_the_option, sides)) and any(map(_is_string, sides)):
                found.append((node.lineno, "an option's string compared"))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in STRING_METHODS and _reads_the_option(node.func.value)):
            found.append((node.lineno, f"an option's string taken apart with {node.func.attr}()"))
    return found


def test_the_scan_finds_each_way_of_reading_a_precision_string():
    bad = ('a = cfg.precision.precision == "32.32"\n'
           'b = p.half_dtype != "float16"\n'
           'c = o["precision"].startswith("16")\n'
           'd = o.get("half_dtype") == "bfloat16"\n'
           'e = replace(p, precision="16.16")\n')
    assert sorted({line for line, _ in precision_string_uses(bad)}) == [1, 2, 3, 4, 5]
    fine = ('a = policy.half_weights\n'
            'b = o.get("half_dtype") is not None\n'
            'c = f"trained in {cfg.precision.describe()}"\n')
    assert precision_string_uses(fine) == []


def test_no_module_but_the_precision_policy_reads_a_precision_string():
    offences = [f"{path.relative_to(PACKAGE.parent)}:{line}: {what}"
                for path in sorted(PACKAGE.rglob("*.py")) if path != OWNER
                for line, what in precision_string_uses(path.read_text())]
    assert offences == [], "ask cnns.precision instead:\n" + "\n".join(offences)


@pytest.mark.parametrize("precision, half, weights, compute, master, scaling", [
    ("32.32", "float16", torch.float32, torch.float32, False, False),
    ("16.32", "bfloat16", torch.float32, torch.bfloat16, True, False),
    ("16.32", "float16", torch.float32, torch.float16, True, True),
    ("16.16", "bfloat16", torch.bfloat16, torch.bfloat16, False, False),
    ("16.16", "float16", torch.float16, torch.float16, False, True),
])
def test_the_policy_answers_the_questions_callers_used_to_ask_of_the_strings(precision, half, weights, compute,
                                                                             master, scaling):
    policy = PrecisionPolicy.resolve(precision, half, torch.device("cpu"), half_dtype_given=True)
    assert (policy.weight_dtype, policy.compute_dtype) == (weights, compute)
    assert policy.half_weights == (weights != torch.float32) and policy.half_compute == (compute != torch.float32)
    assert policy.float32_master is master and policy.needs_loss_scaling is scaling
    inference = policy.for_inference()
    assert inference.weight_dtype == inference.compute_dtype == compute and not inference.use_autocast


def test_describing_a_precision():
    assert describe_precision("32.32", "float16") == "32.32"
    assert describe_precision("16.32", "bfloat16") == "16.32 (bfloat16)"
    cpu = torch.device("cpu")
    assert PrecisionPolicy.resolve("16.32", "float16", cpu).describe() == "float16 compute, float32 master weights"
    assert PrecisionPolicy.resolve("16.16", "bfloat16", cpu).describe() == "bfloat16 weights and compute"
    assert PrecisionPolicy.float32(cpu).describe() == "float32"


def test_the_memory_estimate_counts_what_the_policy_runs_on_this_cpu(monkeypatch):
    """A CPU without bfloat16 arithmetic runs 16.16 in float32 (unless --half-dtype insists): the workers' weights
    take 4 bytes each there, not 2."""
    import cnns.precision
    from cnns.cli.parsing import resolve_command_line
    from cnns.parallel.launch import worker_memory

    run = ["--synthetic-data", "--dataset", "cifar-10", "--model-size", "8", "--micro-batch-size", "8",
           "--iterations", "1", "--no-validation", "--device", "cpu", "--optimiser", "SGD"]
    parameters = 78_042  # ResNet-8 for CIFAR-10; SGD: weights and gradients, two copies

    def estimate(*argv: str):
        return worker_memory(resolve_command_line("train", [*run, *argv]).config)

    monkeypatch.setattr(cnns.precision, "cpu_half_is_emulated", lambda device, half: True)
    fallback, insisted = estimate("--precision", "16.16"), estimate("--precision", "16.16", "--half-dtype", "bfloat16")
    full = estimate("--precision", "32.32")
    assert fallback == full
    assert full.model - insisted.model == pytest.approx(2 * 2 * parameters, rel=0.05)
    assert insisted.activations == full.activations // 2
    monkeypatch.setattr(cnns.precision, "cpu_half_is_emulated", lambda device, half: False)
    assert estimate("--precision", "16.16") == insisted
