import math

import pytest

from cnns.errors import ConfigError
from cnns.lr_schedules import (
    ScheduleSpec,
    learning_rate_from_exponent,
    lr_at,
    warmup_steps_from_epochs,
)

STEPS_TO_CHECK = range(0, 1001, 7)


def test_learning_rate_is_two_to_the_exponent_times_global_batch():
    # The original's own examples.
    assert learning_rate_from_exponent(-6, 32) == 0.5
    assert learning_rate_from_exponent(-4, 16) == 1.0
    with pytest.raises(ConfigError):
        learning_rate_from_exponent(-6, 0)


def test_stepped_example_from_the_original():
    # 10 epochs, no warmup, decay 0.1 at 0.5, 0.75, 0.875 of training, base lr 0.5.
    steps_per_epoch = 100
    spec = ScheduleSpec("stepped", learning_rate=0.5, total_steps=10 * steps_per_epoch,
                        learning_rate_decay=0.1, learning_rate_schedule=(0.5, 0.75, 0.875))
    assert lr_at(spec, 0) == 0.5
    assert lr_at(spec, spec.total_steps - 1) == pytest.approx(0.0005, rel=1e-12)


def test_stepped_matches_closed_form():
    total, boundaries, decay = 1000, (0.3, 0.6, 0.9), 0.2
    spec = ScheduleSpec("stepped", learning_rate=0.8, total_steps=total, learning_rate_decay=decay,
                        learning_rate_schedule=boundaries)
    for t in STEPS_TO_CHECK:
        if t <= 300:
            expected = 0.8
        elif t <= 600:
            expected = 0.8 * 0.2
        elif t <= 900:
            expected = 0.8 * 0.2 * 0.2
        else:
            expected = 0.8 * 0.2 * 0.2 * 0.2
        assert lr_at(spec, t) == pytest.approx(expected, rel=1e-12), t


def test_drop_takes_effect_on_the_update_after_the_boundary():
    spec = ScheduleSpec("stepped", learning_rate=1.0, total_steps=10, learning_rate_decay=0.5, learning_rate_schedule=(0.5,))
    assert [lr_at(spec, t) for t in (4, 5, 6)] == [1.0, 1.0, 0.5]


def test_cosine_matches_closed_form():
    spec = ScheduleSpec("cosine", learning_rate=2.0, total_steps=1000)
    for t in STEPS_TO_CHECK:
        expected = 2.0 * (1 + math.cos(math.pi * t / 1000)) / 2
        assert lr_at(spec, t) == pytest.approx(expected, rel=1e-12, abs=1e-15), t
    assert lr_at(spec, 1000) == pytest.approx(0.0, abs=1e-15)


def test_cosine_warmup_scales_the_cosine():
    spec = ScheduleSpec("cosine", learning_rate=2.0, total_steps=1000, warmup_steps=100)
    for t in STEPS_TO_CHECK:
        cosine = 2.0 * (1 + math.cos(math.pi * t / 1000)) / 2
        expected = cosine * t / 100 if t < 100 else cosine
        assert lr_at(spec, t) == pytest.approx(expected, rel=1e-12, abs=1e-15), t


