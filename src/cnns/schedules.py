"""Learning-rate schedules of the original IPU CNN training application, as pure functions.

Every schedule is a closed form of the update number, so the learning rate of any step can be
computed without replaying the run (the originals were stateful objects that had to be called in
order; a restored run here simply asks for the step it resumes at).

Common notation in the docstrings below:

* ``t``  — the 0-based update number passed to :func:`lr_at`, clamped to ``T``;
* ``T``  — ``total_steps``, the number of weight updates in the whole run;
* ``W``  — ``warmup_steps``;
* ``lr0`` — ``base_lr``, the peak learning rate (``2**exponent * global_batch_size`` in the original,
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


@dataclass(frozen=True)
class ScheduleSpec:
    """Everything needed to compute the learning rate of any update.

    Fields used by every kind: ``kind``, ``base_lr``, ``total_steps``, ``warmup_steps``.
    The others belong to one kind each and are ignored by the rest.
    """

    kind: str
    base_lr: float
    total_steps: int
    warmup_steps: int = 0
    # stepped (--learning-rate-decay, --learning-rate-schedule)
    decay: float = 0.1
    boundaries: tuple[float, ...] = (0.5, 0.75)
    # exponential (--lr-decay-rate, --lr-drops); defaults are the original's EfficientNet defaults
    decay_rate: float = 0.97
    num_drops: int = 146
    # polynomial (--poly-lr-decay-power, --abs-end-learning-rate, --poly-lr-end-ratio)
    poly_power: float = 2.0
    end_lr: float | None = None
    end_ratio: float = 1e-5

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULE_KINDS:
            raise ConfigError(
                f"unknown learning-rate schedule {self.kind!r}; choose one of {', '.join(SCHEDULE_KINDS)}"
            )
        _require(_is_finite(self.base_lr) and self.base_lr >= 0, f"base learning rate must be >= 0, got {self.base_lr}")
        _require(self.total_steps >= 1, f"total number of steps must be >= 1, got {self.total_steps}")
        _require(
            0 <= self.warmup_steps <= self.total_steps,
            f"warmup steps must be between 0 and the total number of steps ({self.total_steps}), "
            f"got {self.warmup_steps}",
        )
        if self.kind == "stepped":
            _require(_is_finite(self.decay) and self.decay > 0, f"learning-rate decay must be > 0, got {self.decay}")
            _require(
                all(0.0 <= b <= 1.0 for b in self.boundaries) and list(self.boundaries) == sorted(self.boundaries),
                f"learning-rate schedule boundaries must be increasing fractions of training in [0, 1], "
                f"got {self.boundaries}",
            )
        elif self.kind == "exponential":
            _require(
                _is_finite(self.decay_rate) and self.decay_rate > 0,
                f"exponential decay rate must be > 0, got {self.decay_rate}",
            )
            _require(self.num_drops >= 1, f"number of learning-rate drops must be >= 1, got {self.num_drops}")
        elif self.kind == "polynomial":
            # The decay phase divides by T - W, so it must not be empty.
            _require(
                self.warmup_steps < self.total_steps,
                f"polynomial decay needs warmup steps ({self.warmup_steps}) below the total ({self.total_steps})",
            )
            _require(
                _is_finite(self.poly_power) and self.poly_power >= 0,
                f"polynomial decay power must be >= 0, got {self.poly_power}",
            )
            _require(
                self.end_lr is None or (_is_finite(self.end_lr) and self.end_lr >= 0),
                f"end learning rate must be >= 0, got {self.end_lr}",
            )
            _require(
                _is_finite(self.end_ratio) and self.end_ratio >= 0,
                f"end learning-rate ratio must be >= 0, got {self.end_ratio}",
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
    if spec.kind == "polynomial":
        return _polynomial(spec, t)
    decayed = {"stepped": _stepped, "cosine": _cosine, "exponential": _exponential}[spec.kind](spec, t)
    return _warmup_factor(spec, t) * decayed


def _warmup_factor(spec: ScheduleSpec, t: int) -> float:
    """``t / W`` during warmup (``t < W``), else 1."""
    return t / spec.warmup_steps if t < spec.warmup_steps else 1.0


def _stepped(spec: ScheduleSpec, t: int) -> float:
    """``lr0 * decay**k``, ``k`` = number of boundaries ``b`` with ``t > int(b * T)``.

    The strict ``>`` and the truncation ``int(b * T)`` are the original's: the drop takes effect on
    the update *after* the boundary step.
    """
    drops_passed = sum(1 for b in spec.boundaries if t > int(b * spec.total_steps))
    return spec.base_lr * spec.decay**drops_passed


def _cosine(spec: ScheduleSpec, t: int) -> float:
    """``lr0 * (1 + cos(pi * t / T)) / 2``.

    As in the original, the cosine spans the whole run (warmup included) and warmup scales it, so
    the rate reaches 0 at ``t = T`` and the peak after warmup is slightly below ``lr0``.
    """
    return spec.base_lr * 0.5 * (1.0 + math.cos(math.pi * t / spec.total_steps))


def _exponential(spec: ScheduleSpec, t: int) -> float:
    """``lr0 * decay_rate**floor(t * num_drops / T)``: ``num_drops`` equally spaced drops.

    Integer arithmetic so that a step exactly on a drop point is never misplaced by rounding.
    """
    drops_passed = (t * spec.num_drops) // spec.total_steps
    return spec.base_lr * spec.decay_rate**drops_passed


def _polynomial(spec: ScheduleSpec, t: int) -> float:
    """Linear warmup to ``lr0``, then polynomial decay to the end rate.

    * ``t <= W`` (when ``W > 0``): ``lr0 * t / W``;
    * otherwise: ``(lr0 - lr_end) * (1 - (t - W) / (T - W))**poly_power + lr_end``,

    with ``lr_end = end_lr`` when given (``--abs-end-learning-rate``), else ``end_ratio * lr0``.
    Both branches give ``lr0`` at ``t = W``, and the rate is ``lr_end`` at ``t = T``.
    """
    warmup = spec.warmup_steps
    if warmup > 0 and t <= warmup:
        return spec.base_lr * t / warmup
    end_lr = spec.end_lr if spec.end_lr is not None else spec.end_ratio * spec.base_lr
    remaining = 1.0 - (t - warmup) / (spec.total_steps - warmup)
    return (spec.base_lr - end_lr) * remaining**spec.poly_power + end_lr


def _is_finite(value: float) -> bool:
    return math.isfinite(value)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)
