"""Optimisers of the original IPU CNN training application, built from maintained implementations.

* ``SGD``       — ``torch.optim.SGD`` without momentum;
* ``momentum``  — ``torch.optim.SGD`` with momentum (TensorFlow's ``MomentumOptimizer`` has the same
  update: ``m = mu * m + g; w -= lr * m``);
* ``RMSprop``   — ``timm.optim.RMSpropTF``: TensorFlow's RMSProp, with epsilon inside the square root,
  the mean square initialised to 1, and the learning rate accumulated in the momentum buffer;
* ``LARS``      — ``timm.optim.Lars`` with the original's trust ratio
  ``eeta * ||w|| / (||g|| + wd * ||w|| + eps)``.

Weight decay is an L2 term added to the gradient (``g + wd * w``), as in the original, and never
touches parameters with one dimension or fewer: normalisation scales and shifts and every bias.

For 16.16 training (half-precision weights, no float32 master copy) wrap any of these in
:class:`HalfPrecisionOptimiser`, which rounds each update back to the half type stochastically.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from timm.optim import Lars, RMSpropTF

from cnns.errors import ConfigError

# Key marking the parameter group of normalisation parameters and biases: no weight decay, and
# LARS leaves them out of the trust ratio (the original's --lars-skip-list 'beta', 'gamma', 'bias').
NORM_OR_BIAS = "norm_or_bias"

_CANONICAL_NAMES = {"sgd": "SGD", "momentum": "momentum", "rmsprop": "RMSprop", "lars": "LARS"}


@dataclass(frozen=True)
class OptimiserSpec:
    """Choice and hyper-parameters of the optimiser (defaults are the original's).

    ``name`` is case-insensitive. ``momentum`` is used by ``momentum``, ``RMSprop`` and ``LARS``
    (as in the original, one --momentum serves all three). ``lars_weight_decay`` of ``None`` means
    "same as ``weight_decay``", the original's rule for --lars-weight-decay.
    """

    name: str
    lr: float
    momentum: float = 0.9
    weight_decay: float = 0.0
    rmsprop_decay: float = 0.9
    rmsprop_epsilon: float = 1e-3
    lars_eeta: float = 0.001
    lars_epsilon: float = 0.0
    lars_weight_decay: float | None = None

    def __post_init__(self) -> None:
        if self.name.lower() not in _CANONICAL_NAMES:
            raise ConfigError(
                f"unknown optimiser {self.name!r}; choose one of {', '.join(_CANONICAL_NAMES.values())}"
            )
        _require(self.lr >= 0, f"learning rate must be >= 0, got {self.lr}")
        _require(0 <= self.momentum < 1, f"momentum must be in [0, 1), got {self.momentum}")
        _require(self.weight_decay >= 0, f"weight decay must be >= 0, got {self.weight_decay}")
        _require(0 <= self.rmsprop_decay < 1, f"RMSprop decay must be in [0, 1), got {self.rmsprop_decay}")
        _require(self.rmsprop_epsilon >= 0, f"RMSprop epsilon must be >= 0, got {self.rmsprop_epsilon}")
        _require(self.lars_eeta > 0, f"LARS eeta must be > 0, got {self.lars_eeta}")
        _require(self.lars_epsilon >= 0, f"LARS epsilon must be >= 0, got {self.lars_epsilon}")
        _require(
            self.lars_weight_decay is None or self.lars_weight_decay >= 0,
            f"LARS weight decay must be >= 0, got {self.lars_weight_decay}",
        )

    @property
    def canonical_name(self) -> str:
        return _CANONICAL_NAMES[self.name.lower()]


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two parameter groups: decayed weights, and normalisation parameters plus biases.

    A parameter with ``ndim <= 1`` is a bias or a normalisation scale/shift; decaying those only
    fights the normalisation, so its group has ``weight_decay`` 0 and is marked ``NORM_OR_BIAS``.
    Frozen parameters (``requires_grad=False``) are left out. Both groups are always returned (one may
    be empty) so that optimiser checkpoints have a fixed layout.
    """
    decayed: list[nn.Parameter] = []
    norm_or_bias: list[nn.Parameter] = []
    for param in model.parameters():
        if param.requires_grad:
            (norm_or_bias if param.ndim <= 1 else decayed).append(param)
    return [
        {"params": decayed, "weight_decay": weight_decay, NORM_OR_BIAS: False},
        {"params": norm_or_bias, "weight_decay": 0.0, NORM_OR_BIAS: True},
    ]


def build_optimiser(params_or_groups: Iterable, spec: OptimiserSpec) -> torch.optim.Optimizer:
    """The optimiser ``spec`` names, over ``params_or_groups``.

    Groups keep their own ``weight_decay`` (see :func:`parameter_groups`); plain parameters get
    ``spec.weight_decay``. For LARS, groups marked ``NORM_OR_BIAS`` get neither trust ratio nor decay
    (plain momentum SGD, as the original's skip list), every other group gets the trust ratio and
    ``lars_weight_decay`` in place of its own decay. ``foreach`` is left to the implementations, which
    use the multi-tensor kernels wherever they exist (CUDA).
    """
    groups = _as_groups(params_or_groups)
    name = spec.canonical_name
    if name == "SGD":
        return torch.optim.SGD(groups, lr=spec.lr, momentum=0.0, weight_decay=spec.weight_decay)
    if name == "momentum":
        return torch.optim.SGD(groups, lr=spec.lr, momentum=spec.momentum, weight_decay=spec.weight_decay)
    if name == "RMSprop":
        return RMSpropTF(
            groups,
            lr=spec.lr,
            alpha=spec.rmsprop_decay,
            eps=spec.rmsprop_epsilon,
            momentum=spec.momentum,
            weight_decay=spec.weight_decay,
            lr_in_momentum=True,
        )
    return Lars(
        _lars_groups(groups, spec),
        lr=spec.lr,
        momentum=spec.momentum,
        trust_coeff=spec.lars_eeta,
        eps=spec.lars_epsilon,
    )


def _lars_groups(groups: list[dict], spec: OptimiserSpec) -> list[dict]:
    """Per-group LARS switches: timm's Lars reads ``weight_decay`` and ``always_adapt`` per group.

    With ``weight_decay`` 0 and ``always_adapt`` False, timm skips the trust ratio entirely; with
    ``always_adapt`` True it applies it even when the LARS decay is 0, as the original did.
    """
    lars_decay = spec.weight_decay if spec.lars_weight_decay is None else spec.lars_weight_decay
    lars_groups = []
    for group in groups:
        skipped = bool(group.get(NORM_OR_BIAS, False))
        lars_groups.append({
            **group,
            "weight_decay": 0.0 if skipped else lars_decay,
            "always_adapt": not skipped,
        })
    return lars_groups


def _as_groups(params_or_groups: Iterable) -> list[dict]:
    items = list(params_or_groups)
    if not items:
        raise ConfigError("the optimiser got no parameters")
    if all(isinstance(item, dict) for item in items):
        return [dict(group) for group in items]
    if any(isinstance(item, dict) for item in items):
        raise ConfigError("pass either parameters or parameter groups to the optimiser, not a mixture")
    return [{"params": items}]


def set_lr(optimiser: Any, lr: float) -> None:
    """Set the learning rate of every parameter group (the schedule drives it step by step)."""
    for group in optimiser.param_groups:
        group["lr"] = lr


# --------------------------------------------------------------------------------------------
# 16.16: half-precision weights with stochastic rounding
# --------------------------------------------------------------------------------------------

_HALF_TYPES = (torch.bfloat16, torch.float16)


def stochastic_round(x: Tensor, dtype: torch.dtype, generator: torch.Generator | None = None) -> Tensor:
    """Round float32 ``x`` to ``dtype`` (bfloat16 or float16) so that ``E[result] == x``.

    ``x`` goes to the neighbour of larger magnitude with probability equal to its distance from the
    smaller one over the gap between them. This is what lets 16-bit weights accumulate updates far
    smaller than their spacing, which round-to-nearest would discard every time.
    Infinities and NaNs pass through; ``generator`` must live on ``x``'s device.
    """
    if x.dtype != torch.float32:
        raise TypeError(f"stochastic_round expects float32 input, got {x.dtype}")
    if dtype == torch.bfloat16:
        return _stochastic_round_bfloat16(x, generator)
    if dtype == torch.float16:
        return _stochastic_round_float16(x, generator)
    raise TypeError(f"stochastic_round rounds to bfloat16 or float16, not {dtype}")


def _stochastic_round_bfloat16(x: Tensor, generator: torch.Generator | None) -> Tensor:
    # bfloat16 is the top 16 bits of float32. Adding a uniform integer in [0, 2**16) to the bit
    # pattern and dropping the low 16 bits carries into the kept bits with probability (low bits) /
    # 2**16: exactly the stochastic rounding of the magnitude. The sign bit is untouched because
    # the carry only ever moves the magnitude up to the infinity pattern, never past it.
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device, generator=generator)
    bits = (x.contiguous().view(torch.int32) + noise) & -65536  # -65536 == 0xFFFF0000 as int32
    rounded = bits.view(torch.float32).to(torch.bfloat16)  # exact: the low bits are zero
    # NaN payloads and infinities could be corrupted by the carry; let the plain cast handle them.
    return torch.where(torch.isfinite(x), rounded, x.to(torch.bfloat16))


