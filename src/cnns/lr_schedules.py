"""Learning-rate schedules of the original IPU CNN training application, as pure functions.

Every schedule is a closed form of the update number, so the learning rate of any step can be
computed without replaying the run (the originals were stateful objects that had to be called in
order; a restored run here simply asks for the step it resumes at).

Common notation in the docstrings below:

* ``t``  — the 0-based update number passed to :func:`lr_at`, clamped to ``T``;
* ``T``  — ``total_steps``, the number of weight updates in the whole run;
* ``W``  — ``warmup_steps``;
* ``lr0`` — ``learning_rate``, the peak learning rate (``2**exponent * global_batch_size`` in the original,
  see :func:`learning_rate_from_exponent`).

Warmup is linear *from zero*, as in the original: update ``t < W`` uses ``t / W`` of the rate the
schedule would otherwise give, so update 0 has learning rate 0. (The original evaluated the schedule
at the middle of each device loop, so its very first update was usually not exactly 0; choosing the
point at which to evaluate is the training loop's business, not this module's.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cnns.errors import ConfigError

SCHEDULE_KINDS = ("stepped", "cosine", "exponential", "polynomial")
# The parameters each kind reads, beyond the learning rate and the run's length.
_PARAMETERS = {"stepped": ("learning_rate_decay", "learning_rate_schedule"), "exponential": ("lr_decay_rate", "lr_drops"),
               "polynomial": ("poly_lr_decay_power", "poly_lr_end_ratio")}


@dataclass(frozen=True)
class ScheduleSpec:
    """Everything needed to compute the learning rate of any update.

    Fields are named as the options that set them (`cnns.config.run.OptimConfig` has the same names). Used
    by every kind: ``lr_schedule``, ``learning_rate``, ``total_steps``, ``warmup_steps`` (the run's length,
    so not options). The others belong to one kind each, are given for that kind and ignored by the rest
    (None where not given). They have no defaults here: the options' defaults, Graphcore's application's, are
    stated once, in `cnns.config.defaults`, which fills them for a run.
    """

    lr_schedule: str
    learning_rate: float
    total_steps: int
    warmup_steps: int = 0
    # stepped (--learning-rate-decay, --learning-rate-schedule)
    learning_rate_decay: float | None = None
    learning_rate_schedule: tuple[float, ...] | None = None
    # exponential (--lr-decay-rate, --lr-drops)
    lr_decay_rate: float | None = None
    lr_drops: int | None = None
    # polynomial (--poly-lr-decay-power, --poly-lr-end-ratio; --abs-end-learning-rate becomes the ratio)
    poly_lr_decay_power: float | None = None
    poly_lr_end_ratio: float | None = None

    def __post_init__(self) -> None:
        if self.lr_schedule not in SCHEDULE_KINDS:
            raise ConfigError(
                f"unknown learning-rate schedule {self.lr_schedule!r}; choose one of {', '.join(SCHEDULE_KINDS)}"
            )
        _require(_is_finite(self.learning_rate) and self.learning_rate >= 0, f"base learning rate must be >= 0, got {self.learning_rate}")
        _require(self.total_steps >= 1, f"total number of steps must be >= 1, got {self.total_steps}")
        _require(
            0 <= self.warmup_steps <= self.total_steps,
            f"warmup steps must be between 0 and the total number of steps ({self.total_steps}), "
            f"got {self.warmup_steps}",
        )
        missing = [name for name in _PARAMETERS.get(self.lr_schedule, ()) if getattr(self, name) is None]
        _require(not missing, f"the {self.lr_schedule} schedule needs {' and '.join(missing)}")
        if self.lr_schedule == "stepped":
            _require(_is_finite(self.learning_rate_decay) and self.learning_rate_decay > 0,
                     f"learning-rate decay must be > 0, got {self.learning_rate_decay}")
            _require(
                all(0.0 <= b <= 1.0 for b in self.learning_rate_schedule) and list(self.learning_rate_schedule) == sorted(self.learning_rate_schedule),
                f"learning-rate schedule boundaries must be increasing fractions of training in [0, 1], "
                f"got {self.learning_rate_schedule}",
            )
        elif self.lr_schedule == "exponential":
            _require(
                _is_finite(self.lr_decay_rate) and self.lr_decay_rate > 0,
                f"exponential decay rate must be > 0, got {self.lr_decay_rate}",
            )
            _require(self.lr_drops >= 1, f"number of learning-rate drops must be >= 1, got {self.lr_drops}")
        elif self.lr_schedule == "polynomial":
            # The decay phase divides by T - W, so it must not be empty.
            _require(
                self.warmup_steps < self.total_steps,
                f"polynomial decay needs warmup steps ({self.warmup_steps}) below the total ({self.total_steps})",
            )
            _require(
                _is_finite(self.poly_lr_decay_power) and self.poly_lr_decay_power >= 0,
                f"polynomial decay power must be >= 0, got {self.poly_lr_decay_power}",
            )
            _require(
                _is_finite(self.poly_lr_end_ratio) and self.poly_lr_end_ratio >= 0,
                f"end learning-rate ratio must be >= 0, got {self.poly_lr_end_ratio}",
            )


def learning_rate_from_exponent(exponent: float, global_batch_size: int) -> float:
    """``2**exponent * global_batch_size``: the original's ``--base-learning-rate-exponent``.

    The exponent is a per-sample rate, so the learning rate scales linearly with the global batch
    (micro-batch x gradient accumulation x replicas).
    """
    if global_batch_size < 1:
        raise ConfigError(f"global batch size must be >= 1, got {global_batch_size}")
    return 2.0**exponent * global_batch_size


def warmup_steps_from_epochs(total_steps: int, warmup_epochs: float, epochs: float) -> int:
    """``floor(T * warmup_epochs / epochs)``: the original's conversion of ``--warmup-epochs``."""
    if epochs <= 0:
        raise ConfigError(f"number of epochs must be > 0, got {epochs}")
    if warmup_epochs < 0:
        raise ConfigError(f"warmup epochs must be >= 0, got {warmup_epochs}")
    return int(total_steps * warmup_epochs // epochs)


def lr_at(spec: ScheduleSpec, step: int) -> float:
    """The learning rate used for update number ``step`` (0-based).

    Steps past the end of training keep the final value, ``lr_at(spec, T)``.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    t = min(step, spec.total_steps)
    if spec.lr_schedule == "polynomial":
        return _polynomial(spec, t)
    decayed = {"stepped": _stepped, "cosine": _cosine, "exponential": _exponential}[spec.lr_schedule](spec, t)
    return _warmup_factor(spec, t) * decayed


def _warmup_factor(spec: ScheduleSpec, t: int) -> float:
    """``t / W`` during warmup (``t < W``), else 1."""
    return t / spec.warmup_steps if t < spec.warmup_steps else 1.0


def _stepped(spec: ScheduleSpec, t: int) -> float:
    """``lr0 * learning_rate_decay**k``, ``k`` = number of boundaries ``b`` (``learning_rate_schedule``) with
    ``t > int(b * T)``.

    The strict ``>`` and the truncation ``int(b * T)`` are the original's: the drop takes effect on
    the update *after* the boundary step.
    """
    drops_passed = sum(1 for b in spec.learning_rate_schedule if t > int(b * spec.total_steps))
    return spec.learning_rate * spec.learning_rate_decay**drops_passed


def _cosine(spec: ScheduleSpec, t: int) -> float:
    """``lr0 * (1 + cos(pi * t / T)) / 2``.

    As in the original, the cosine spans the whole run (warmup included) and warmup scales it, so
    the rate reaches 0 at ``t = T`` and the peak after warmup is slightly below ``lr0``.
    """
    return spec.learning_rate * 0.5 * (1.0 + math.cos(math.pi * t / spec.total_steps))


def _exponential(spec: ScheduleSpec, t: int) -> float:
    """``lr0 * lr_decay_rate**floor(t * lr_drops / T)``: ``lr_drops`` equally spaced drops.

    Integer arithmetic so that a step exactly on a drop point is never misplaced by rounding.
    """
    drops_passed = (t * spec.lr_drops) // spec.total_steps
    return spec.learning_rate * spec.lr_decay_rate**drops_passed


def _polynomial(spec: ScheduleSpec, t: int) -> float:
    """Linear warmup to ``lr0``, then polynomial decay to the end rate.

    * ``t <= W`` (when ``W > 0``): ``lr0 * t / W``;
    * otherwise: ``(lr0 - lr_end) * (1 - (t - W) / (T - W))**poly_power + lr_end``,

    with ``lr_end = poly_lr_end_ratio * lr0`` (``--abs-end-learning-rate`` is given as that ratio).
    Both branches give ``lr0`` at ``t = W``, and the rate is ``lr_end`` at ``t = T``.
    """
    warmup = spec.warmup_steps
    if warmup > 0 and t <= warmup:
        return spec.learning_rate * t / warmup
    end_lr = spec.poly_lr_end_ratio * spec.learning_rate
    remaining = 1.0 - (t - warmup) / (spec.total_steps - warmup)
    return (spec.learning_rate - end_lr) * remaining**spec.poly_lr_decay_power + end_lr


def _is_finite(value: float) -> bool:
    return math.isfinite(value)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)
