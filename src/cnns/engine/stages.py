"""A pipelined run's wiring: this process's stage of the model from a RunConfig, and the whole-model
checkpoint assembled from (and dealt back out to) the stages.

A checkpoint of a pipelined run has the single-process layout: the whole model's state dict, the
optimiser's state indexed as one process over the whole model indexes it, the whole moving average.
So it validates, averages and restores at any shard or replica count. Only replica 0's stages are
gathered (the replicas hold the same weights).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from cnns.config import RunConfig
from cnns.engine.recomputation import keep_recomputation
from cnns.errors import ConfigError
from cnns.models import ModelError
from cnns.models.split_points import model_pieces, stage_cuts, stage_pieces
from cnns.optim import parameter_names
from cnns.parallel.pipeline import (StageModule, merge_optimiser_states, optimiser_state_by_index,
                                    optimiser_state_by_name)
from cnns.parallel.world import World
from cnns.precision import PrecisionPolicy


@dataclass
class Stage:
    """This process's stage: the module the schedule runs and torch's PipelineStage around it."""

    module: StageModule
    pipeline_stage: Any  # torch.distributed.pipelining.PipelineStage
    schedule: str  # Grouped / Interleaved / Sequential
    whole_parameter_names: list[str]  # the whole model's, in the optimiser's order
    stage_parameter_names: list[str]


def build_stage(cfg: RunConfig, model: nn.Module, world: World, device: torch.device,
                policy: PrecisionPolicy) -> Stage:
    """Cut the whole, wrapped `model` at the run's --pipeline-splits and keep this process's stage."""
    from cnns.parallel.pipeline_schedules import stage_of  # torch's pipelining: only a run with stages imports it

    splits = list(cfg.parallel.pipeline_splits or [])
    try:
        cuts = stage_cuts(cfg.model, model, splits, world.shards)
    except ModelError as error:
        raise ConfigError(str(error)) from None
    whole_names = parameter_names(model)
    pieces = keep_recomputation(model_pieces(cfg.model, model, cuts), model)
    size = cfg.model.image_size
    example = torch.zeros(1, 3, size, size, dtype=policy.weight_dtype, device=device)
    module, pipeline_stage = stage_of(model, stage_pieces(pieces, cuts), world.stage,
                                      example.contiguous(memory_format=torch.channels_last),
                                      cfg.train.micro_batch_size, world.pipeline_group, device, policy.autocast)
    return Stage(module, pipeline_stage, cfg.parallel.pipeline_schedule, whole_names, parameter_names(module.model))


# ------------------------------------------------------------------------------------------------
# Checkpoints


def _on_host(state: dict[str, Any]) -> dict[str, Any]:
    return {key: value.detach().cpu() if torch.is_tensor(value) else value for key, value in state.items()}


def _optimiser_on_host(state: dict[str, Any]) -> dict[str, Any]:
    return {**state, "state": {k: _on_host(v) for k, v in state["state"].items()}}


def stage_part(stage: Stage, model_state: dict, optimiser_state: dict | None, ema_state: dict | None) -> dict:
    """What a stage of replica 0 contributes to the whole checkpoint, on the host."""
    part = {"model": _on_host(model_state), "ema": _on_host(ema_state) if ema_state is not None else None}
    if optimiser_state is not None:
        inner = optimiser_state_by_name(optimiser_state["inner"], stage.stage_parameter_names)
        part["optimiser"] = {**optimiser_state, "inner": _optimiser_on_host(inner)}
    return part


def whole_from_parts(stage: Stage, parts: list[dict | None]) -> dict[str, Any]:
    """The writer's merge of the gathered stage parts: model, optimiser and average of the whole model."""
    parts = [part for part in parts if part is not None]  # replica 0's stages, in stage order
    whole: dict[str, Any] = {"model": {k: v for part in parts for k, v in part["model"].items()}}
    if parts[0]["ema"] is not None:
        whole["ema"] = {k: v for part in parts for k, v in part["ema"].items()}
    if "optimiser" in parts[0]:
        inner = merge_optimiser_states([part["optimiser"]["inner"] for part in parts])
        whole["optimiser"] = {
            **parts[0]["optimiser"],
            "inner": optimiser_state_by_index(inner, stage.whole_parameter_names),
            # Each stage rounds its own weights with its own generator.
            "rounding_generators_by_stage": [part["optimiser"]["rounding_generator"] for part in parts],
        }
    return whole


def stage_model_state(stage: Stage, whole: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The entries of a whole-model state dict that this stage holds (all of them must be there)."""
    return {key: whole[key] for key in stage.module.model.state_dict()}


def stage_optimiser_state(stage: Stage, whole: dict[str, Any], world: World) -> dict[str, Any]:
    """A whole-model optimiser state dealt out to this stage."""
    by_name = optimiser_state_by_name(whole["inner"], stage.whole_parameter_names)
    state = {**whole, "inner": optimiser_state_by_index(by_name, stage.stage_parameter_names)}
    generators = whole.get("rounding_generators_by_stage")
    if isinstance(generators, list) and len(generators) == world.shards:
        state["rounding_generator"] = generators[world.stage]
    state.pop("rounding_generators_by_stage", None)
    return state
