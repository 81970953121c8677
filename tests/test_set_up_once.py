"""A run is set up once: with two replicas the launcher runs the checks once for the whole run (its workers do
not run them again), restore.py reads its checkpoint once in each process, and validation.py and weight_avg.py
read the run's arguments.json and each checkpoint once in each process.

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
           "cnns.runfolder.checkpoint": ["load_checkpoint"],
           "cnns.runfolder.run_folder": ["read_run_options"],
           "cnns.init_weights": ["read_weight_file"]}

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
                    if args:  # and per file read, by its name
                        counts[_name + " " + os.path.basename(str(args[0]))] += 1
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


def test_validation_and_weight_avg_read_the_run_and_each_checkpoint_once_per_process(tmp_path, counted):
    env, read = counted
    folder = tmp_path / "run"
    scripts.run_child("train.py", *RUN[:RUN.index("--replicas")], *RUN[RUN.index("--replicas") + 2:], "--iterations",
                      "3", "--ckpts-per-epoch", "1000000", "--logs-path", str(folder), cwd=tmp_path, env=env)
    read()
    checkpoints = sorted(path.name for path in folder.glob("ckpt-*.pt"))
    assert checkpoints == ["ckpt-0.pt", "ckpt-1.pt", "ckpt-2.pt", "ckpt-3.pt"]

    scripts.run_child("validation.py", "--restore-path", str(folder), "--replicas", "2", cwd=tmp_path, env=env)
    processes = read()
    assert len(processes) == 3  # the launcher and its two workers
    for process in processes:
        assert process["read_run_options"] == 1
        read_checkpoints = {key.split()[1]: n for key, n in process.items() if key.startswith("load_checkpoint ")}
        assert set(read_checkpoints.values()) <= {1}  # the launcher validates nothing: it reads none
    assert sum(p["load_checkpoint"] for p in processes) == 2 * len(checkpoints)

    scripts.run_child("weight_avg.py", "--restore-path", str(folder), "-N", "2", cwd=tmp_path, env=env)
    [process] = read()
    assert process["read_run_options"] == 1
    assert {key.split()[1]: n for key, n in process.items() if key.startswith("load_checkpoint ")} == {
        "ckpt-2.pt": 1, "ckpt-3.pt": 1, "weight_avg_mean_last2.pt": 1}  # the newest once, the average validated


def test_init_path_is_read_once_per_process_and_let_go_once_in_the_model(tmp_path, counted):
    """--init-path with two replicas: the launcher reads it as a check (and drops it before it waits), each
    worker reads it once; in a process, the file's copy goes once the model holds the weights."""
    import weakref

    import torch

    from cnns.init_weights import InitialWeights

    env, read = counted
    plain = (*RUN[:RUN.index("--replicas")], *RUN[RUN.index("--replicas") + 2:])
    scripts.run_child("train.py", *plain, "--iterations", "1", "--logs-path", str(tmp_path / "first"), cwd=tmp_path,
                      env=env)
    read()
    scripts.run_child("train.py", *RUN, "--iterations", "1", "--init-path", str(tmp_path / "first"), "--logs-path",
                      str(tmp_path / "second"), cwd=tmp_path, env=env)
    processes = read()
    assert len(processes) == 3 and [p["read_weight_file"] for p in processes] == [1, 1, 1]

    model = torch.nn.Linear(3, 2)
    initial = InitialWeights(tmp_path, {"weight": torch.full((2, 3), 0.5), "bias": torch.zeros(2)})
    held = weakref.ref(initial.weights["weight"])
    initial.load_into(model)
    assert torch.equal(model.weight, torch.full((2, 3), 0.5)) and initial.weights == {} and held() is None