def test_exponential_matches_closed_form():
    total, drops, rate = 1000, 40, 0.9
    spec = ScheduleSpec("exponential", learning_rate=0.3, total_steps=total, lr_decay_rate=rate, lr_drops=drops)
    drop_every = total // drops  # 25 steps
    for t in STEPS_TO_CHECK:
        expected = 0.3 * rate ** (t // drop_every)
        assert lr_at(spec, t) == pytest.approx(expected, rel=1e-12), t
    # Exactly on a drop point the drop has happened (no float rounding surprises).
    assert lr_at(spec, 25) == pytest.approx(0.3 * 0.9, rel=1e-12)
    assert lr_at(spec, 24) == 0.3


def test_polynomial_matches_closed_form_with_warmup():
    total, warmup, power, base = 1000, 100, 2.0, 4.0
    end = base * 1e-5  # Graphcore's default end ratio
    spec = ScheduleSpec("polynomial", learning_rate=base, total_steps=total, warmup_steps=warmup, poly_lr_decay_power=power,
                        poly_lr_end_ratio=1e-5)
    for t in STEPS_TO_CHECK:
        if t <= warmup:
            expected = base * t / warmup
        else:
            expected = (base - end) * (1 - (t - warmup) / (total - warmup)) ** power + end
        assert lr_at(spec, t) == pytest.approx(expected, rel=1e-12, abs=1e-15), t
    assert lr_at(spec, total) == pytest.approx(end, rel=1e-12)


def test_polynomial_absolute_end_lr_is_given_as_the_end_ratio():
    """--abs-end-learning-rate is turned into --poly-lr-end-ratio once, by the default rules."""
    from cnns.config import resolve

    options = resolve({"synthetic_data": True, "dataset": "cifar-10", "lr_schedule": "polynomial",
                       "abs_learning_rate": 4.0, "abs_end_learning_rate": 0.5, "epochs": 1.0})
    assert options["poly_lr_end_ratio"] == pytest.approx(0.5 / 4.0)
    spec = ScheduleSpec("polynomial", learning_rate=4.0, total_steps=100, poly_lr_decay_power=1.0,
                        poly_lr_end_ratio=options["poly_lr_end_ratio"])
    assert lr_at(spec, 0) == 4.0
    assert lr_at(spec, 50) == pytest.approx(0.5 + 3.5 * 0.5)
    assert lr_at(spec, 100) == pytest.approx(0.5)


def test_linear_warmup_starts_at_zero():
    spec = ScheduleSpec("stepped", learning_rate=1.0, total_steps=1000, warmup_steps=50, learning_rate_decay=0.1,
                        learning_rate_schedule=(0.5,))
    assert lr_at(spec, 0) == 0.0
    assert lr_at(spec, 10) == pytest.approx(10 / 50)
    assert lr_at(spec, 49) == pytest.approx(49 / 50)
    assert lr_at(spec, 50) == 1.0


def test_steps_past_the_end_keep_the_final_value():
    spec = ScheduleSpec("cosine", learning_rate=1.0, total_steps=100)
    assert lr_at(spec, 150) == lr_at(spec, 100)
    with pytest.raises(ValueError):
        lr_at(spec, -1)


def test_warmup_steps_from_epochs_truncates_like_the_original():
    assert warmup_steps_from_epochs(1000, 5, 10) == 500
    assert warmup_steps_from_epochs(1001, 1, 3) == 333
    assert warmup_steps_from_epochs(1000, 0, 10) == 0


# Each kind's parameters, given as a run's resolved options give them (ScheduleSpec has no defaults of its own).
EVERY_KIND_S_PARAMETERS = dict(learning_rate_decay=0.1, learning_rate_schedule=(0.5, 0.75), lr_decay_rate=0.97,
                               lr_drops=146, poly_lr_decay_power=2.0, poly_lr_end_ratio=1e-5)


@pytest.mark.parametrize("kind, missing", [("stepped", "learning_rate_decay"), ("stepped", "learning_rate_schedule"),
                                           ("exponential", "lr_decay_rate"), ("exponential", "lr_drops"),
                                           ("polynomial", "poly_lr_decay_power"), ("polynomial", "poly_lr_end_ratio")])
def test_a_schedule_without_its_parameters_is_refused_not_defaulted(kind, missing):
    """The options' defaults are stated once, in cnns.config.defaults: a ScheduleSpec without its kind's
    parameter is a ConfigError, never Graphcore's default a second time; another kind's parameters are not needed."""
    given = {name: value for name, value in EVERY_KIND_S_PARAMETERS.items() if name != missing}
    with pytest.raises(ConfigError, match=f"^the {kind} schedule needs {missing}$"):
        ScheduleSpec(kind, learning_rate=1.0, total_steps=100, **given)
    assert lr_at(ScheduleSpec("cosine", learning_rate=1.0, total_steps=100), 0) == 1.0


@pytest.mark.parametrize("kwargs", [
    dict(lr_schedule="linear"),
    dict(learning_rate=-1.0),
    dict(total_steps=0),
    dict(warmup_steps=2000),
    dict(lr_schedule="stepped", learning_rate_schedule=(0.75, 0.5)),
    dict(lr_schedule="stepped", learning_rate_schedule=(1.5,)),
    dict(lr_schedule="stepped", learning_rate_decay=0.0),
    dict(lr_schedule="exponential", lr_drops=0),
    dict(lr_schedule="polynomial", warmup_steps=1000),
    dict(lr_schedule="polynomial", poly_lr_end_ratio=-0.1),
])
def test_invalid_specs_raise_config_error(kwargs):
    arguments = dict(lr_schedule="stepped", learning_rate=1.0, total_steps=1000, **EVERY_KIND_S_PARAMETERS) | kwargs
    with pytest.raises(ConfigError):
        ScheduleSpec(**arguments)