def _stochastic_round_float16(x: Tensor, generator: torch.Generator | None) -> Tensor:
    # float16 has fewer exponent bits than float32, so the bit trick above does not apply. Instead
    # find the two float16 neighbours of x from its round-to-nearest value: for a finite float16 the
    # int16 bit pattern +1 / -1 is the next value away from / towards zero.
    nearest = x.to(torch.float16)
    nearest_bits = nearest.view(torch.int16)
    nearest_is_below = nearest.float().abs() <= x.abs()
    smaller_mag = torch.where(nearest_is_below, nearest_bits, nearest_bits - 1).view(torch.float16)
    larger_mag = torch.where(nearest_is_below, nearest_bits + 1, nearest_bits).view(torch.float16)
    low, high = smaller_mag.float().abs(), larger_mag.float().abs()
    gap = high - low
    # Exact values (gap 0 never happens, but x == low does) go up with probability 0.
    prob_up = torch.where(gap > 0, (x.abs() - low) / gap, torch.zeros_like(gap))
    uniform = torch.rand(x.shape, dtype=torch.float32, device=x.device, generator=generator)
    rounded = torch.where(uniform < prob_up, larger_mag, smaller_mag)
    # Beyond the largest float16 (gap infinite, prob_up 0) keep the plain cast, as for inf and NaN.
    return torch.where(torch.isfinite(nearest) & torch.isfinite(x), rounded, nearest)


