"""Which of a run's options a later command keeps, and which of its own command line's values override them:

* **evaluation** (`evaluation_options`: validation.py, weight_avg.py, predict, export): the run's options
  overridden by every value the command line gives; one unpipelined process (replicas, shards, pipeline and
  recomputation reset) unless the command line asks for replicas; the training run's global batch size kept (it
  places a checkpoint in epochs) unless ``--global-batch-size``.
* **restore** (`restore_options`: restore.py): the run's options exactly, except the pipeline layout
  (``--shards``, ``--pipeline-splits``, ``--pipeline-schedule``), which may change because checkpoints hold the
  whole model and pipelines compute the same updates at any stage count, and the sinks ``--no-wandb`` and
  ``--no-tensorboard`` leave out.
* Neither keeps the options that say where the first command wrote outside its run folder (`COMMAND_OWN_PLACES`:
  ``--profile-dir``): a later command writes in the run folder or where its own command line says.
* **inference_embedded.py** (`inference_run_options`): the run's model, dataset and precision under the command
  line's values; the rest (generated images, one process) is its own. **cnns benchmark** takes no run folder.

This module sits below `cli/` (which parses argv into the values these rules take) and above the run folder read
back (`cnns.runfolder.run_folder`) and the configuration's own rules (`cnns.config`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cnns.config import check_domains, resolve
from cnns.config.defaults import stages_compile
from cnns.errors import ConfigError
from cnns.runfolder.run_folder import RestoreTarget, RunFolder, open_restore_path

# Options that name where the command that was given them writes: a later command on the run (restore.py,
# validation.py, weight_avg.py) writes in the run folder, or where its own command line says, never where the run's
# arguments.json names (an old absolute path, or one relative to where the run was started).
COMMAND_OWN_PLACES = ("profile_dir",)

# Flags whose parser default is False: a False there cannot be told apart from "not given".
_FALSE_BY_DEFAULT = {"generated_data", "synthetic_data", "print_config", "dataset_benchmark", "force_recompile"}


def evaluation_options(values: dict[str, Any], run: RestoreTarget | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """validation.py / weight_avg.py / predict / export: the command line's values over the arguments.json of
    `run` (`open_run`, read once by the caller), for one process.

    `values` are the values of a parser of Graphcore's scripts (None where not given). Returns (resolved options, the
    run's arguments.json or {}). As in Graphcore's application, the training run's global batch size is kept (it
    places a checkpoint in epochs) unless --global-batch-size says otherwise.
    """
    base = _options_of_the_run(run)
    explicit = _given(values)
    merged = {**base, **explicit}
    if "half_dtype" in explicit and "half_dtype_given" not in explicit:  # not the device's default
        merged["half_dtype_given"] = True
    for key in ("replicas", "shards"):
        if key not in explicit:
            merged[key] = 1  # validation runs on one unpipelined process whatever training used
    if "replicas" not in explicit and "BN_span" not in explicit:
        merged["BN_span"] = 1  # evaluation uses the running statistics: no batch statistics to span
    merged["pipeline"] = False
    merged["pipeline_splits"] = None
    merged["enable_recomputation"] = False
    options = resolve({**values, **merged})
    if options.get("seed") is None:
        options["seed"] = 0
    if values.get("global_batch_size"):
        options["global_batch_size"] = values["global_batch_size"]
    elif "global_batch_size" in base:
        options["global_batch_size"] = base["global_batch_size"]
    return options, base


# What inference_embedded.py keeps of a run: what its checkpoint holds and how the model's inputs are scaled.
# The rest (data files, run length, parallelism) is the command line's: it times generated images in one process.
_MODEL_OPTIONS = ("model", "model_size", "num_classes", "dataset", "image_size", "group_norm", "groups", "group_dim",
                  "expand_ratio", "convolution_groups", "normalise_input", "precision", "half_dtype",
                  "half_dtype_given", "micro_batch_size")


def inference_run_options(values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """inference_embedded.py: (the command line's values over the model options of the run --restore-path
    names, those of the run's options it kept), so that a run's checkpoint is loaded into the run's model."""
    run = {key: value for key, value in _options_of_the_run(open_run(values)).items() if key in _MODEL_OPTIONS}
    given = _given(values)
    merged = {**values, **run, **given}
    if "half_dtype" in given and run:  # the command line's half type, not the device's default
        merged["half_dtype_given"] = True
    return merged, run


def open_run(values: dict[str, Any]) -> RestoreTarget | None:
    """The run --restore-path names, its arguments.json read (None without one; one line for a path that is not a
    run): opened once per process by the command line, which hands it to the command. --print-config with a path
    that names nothing shows the command line's own options: Graphcore's documented command lines name placeholder
    folders (`--restore-path generated_checkpoints_dir_path`)."""
    if not values.get("restore_path"):
        return None
    if values.get("print_config") and not Path(values["restore_path"]).exists():
        return None
    return open_restore_path(values["restore_path"])


def _options_of_the_run(run: RestoreTarget | None) -> dict[str, Any]:
    """The run's arguments.json, without its name ({} without a run)."""
    if run is None:
        return {}
    options = dict(run.run.options)
    for key in ("name", *COMMAND_OWN_PLACES):
        options.pop(key, None)
    return options


def _given(values: dict[str, Any]) -> dict[str, Any]:
    """The values a command line gave (argparse's None is "not given", and so is a flag's default False)."""
    return {k: v for k, v in values.items() if v is not None and not (v is False and k in _FALSE_BY_DEFAULT)}


def restore_options(run: RunFolder, values: dict[str, Any]) -> dict[str, Any]:
    """restore.py: the run's options with the stage layout its command line gives (`values`):
    checkpoints hold the whole model, and pipelines compute the same updates whatever the stage
    count, so a run continues on more or fewer devices."""
    options = {key: value for key, value in run.options.items() if key not in COMMAND_OWN_PLACES}
    options.update({sink: False for sink in ("wandb", "tensorboard") if values.get(sink) is False})  # --no-wandb ...
    check_domains(values)  # the new layout's --shards, as every option's value is checked
    if values.get("shards") is None and values.get("pipeline_splits") is None and not values.get("pipeline_schedule"):
        return options
    if values.get("pipeline_schedule"):
        options["pipeline_schedule"] = values["pipeline_schedule"]
    if values.get("shards") is not None:
        options["shards"] = values["shards"]
        options["pipeline_splits"] = values.get("pipeline_splits") if values["shards"] > 1 else None
        options["pipeline"] = options["pipeline"] or values["shards"] > 1
    elif values.get("pipeline_splits") is not None:
        options["pipeline_splits"] = values["pipeline_splits"]
    if options["shards"] > 1 and not options.get("pipeline_splits"):
        raise ConfigError(f"--shards {options['shards']} needs --pipeline-splits")
    if not stages_compile(options["shards"]):
        options["compile"] = False
    return options  # the splits are checked against the model by the restore command
