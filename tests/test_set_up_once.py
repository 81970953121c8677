"""A run is set up once: with two replicas the launcher runs the checks once for the whole run (its workers do
not run them again), and restore.py reads its checkpoint once in each process.

Counted in the real processes (the launcher and the workers torch's agent starts): a `sitecustomize` on the
children's PYTHONPATH wraps the counted functions as their modules load, and each process writes its counts
when it ends."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import pytest

import scripts

# Module -> functions counted in every process.
COUNTED = {"cnns.commands.checks": ["check_supported", "check_data_before_writing"],
           "cnns.runfolder.checkpoint": ["load_checkpoint"]}

SITECUSTOMIZE = '''
import atexit, collections, importlib.machinery, json, os, sys

COUNTED = {counted!r}
counts = collections.Counter()


class CountingFinder:
    """Wraps each counted function right after its module runs, before any other module imports it by name."""

    def find_spec(self, name, path, target=None):
        if name not in COUNTED:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            for function in COUNTED[name]:
                original = getattr(module, function)

                def counted(*args, _original=original, _name=function, **kwargs):
                    counts[_name] += 1
                    return _original(*args, **kwargs)

                setattr(module, function, counted)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, CountingFinder())
folder = os.environ["COUNTS_FOLDER"]
atexit.register(lambda: open(os.path.join(folder, f"{{os.getpid()}}.json"), "w").write(json.dumps(counts)))
'''

RUN = ("--dataset", "builtin", "--model-size", "8", "--micro-batch-size", "8", "--replicas", "2",
       "--log-freq", "1", "--no-validation", "--seed", "3")


@pytest.fixture
def counted(tmp_path):
    """(the environment that counts calls in every child process, a function reading each process's counts)."""
    hook, counts = tmp_path / "hook", tmp_path / "counts"
    hook.mkdir()
    counts.mkdir()
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE.format(counted=COUNTED))
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")])),
           "COUNTS_FOLDER": str(counts)}

    def read() -> list[Counter]:
        found = [Counter(json.loads(path.read_text())) for path in sorted(counts.glob("*.json"))]
        for path in counts.glob("*.json"):
            path.unlink()
        return found

    return env, read


def test_two_replicas_are_checked_once_and_restore_reads_its_checkpoint_once_per_process(tmp_path, counted):
    env, read = counted
    folder = tmp_path / "run"
    scripts.run_child("train.py", *RUN, "--iterations", "4", "--ckpts-per-epoch", "1000000", "--logs-path",
                      str(folder), cwd=tmp_path, env=env)
    processes = read()
    assert len(processes) == 3  # the launcher and its two workers
    total = sum(processes, Counter())
    assert total["check_supported"] == 1 and total["check_data_before_writing"] == 1

    (folder / "ckpt-4.pt").unlink()  # the run continues from its checkpoint of iteration 3
    scripts.run_child("restore.py", "--restore-path", str(folder), cwd=tmp_path, env=env)
    processes = read()
    assert len(processes) == 3
    assert [p["load_checkpoint"] for p in processes] == [1, 1, 1]  # once in each process
    assert sum(p["check_supported"] for p in processes) == 1
    assert (folder / "ckpt-4.pt").exists()
