"""One file per script of Graphcore's application and per tool: what each does with its resolved, frozen configuration.

| script or command                                                        | file           |
|--------------------------------------------------------------------------|----------------|
| train.py, `cnns train`                                                   | `train.py`     |
| restore.py, `cnns restore`                                               | `restore.py`   |
| validation.py, `cnns validate`                                           | `validate.py`  |
| weight_avg.py, `cnns weight-avg`                                         | `weight_avg.py`|
| inference_embedded.py, `cnns infer`                                      | `infer.py`     |
| `cnns predict`                                                           | `predict.py`   |
| `cnns export`                                                            | `export.py`    |
| `cnns benchmark`, `cnns profile`, `cnns bench-data`, train.py --dataset-benchmark | `benchmark.py` |
| `cnns splits`                                                            | `splits.py`    |

`checks.py` holds the checks every command makes before it writes anything. `cnns.cli` parses and resolves
the command line and calls one function here; the machinery these use lives in `cnns.engine` (step, loop,
feed, evaluation, wrappers) and `cnns.parallel` (processes, replicas, stages). Nothing below imports this.
"""
