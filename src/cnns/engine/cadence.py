"""How long a run is, in weight updates, and where step lines, checkpoints and the host's synchronisations fall.

The cadence rule lives here: the loop asks `line_due`, `checkpoint_due` and `sync_due` and decides nothing of
its own. `cnns.config.table.CADENCE_RULE` is the rule in words, which --help prints and docs/outputs.md repeats word for
word (tests/test_checkpoint_cadence.py checks the positions against the closed form, and the texts against each
other).

In closed form, with U the updates per epoch (training images // global batch) and positions counted in
updates from the run's start, so that a restored run keeps the uninterrupted run's positions:

- a cadence of s updates falls at updates floor(k * s), k = 1, 2, ...: s = F for --log-freq F (with
  --iterations), s = U / N for --logs-per-epoch N (with --epochs) and for --ckpts-per-epoch N. With N a whole
  number that is N per epoch, the k-th of epoch e at e * U + floor(k * U / N), the last at the epoch's last update;
- step lines (and training.csv rows) fall exactly there, and at the run's last update;
- checkpoints fall exactly there from --ckpt-epochs-offset on, with the initial weights (0) and the last update;
- the host syncs every D = --device-iterations updates (its multiples) and wherever a line, a checkpoint or an
  epoch's end (a multiple of U) is due;
- a checkpoint cadence asked more often than every D updates (s < D) brings no syncs of its own: each asked
  checkpoint is saved at the first of the other syncs at or after it (so never more often than asked), as in
  Graphcore's application, whose own test (`--iterations 4 --device-iterations 2 --ckpts-per-epoch 1000000`)
  saves iterations 0, 2 and 4. A step line is a sync itself, so lines never need that exception.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

from cnns.config import RunConfig

# Options are floats; 1 / 0.3 (--epochs-per-ckpt 0.3) is taken as the 10/3 it names, so that floor(k * U / N) of a
# whole k * U / N is never one below it by a rounding error. No cadence anyone asks for needs a finer ratio.
RATIO_DENOMINATOR_LIMIT = 10**6


def exact(value: float | int) -> Fraction:
    """An option's number as the exact ratio it names (a number too small for the limit taken as it is)."""
    return Fraction(value).limit_denominator(RATIO_DENOMINATOR_LIMIT) or Fraction(value)


@dataclass(frozen=True)
class Every:
    """A cadence of `updates` updates (a ratio): positions floor(k * updates), k = 1, 2, ..."""

    updates: Fraction

    def due(self, done: int) -> bool:
        """Whether `done` is one of the positions: the first k with k * updates >= done lands on it."""
        if done < 1:
            return False
        return math.floor(math.ceil(done / self.updates) * self.updates) == done

    def first_after(self, done: int) -> int:
        """The first position after `done` updates."""
        return math.floor(math.ceil((done + 1) / self.updates) * self.updates)

    def last_before(self, done: int) -> int:
        """The last position before `done` updates (0 where there is none)."""
        return max(0, math.floor((math.ceil(done / self.updates) - 1) * self.updates))

    def __str__(self) -> str:
        return f"every {_number(self.updates)} updates"


def _number(ratio: Fraction) -> str:
    return str(ratio.numerator) if ratio.denominator == 1 else f"{float(ratio):.6g}"


@dataclass(frozen=True)
class RunLength:
    """How long the run is, in weight updates, and its cadences (the rule above)."""

    total_iterations: int
    iterations_per_epoch: int  # U
    epochs: float
    device_iterations: int  # D: the most updates between two host synchronisations
    lines: Every | None  # None: a step line at the run's last update only
    checkpoints: Every | None  # None: only the last update's checkpoint (--ckpts-per-epoch 0)
    ckpt_offset: int = 0  # no cadence checkpoint before this update (--ckpt-epochs-offset)

    @classmethod
    def resolve(cls, cfg: RunConfig, num_train_samples: int) -> "RunLength":
        t = cfg.train
        per_epoch = max(1, num_train_samples // t.global_batch_size)
        if t.iterations is not None:
            total = t.iterations
            epochs = total * t.global_batch_size / num_train_samples
            lines = Every(exact(max(1, t.log_freq)))
        else:
            total = max(1, int(num_train_samples * t.epochs // t.global_batch_size))
            epochs = t.epochs
            lines = Every(per_epoch / exact(t.logs_per_epoch)) if t.logs_per_epoch else None
        checkpoints = Every(per_epoch / exact(t.ckpts_per_epoch)) if t.ckpts_per_epoch else None
        return cls(total, per_epoch, epochs, t.device_iterations, lines, checkpoints,
                   int(t.ckpt_epochs_offset * per_epoch))

    @property
    def checkpoints_on_syncs(self) -> bool:
        """The checkpoint cadence is asked more often than every D updates: saved at the next sync instead."""
        return self.checkpoints is not None and self.checkpoints.updates < self.device_iterations

    def line_due(self, done: int) -> bool:
        """A step line and training.csv row after `done` updates."""
        return done == self.total_iterations or (self.lines is not None and self.lines.due(done))

    def checkpoint_due(self, done: int) -> bool:
        """A checkpoint of the weights after `done` updates: the initial weights (the untrained baseline
        validation.py reports first) unless only the last is asked, the cadence from the offset on, the last."""
        if self.checkpoints is None:
            return done == self.total_iterations
        if done in (0, self.total_iterations):
            return True
        if done < self.ckpt_offset:
            return False
        if not self.checkpoints_on_syncs:
            return self.checkpoints.due(done)
        # The first sync at or after an asked checkpoint: one was asked since the sync before this one.
        asked_since = max(self._sync_before(done), self.ckpt_offset - 1)
        return self._meets(done) and self.checkpoints.first_after(asked_since) <= done

    def sync_due(self, done: int) -> bool:
        """The host reads the metrics back after `done` updates."""
        return self._meets(done) or self.checkpoint_due(done)

    def _meets(self, done: int) -> bool:
        """The syncs that are not checkpoints' own: every D updates, every line, every epoch's end."""
        return done % self.device_iterations == 0 or done % self.iterations_per_epoch == 0 or self.line_due(done)

    def _sync_before(self, done: int) -> int:
        """The last of the `_meets` syncs before `done` updates (0, the start, where there is none)."""
        before = done - 1
        last_line = self.lines.last_before(done) if self.lines is not None else 0
        return max(0, before - before % self.device_iterations, before - before % self.iterations_per_epoch,
                   last_line)

    def describe(self) -> str:
        """The header's line: the cadence as it runs (not as the options were typed)."""
        lines = str(self.lines) if self.lines is not None else "at the last update only"
        if self.checkpoints is None:
            saved = "at the last update only"
        elif self.checkpoints_on_syncs:
            saved = (f"at the first sync at or after each asked ({self.checkpoints}, more often than every "
                     f"{self.device_iterations}, --device-iterations), the initial weights and the last update")
        else:
            offset = f" from update {self.ckpt_offset}" if self.ckpt_offset else ""
            saved = f"{self.checkpoints}{offset}, the initial weights and the last update"
        return (f" Length: {self.total_iterations} updates, {self.iterations_per_epoch} per epoch; step lines "
                f"{lines}; checkpoints {saved}; host syncs at most every {self.device_iterations} updates and at "
                "every line, checkpoint and epoch's end")