class HalfPrecisionOptimiser:
    """Wraps an optimiser for models whose parameters are half precision (16.16).

    Keeps float32 working copies of the half parameters, re-read from the half weights before every
    step so the half weights stay the only truth (IPU 16.16 has no master copy); hands float32
    gradients to the inner torch optimiser (whose state, e.g. momentum, stays float32); and writes
    the result back with stochastic rounding (round-to-nearest when ``stochastic_rounding=False``).

    Gradients: by default each half parameter's ``.grad`` (converted to float32). A training loop that
    accumulates micro-batch gradients in float32 itself passes them to :meth:`step` instead, one per
    parameter in the order of :attr:`params` (``None`` for a parameter to leave untouched).

    Parameters that are already float32 are optimised in place, without copies or rounding.
    ``param_groups`` is the inner optimiser's, so :func:`set_lr` works on the wrapper.
    """

    def __init__(
        self,
        half_params_or_groups: Iterable,
        make_inner: Callable[[list], torch.optim.Optimizer],
        *,
        stochastic_rounding: bool,
        seed: int,
    ) -> None:
        groups = _as_groups(half_params_or_groups)
        self.params: list[Tensor] = []  # the model's parameters, flattened in group order
        self._working: list[Tensor] = []  # float32 tensor the inner optimiser updates, per parameter
        working_groups = []
        for group in groups:
            group_params = list(group["params"])
            working = [_float32_working_copy(p) for p in group_params]
            self.params.extend(group_params)
            self._working.extend(working)
            working_groups.append({**group, "params": working})
        devices = {p.device for p in self.params}
        if len(devices) > 1:
            raise ConfigError(f"half-precision parameters must share one device, found {sorted(map(str, devices))}")
        self.stochastic_rounding = stochastic_rounding
        self._generator = torch.Generator(device=devices.pop() if devices else "cpu")
        self._generator.manual_seed(seed)
        self.inner = make_inner(working_groups)

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    @torch.no_grad()
    def step(self, grads: Sequence[Tensor | None] | None = None) -> None:
        """One update. ``grads``: float32 gradients aligned with :attr:`params`, or None for ``.grad``."""
        if grads is not None and len(grads) != len(self.params):
            raise ValueError(f"expected {len(self.params)} gradients, got {len(grads)}")
        updated = []
        for i, (param, working) in enumerate(zip(self.params, self._working)):
            grad = param.grad if grads is None else grads[i]
            if working is param:
                param.grad = grad
            else:
                working.copy_(param)  # the half weight is the truth: drop the previous rounding residue
                working.grad = None if grad is None else grad.to(torch.float32)
            if grad is not None:
                updated.append(i)
        self.inner.step()
        # Round back in parameter order so the random stream (and a restored run) is reproducible.
        for i in updated:
            param, working = self.params[i], self._working[i]
            if working is not param:
                param.copy_(self._round(working, param.dtype))

    def _round(self, value: Tensor, dtype: torch.dtype) -> Tensor:
        if self.stochastic_rounding and dtype in _HALF_TYPES:
            return stochastic_round(value, dtype, self._generator)
        return value.to(dtype)  # round to nearest even

    def zero_grad(self, set_to_none: bool = True) -> None:
        # Float32 parameters are their own working copy; the identity check avoids zeroing twice.
        tensors = self.params + [w for w, p in zip(self._working, self.params) if w is not p]
        for tensor in tensors:
            if tensor.grad is None:
                continue
            if set_to_none:
                tensor.grad = None
            else:
                tensor.grad.zero_()

    def state_dict(self) -> dict:
        """Inner optimiser state plus the rounding generator, so a restored run is bitwise identical."""
        return {
            "inner": self.inner.state_dict(),
            "rounding_generator": self._generator.get_state(),
            "stochastic_rounding": self.stochastic_rounding,
        }

    def load_state_dict(self, state_dict: dict) -> None:
        self.inner.load_state_dict(state_dict["inner"])
        self._generator.set_state(state_dict["rounding_generator"])
        self.stochastic_rounding = state_dict["stochastic_rounding"]


def _float32_working_copy(param: Tensor) -> Tensor:
    if param.dtype == torch.float32:
        return param
    if param.dtype not in _HALF_TYPES:
        raise ConfigError(f"half-precision optimiser expects bfloat16, float16 or float32 parameters, got {param.dtype}")
    return param.detach().to(torch.float32)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)
