"""Every setting is an option recorded in arguments.json (issue 51): no environment switch is read deep in the code.
--threads-per-worker, --dist-timeout, --fused-norm and --no-malloc-tuning replaced CNNS_THREADS, CNNS_DIST_TIMEOUT,
CNNS_FUSED_NORM and CNNS_MALLOC_TUNING; each lands in the run folder and changes what the run does."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch

from processes import free_port
from scripts import train_here

from cnns.cli.parsing import resolve_command_line
from cnns.engine.fusion import _FusedNormAct, _FusedUnit
from cnns.kernels import norm_act as kernels

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "cnns"
RN8 = ["--model", "resnet", "--model-size", "8", "--dataset", "cifar-10", "--micro-batch-size", "4",
       "--iterations", "1", "--generated-data", "--seed", "5", "--precision", "32.32"]
SETTINGS = ["--threads-per-worker", "1", "--dist-timeout", "30", "--fused-norm", "off", "--no-malloc-tuning"]


def _environment_names(tree: ast.AST, constants: dict[str, str]) -> tuple[set[str], set[str]]:
    """(CNNS_ variables `tree` reads from os.environ, those it sets), names resolved through `constants`."""
    def name(node: ast.AST) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        return constants.get(node.id) if isinstance(node, ast.Name) else None

    def is_environ(node: ast.AST) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "environ" or isinstance(node, ast.Name) and node.id == "env"

    reads, writes = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and is_environ(node.value):
            (writes if isinstance(node.ctx, ast.Store) else reads).add(name(node.slice))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args
              and (is_environ(node.func.value) and node.func.attr in ("get", "pop", "setdefault")
                   or node.func.attr == "getenv")):
            reads.add(name(node.args[0]))
        elif isinstance(node, ast.Compare) and any(is_environ(side) for side in node.comparators):
            reads.add(name(node.left))
    return ({n for n in reads if n and n.startswith("CNNS_")}, {n for n in writes if n and n.startswith("CNNS_")})


def environment_use(sources: list[str]) -> tuple[set[str], set[str]]:
    """(CNNS_ variables read, CNNS_ variables set) across the modules `sources`."""
    trees = [ast.parse(source) for source in sources]
    constants = {target.id: node.value.value for tree in trees for node in ast.walk(tree)
                 if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                 and isinstance(node.value.value, str) and node.value.value.startswith("CNNS_")
                 for target in node.targets if isinstance(target, ast.Name)}
    reads, writes = set(), set()
    for tree in trees:
        read, written = _environment_names(tree, constants)
        reads |= read
        writes |= written
    return reads, writes


def test_the_scan_finds_every_way_of_reading_the_environment():
    source = ('import os\nSWITCH = "CNNS_SWITCH"\n'
              'a = os.environ.get("CNNS_A")\nb = os.environ["CNNS_B"]\nc = os.getenv("CNNS_C")\n'
              'd = SWITCH in os.environ\nos.environ["CNNS_OWN"] = "1"\ne = os.environ.pop("CNNS_OWN", None)\n')
    assert environment_use([source]) == ({"CNNS_A", "CNNS_B", "CNNS_C", "CNNS_SWITCH", "CNNS_OWN"}, {"CNNS_OWN"})


def test_no_cnns_environment_variable_is_a_setting():
    """The only CNNS_ variables the package reads are those it sets itself for the workers it starts (the
    launcher's pid, the run folder's lock): a user's setting is an option instead."""
    reads, writes = environment_use([path.read_text() for path in sorted(PACKAGE.rglob("*.py"))])
    assert reads - writes == set(), f"read but never set by cnns (make them options): {sorted(reads - writes)}"


def test_the_settings_land_in_arguments_json_and_print_config(tmp_path, capsys):
    from cnns.cli import run_script

    folder = tmp_path / "run"
    train_here(*RN8, *SETTINGS, "--no-validation", "--logs-path", str(folder))
    recorded = json.loads((folder / "arguments.json").read_text())
    expected = {"threads_per_worker": 1, "dist_timeout": 30.0, "fused_norm": "off", "malloc_tuning": False}
    assert {key: recorded[key] for key in expected} == expected
    capsys.readouterr()
    assert run_script("train", [*RN8, "--print-config"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert {key: printed[key] for key in expected} == {"threads_per_worker": "auto", "dist_timeout": 600.0,
                                                      "fused_norm": "auto", "malloc_tuning": True}


@pytest.mark.skipif(not kernels.available(), reason="the fused kernels are not built")
def test_fused_norm_and_malloc_tuning_change_what_set_up_does(monkeypatch):
    import cnns.engine.build
    from cnns.engine.setup import set_up
    from cnns.parallel.world import World

    opened: list[str] = []

    def no_libc(name):  # records the allocator's tuning without changing this test process's allocator
        opened.append(name)
        raise OSError("not in a test")

    monkeypatch.setattr(cnns.engine.build.ctypes, "CDLL", no_libc)
    fused_counts = {}
    for fused, malloc in (("on", []), ("off", ["--no-malloc-tuning"])):
        opened.clear()
        cfg = resolve_command_line("train", [*RN8, "--fused-norm", fused, *malloc]).config
        model = set_up(cfg, World()).plain_model
        fused_counts[fused] = sum(isinstance(m, (_FusedNormAct, _FusedUnit)) for m in model.modules())
        assert opened == ([] if malloc else ["libc.so.6"])
    # ResNet-8: a stem norm and three units of two norms each, every one fused with what follows it.
    assert fused_counts == {"on": 7, "off": 0}


@pytest.mark.parametrize("threads", ["3", "auto"])
def test_threads_per_worker_and_dist_timeout_reach_a_launched_worker(monkeypatch, threads):
    from cnns.parallel.world import join_world, usable_cores

    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(name, value)
    set_to: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", set_to.append)  # this test process keeps its own threads
    cfg = resolve_command_line("train", [*RN8, "--threads-per-worker", threads, "--dist-timeout", "45"]).config
    world, _ = join_world(cfg, torch.device("cpu"))
    try:
        assert world.timeout_s == 45.0
        assert set_to == [3 if threads == "3" else usable_cores()]  # auto: the cores shared by the one local worker
    finally:
        world.close()


@pytest.mark.parametrize("argv, message", [
    (["--dist-timeout", "0"], "--dist-timeout must be in \\(0, 604800\\]"),
    (["--dist-timeout", "1e300"], "--dist-timeout must be in \\(0, 604800\\]"),
    (["--threads-per-worker", "0"], "--threads-per-worker must be auto or between 1 and 4096, got 0"),
    (["--threads-per-worker", "100000"], "--threads-per-worker must be auto or between 1 and 4096, got 100000"),
])
def test_settings_out_of_range_are_one_line_before_anything_runs(argv, message):
    from cnns.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        resolve_command_line("train", [*RN8, *argv])
