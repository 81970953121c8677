"""A run folder, one concern in one package: what a command writes and reads back of a run.

* `folder`: a run folder made (`open_new_run`) and read back (`RunFolder`, `open_restore_path`, the newest
  restore point)
* `options`: which of a run's options a later command keeps (evaluation, restore, inference_embedded.py)
* `classes`: the class names a run's predictions are read with
* `log`: the printed lines, `training.csv` and `validation.csv`, TensorBoard and W&B (`RunLog`)
* `lock`: one writer per run folder
* `checkpoint`: `ckpt-<iteration>.pt` and the weight averages, written atomically and read back checked
* `plots`: `training.png`
* `files`: the write primitives and what a command may touch, for run folders and every other output

Each module is its own floor (the floor table of docs/architecture.md): `files` is the ground floor every layer writes through,
`folder` sits above the data, models and configuration it reads a run with.
"""
