"""How long a run is, in weight updates, and when the host meets the device: step lines, synchronisations and
checkpoints. Every cadence rule lives here, once (Graphcore's application's rules, with `--iterations` honoured
exactly as SPEC.md asks).

The host holds the weights only where it meets the device: at the end of each device iteration (every
`sync_every` updates, `--device-iterations` fitted to the logging cadence). So a checkpoint falls there too:
as often as `--ckpts-per-epoch` asks where it can, at most once per device-iteration boundary. As Graphcore's
own test has it: `--iterations 4 --device-iterations 2 --ckpts-per-epoch 1000000` saves iterations 0, 2 and 4.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cnns.config import RunConfig


@dataclass(frozen=True)
class RunLength:
    """How long the run is, in weight updates, and the cadences derived from it."""

    total_iterations: int
    iterations_per_epoch: int
    epochs: float
    log_every: int
    sync_every: int  # the device iterations as run: the host meets the device every `sync_every` updates
    ckpt_every: int | None  # None: only the final checkpoint
    ckpt_offset: int
    ckpt_notice: str | None = None  # one line when --ckpts-per-epoch could not be honoured as asked

    @classmethod
    def resolve(cls, cfg: RunConfig, num_train_samples: int) -> "RunLength":
        t = cfg.train
        per_epoch = max(1, num_train_samples // t.global_batch_size)
        if t.iterations is not None:
            total = t.iterations
            epochs = total * t.global_batch_size / num_train_samples
            log_every = max(1, t.log_freq)
        else:
            total = max(1, int(num_train_samples * t.epochs // t.global_batch_size))
            epochs = t.epochs
            log_every = max(1, int(per_epoch // t.logs_per_epoch)) if t.logs_per_epoch else total
        log_every = min(log_every, total)
        sync_every = device_iterations_as_run(log_every, t.device_iterations)
        ckpt_every, notice = checkpoint_cadence(per_epoch, t.ckpts_per_epoch, sync_every)
        return cls(total, per_epoch, epochs, log_every, sync_every, ckpt_every,
                   int(t.ckpt_epochs_offset * per_epoch), notice)

    def checkpoint_due(self, done: int) -> bool:
        """Whether the weights after `done` updates are saved by the cadence (the run's last update and an
        interrupt add their own): every `ckpt_every` counted from 0, from `ckpt_offset` on, and the initial
        weights whatever the offset (the untrained baseline validation.py reports first)."""
        every = self.ckpt_every
        return every is not None and done % every == 0 and (done == 0 or done >= self.ckpt_offset)


def device_iterations_as_run(log_every: int, device_iterations: int) -> int:
    """Updates between host synchronisations: `--device-iterations`, fitted so that step lines fall on them (a
    log interval shorter than it is one synchronisation; a longer one is split into about equal parts)."""
    if log_every < device_iterations:
        return log_every
    return max(1, log_every // max(1, round(log_every / device_iterations)))


def checkpoint_cadence(per_epoch: int, ckpts_per_epoch: float, sync_every: int) -> tuple[int | None, str | None]:
    """(updates between checkpoints, or None for only the last; the notice when that is not what was asked).

    Asked: one every int(updates per epoch / N) updates (Graphcore's rule), rounded up to a whole number of
    device iterations, where the host holds the weights."""
    if not ckpts_per_epoch:
        return None, None
    asked = max(1, int(per_epoch / ckpts_per_epoch))
    every = math.ceil(asked / sync_every) * sync_every
    saved = "one after every update" if every == 1 else f"one every {every} updates"
    if every != asked:
        reason = (f"asks for checkpoints between the host's synchronisations, every {sync_every} updates "
                  "(--device-iterations)")
    elif ckpts_per_epoch > per_epoch:
        reason = f"asks for more checkpoints than an epoch's {per_epoch} updates"
    elif ckpts_per_epoch >= 1 and every * ckpts_per_epoch != per_epoch:
        reason = f"does not divide an epoch's {per_epoch} updates"
    else:
        return every, None  # exactly as asked (N below 1: one every so many epochs, in whole updates)
    return every, f"--ckpts-per-epoch {ckpts_per_epoch:g} {reason}: {saved} is saved instead"
