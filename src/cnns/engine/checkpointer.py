"""What a checkpoint holds, and how replicas and pipeline stages write and restore it: one place.

A checkpoint holds everything a continuation needs to be exact: the plain model (its keys those of a
single-process run, whatever the replicas, stages or compilation), the optimiser (with its stochastic-rounding
generator; a sharded optimiser's state consolidated first), the loss scaler, every random stream (each rank's
with replicas), the moving average of the weights, the iteration (which fixes the data position and the
learning rate) and the random seed. Every process calls `save`: the replicas average their batch-norm statistics, the
stages send their parts to rank 0, and rank 0 (with --ckpt-all-instances every unpipelined rank) writes.
A checkpoint of weights that are NaN or Inf is never written: the run has diverged (`cnns.engine.loop.Diverged`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from cnns.engine.assembly import unwrap
from cnns.engine.loop import Diverged
from cnns.engine.stages import stage_model_state, stage_optimiser_state, stage_part, whole_from_parts
from cnns.errors import CheckpointError, CnnsError
from cnns.parallel.replicas import average_running_statistics
from cnns.parallel.world import World
from cnns.runfolder.checkpoint import capture_rng_state, checkpoint_path, restore_rng_state, save_checkpoint
from cnns.runfolder.run_folder import RestorePoint
from cnns.runfolder.log import RunLog


class Checkpointer:
    """Saves and restores one training run's state in `folder` (another rank's own `instance_folder` with
    --ckpt-all-instances). `setup` is the run as `cnns.engine.setup.set_up` made it for training (its model,
    optimiser, loss scaler, moving average and random streams)."""

    def __init__(self, setup, log: RunLog, folder: Path, instance_folder: Path | None,
                 global_batch_size: int, every_instance: bool, sharded_optimiser: bool):
        self.setup, self.log = setup, log
        self.world: World = setup.world
        self.folder, self.instance_folder = folder, instance_folder
        self.global_batch_size = global_batch_size
        self.every_instance = every_instance  # --ckpt-all-instances
        self.sharded_optimiser = sharded_optimiser  # --rts: the whole optimiser state is on rank 0 only
        self.last_saved: Path | None = None  # the newest checkpoint of the run (written or restored)

    def save(self, iteration: int) -> None:
        """Called by every process: the weights checked finite (everywhere, or nothing is written), a sharded
        optimiser's state and every rank's random streams gathered; rank 0 (and with --ckpt-all-instances every
        rank) writes."""
        world, setup = self.world, self.setup
        self._refuse_non_finite_weights(iteration)
        average_running_statistics(setup.plain_model, world)  # every replica saves the same model
        setup.optimiser.consolidate()
        rng = capture_rng_state(setup.generators)
        every_rng = world.gather(rng) if world.distributed else None
        stage_parts = self._gather_stages() if setup.stage is not None else None
        if world.is_writer:
            start = time.perf_counter()
            state = self._state(iteration, rng, with_optimiser=stage_parts is None)
            if stage_parts is not None:  # the whole model, optimiser and average from the stages
                state.update(whole_from_parts(setup.stage, stage_parts))
            if every_rng is not None:
                state["rng_by_rank"] = every_rng
            path = checkpoint_path(self.folder, iteration)
            save_checkpoint(path, state)
            self.last_saved = path
            if iteration == 0:
                self.log.print(f"Saved initial checkpoint to {path}")
            else:
                self.log.print(f"Saved checkpoint to {path} in {time.perf_counter() - start:.3f}s")
        elif self.every_instance and self.instance_folder is not None and setup.stage is None:
            # A sharded optimiser's whole state exists on rank 0 only.
            state = self._state(iteration, rng, with_optimiser=not self.sharded_optimiser)
            save_checkpoint(checkpoint_path(self.instance_folder, iteration), state)
        if not world.is_writer:
            self.last_saved = checkpoint_path(self.folder, iteration)  # what the writer wrote

    def _refuse_non_finite_weights(self, iteration: int) -> None:
        """Every process checks what it holds of the model (a stage its part) in one read-back, which the
        checkpoint's own copy to the host would make anyway, and all agree before anything is written."""
        floats = [t for t in self.setup.plain_model.state_dict().values() if t.is_floating_point()]
        finite = bool(torch.stack([torch.isfinite(t).all() for t in floats]).all()) if floats else True
        if not self.world.any(not finite):
            return
        if iteration == 0:
            raise CnnsError("the initial weights hold NaN or Inf values: no checkpoint written")
        raise Diverged(iteration, "the weights after it are NaN or Inf")

    def _gather_stages(self) -> list | None:
        """Replica 0's stages send their parts of the model, optimiser and average to the writer."""
        setup, part = self.setup, None
        if self.world.replica_rank == 0:  # (a sharded optimiser's state is whole there only)
            part = stage_part(setup.stage, setup.plain_model.state_dict(), setup.optimiser.state_dict(),
                              setup.ema.state_dict() if setup.ema is not None else None)
        return self.world.gather_to_writer(part)

    def _state(self, iteration: int, rng: dict[str, Any], with_optimiser: bool) -> dict[str, Any]:
        setup = self.setup
        state = {
            "model": unwrap(setup.model).state_dict(),
            "loss_scaler": setup.scaler.state_dict(),
            "rng": rng,
            "iteration": iteration,
            "epoch": self.epoch_of(iteration),
            "seed": setup.seed,
            "replicas": self.world.replicas,
        }
        if with_optimiser:
            state["optimiser"] = setup.optimiser.state_dict()
        if setup.ema is not None:
            state["ema"] = setup.ema.state_dict()
        return state

    def epoch_of(self, iteration: int) -> float:
        return self.global_batch_size * iteration / self.setup.sources.train.num_samples

    def restore(self, restore: RestorePoint) -> tuple[int, list[str]]:
        """The checkpoint's state in place: (its iteration, the notices of what could not be carried)."""
        state, path = restore.state, restore.path
        setup = self.setup
        self.last_saved = path
        if "seed" in state and int(state["seed"]) != setup.seed:
            raise CheckpointError(f"{path} was written with seed {int(state['seed'])}, but this run's "
                                  f"arguments.json says {setup.seed}: it belongs to another run")
        try:
            model, optimiser = state["model"], state["optimiser"]
            ema = state["ema"] if setup.ema is not None else None
            if setup.stage is not None:  # a whole-model checkpoint dealt out to this stage
                model = stage_model_state(setup.stage, model)
                optimiser = stage_optimiser_state(setup.stage, optimiser, self.world)
                ema = stage_model_state(setup.stage, ema) if ema is not None else None
            unwrap(setup.model).load_state_dict(model)
            setup.optimiser.load_state_dict(optimiser)
            setup.scaler.load_state_dict(state["loss_scaler"])
            notes = restore_rng_state(_rng_of_this_process(state, self.world), setup.generators)
            if setup.optimiser.streams_restarted:
                notes.append("the stochastic-rounding stream was written on another kind of device: it "
                             "continues from a seed derived from it (the run is no longer bitwise repeatable)")
            if ema is not None:
                setup.ema.load_state_dict(ema)
            return int(state["iteration"]), notes
        except (KeyError, RuntimeError, ValueError, TypeError) as exc:
            reason = f"no {exc.args[0]!r} entry" if isinstance(exc, KeyError) else str(exc).splitlines()[0][:200]
            raise CheckpointError(f"{path} does not match this run's model or optimiser: {reason}") from None



def _rng_of_this_process(state: dict[str, Any], world: World) -> dict[str, Any]:
    """This rank's random streams when the checkpoint was written by as many processes, else rank 0's."""
    every = state.get("rng_by_rank")
    if isinstance(every, list) and len(every) == world.size:
        return every[world.rank]
    return state["rng"]
