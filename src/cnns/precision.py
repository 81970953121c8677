"""The precision policy, resolved once from Graphcore's ``--precision compute.master``.

=======  =====================  ================================  =====================================
option   weights                compute                           where float32 stays
=======  =====================  ================================  =====================================
32.32    float32                float32                           everywhere
16.32    float32 (master)       half, by autocast                 autocast's float32 ops, the loss
16.16    half                   half                              loss, normalisation layers; the update
=======  =====================  ================================  =====================================

"Half" is bfloat16 on a CPU and on a GPU with bfloat16 arithmetic, float16 on older GPUs
(`default_half_dtype`), unless ``--half-dtype`` says otherwise. In 16.16 the
weight update is computed in float32 and rounded back to half, stochastically by default
(`cnns.optim.HalfPrecisionOptimiser`). The training step never tests these flags: it calls
`autocast()` and `LossScaler` methods, which are no-ops where the policy needs nothing.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Callable

import torch
from torch import nn

HALF_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
# --precision's choices, Graphcore's compute.master names: the only place they are spelled out in code (the option
# table offers these; tests/test_precision_reading.py fails on a comparison with one anywhere else).
PRECISIONS = ("16.16", "16.32", "32.32")
FLOAT32_PRECISION = "32.32"  # float32 everywhere: no half type, so --half-dtype and loss scaling mean nothing
HALF_PRECISION = "16.16"  # half weights and compute (Graphcore's default)


def half_parts(precision: str) -> tuple[bool, bool]:
    """(half compute, half weights) that --precision `precision` asks for, before a device has its say."""
    compute_bits, master_bits = precision.split(".")
    return compute_bits == "16", master_bits == "16"


def describe_precision(precision: str, half_dtype: str) -> str:
    """How a run's precision is named in messages: "32.32", or "16.16 (bfloat16)" with the half type it asked for."""
    return precision if not any(half_parts(precision)) else f"{precision} ({half_dtype})"


NORM_TYPES = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm)


@dataclass(frozen=True)
class PrecisionPolicy:
    weight_dtype: torch.dtype
    compute_dtype: torch.dtype
    device_type: str
    use_autocast: bool

    note: str = ""  # one line for the log when the hardware changed what the option asked for

    @classmethod
    def resolve(cls, precision: str, half_dtype: str, device: torch.device,
                half_dtype_given: bool = True) -> "PrecisionPolicy":
        """The policy for ``precision`` on ``device``.

        ``half_dtype_given``: whether the half type was chosen explicitly (--half-dtype); when it was not
        and this CPU has no bfloat16 arithmetic, run float32 instead (see :func:`cpu_half_is_emulated`).
        """
        half = HALF_DTYPES[half_dtype]
        half_compute, half_weights = half_parts(precision)
        if half_compute and not half_dtype_given and cpu_half_is_emulated(device, half):
            return cls(torch.float32, torch.float32, device.type, use_autocast=False, note=(
                f"precision {precision}: this CPU has no {half_dtype} arithmetic (no AVX512-BF16 or AMX), so "
                f"{half_dtype} would be emulated, slower than float32; running in float32. "
                f"--half-dtype {half_dtype} insists on it."))
        compute = half if half_compute else torch.float32
        weights = half if half_weights else torch.float32
        return cls(weight_dtype=weights, compute_dtype=compute, device_type=device.type,
                   use_autocast=compute != weights)

    @classmethod
    def float32(cls, device: torch.device) -> "PrecisionPolicy":
        """float32 weights and compute: what a restored model runs in for export and prediction, whatever it
        trained in."""
        return cls(torch.float32, torch.float32, device.type, use_autocast=False)

    def for_inference(self) -> "PrecisionPolicy":
        """This policy without a float32 master copy (inference updates no weights): weights in the compute type,
        no autocast."""
        return replace(self, weight_dtype=self.compute_dtype, use_autocast=False)

    @property
    def half_weights(self) -> bool:
        """The weights themselves are half (16.16): no float32 master copy."""
        return self.weight_dtype != torch.float32

    @property
    def half_compute(self) -> bool:
        """Activations are computed in the half type (16.16 and 16.32, unless this CPU fell back to float32)."""
        return self.compute_dtype != torch.float32

    @property
    def float32_master(self) -> bool:
        """float32 master weights under half compute (16.32, by autocast)."""
        return self.half_compute and not self.half_weights

    @property
    def needs_loss_scaling(self) -> bool:
        """float16's narrow range loses small gradients without a loss scale; bfloat16 has float32's range."""
        return self.compute_dtype == torch.float16

    @property
    def name(self) -> str:
        """The compute.master name of what runs ("32.32" where a CPU without bfloat16 arithmetic fell back from
        16.x): the header names this, not the option as typed."""
        return next(name for name in PRECISIONS if half_parts(name) == (self.half_compute, self.half_weights))

    def describe(self) -> str:
        """What the run computes in, in words: "float32", "bfloat16 weights and compute", "float16 compute, float32
        master weights"."""
        half = str(self.compute_dtype).removeprefix("torch.")
        if not self.half_compute:
            return "float32"
        return f"{half} compute, float32 master weights" if self.float32_master else f"{half} weights and compute"

    def autocast(self):
        if not self.use_autocast:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.compute_dtype)

    def apply_to_model(self, model: nn.Module) -> nn.Module:
        """Cast weights for 16.16, keeping normalisation layers (their parameters and statistics) in float32.

        Where the backend has mixed-type normalisation kernels (half input, float32 parameters, float32
        statistics, half output: every norm on CPU, batch norm on CUDA, the same kernels autocast uses)
        the layer is called with its half input as it is. Elsewhere hooks convert the input to float32
        and the output back (two extra copies of every activation, measured 2-3 % of a ResNet-50 step).
        """
        if not self.half_weights:
            return model
        model.to(self.weight_dtype)
        for module in model.modules():
            if isinstance(module, NORM_TYPES):
                module.float()
                if not mixed_type_norm_supported(module, self.device_type, self.weight_dtype):
                    keep_norm_in_float32(module)
        return model


def default_half_dtype(device: torch.device) -> str:
    """The half type of 16.x on `device`: bfloat16 on a CPU (float32's range: no loss scaling) and on a
    GPU with bfloat16 arithmetic (Ampere and later); float16, with Graphcore's application's loss scaling, on an older
    GPU (Volta, Turing), whose tensor cores have no bfloat16."""
    if device.type == "cuda" and not gpu_computes_bfloat16(device):
        return "float16"
    return "bfloat16"


def gpu_computes_bfloat16(device: torch.device) -> bool:
    """Whether the GPU `device` has bfloat16 arithmetic: compute capability 8 (Ampere) and later, or ROCm.

    Not ``torch.cuda.is_bf16_supported()``: it asks the current device rather than this one, and by default
    it also counts bfloat16 that a Volta or Turing GPU only emulates, without tensor cores, far slower than
    its float16.
    """
    if torch.version.hip:
        return True
    return torch.cuda.get_device_capability(device)[0] >= 8


def cpu_half_is_emulated(device: torch.device, half: torch.dtype) -> bool:
    """Whether half arithmetic on this CPU is emulated (slower than float32).

    oneDNN computes bfloat16 natively with AVX512-BF16 or AMX; without them (AVX2-only CPUs such as
    AMD EPYC Milan) bfloat16 operations fall back to emulation through float32 conversions, and torch's half
    convolutions to a generic im2col + matrix product many times slower than float32 (a run that insists on
    the half type computes its convolutions with float32 kernels instead: `cnns.engine.kernel_choice`). float16 on
    the CPU needs AMX-FP16 likewise.
    """
    if device.type != "cpu":
        return False
    if half == torch.bfloat16:
        return not (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    return not torch.cpu._is_amx_fp16_supported()


def mixed_type_norm_supported(module: nn.Module, device_type: str, half: torch.dtype) -> bool:
    """Whether `module` accepts `half` input with float32 parameters natively (checked with torch 2.14.1)."""
    if device_type == "cpu":
        return half in (torch.bfloat16, torch.float16)
    if device_type == "cuda":
        # cuDNN/native batch norm take half input with float32 weights (as under autocast); group and
        # layer norm are left to the hooks there (not verified on a GPU here).
        return isinstance(module, nn.modules.batchnorm._BatchNorm)
    return False


def _to_float32(module: nn.Module, args: tuple) -> tuple:
    return tuple(a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args)


def _back_to_input_dtype(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    return output.to(module._cnns_input_dtype)


def _remember_input_dtype(module: nn.Module, args: tuple) -> tuple:
    module._cnns_input_dtype = args[0].dtype
    return _to_float32(module, args)


def keep_norm_in_float32(module: nn.Module) -> None:
    """Run a normalisation layer in float32 inside a half-precision model.

    Hooks rather than a wrapper module, so the state-dict keys stay those of the plain model.
    """
    module.float()
    module.register_forward_pre_hook(_remember_input_dtype)
    module.register_forward_hook(_back_to_input_dtype)


class LossScaler:
    """Static or dynamic loss scaling.

    Static (``--loss-scaling S``): the loss is multiplied by S before backward and the gradients
    divided by S before the update. Dynamic (``--auto-loss-scaling``): additionally, an update whose
    gradients overflow is skipped and the scale halved; after `growth_interval` clean updates it
    doubles. torch.amp.GradScaler refuses half-precision gradients, which 16.16 produces, and we need
    the skip decision before our own optimiser wrapper runs, so this small class is written by hand.
    """

    def __init__(self, scale: float, dynamic: bool, growth_interval: int = 2000):
        self.scale = float(scale)
        self.dynamic = dynamic
        self.growth_interval = growth_interval
        self.clean_steps = 0

    @property
    def active(self) -> bool:
        return self.dynamic or self.scale != 1.0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.active else loss

    def unscale_(self, grads: list[torch.Tensor], all_finite: Callable[[bool], bool] | None = None) -> bool:
        """Divide the gradients by the scale in place; with dynamic scaling, report whether to step.

        Only dynamic scaling reads a value back to the host (one sync per update); static scaling
        never does. `all_finite` turns this process's verdict into everyone's (pipeline stages hold
        different gradients, and all of them skip an update or none).
        """
        if not self.dynamic:
            if self.active and grads:
                torch._foreach_mul_(grads, 1.0 / self.scale)
            return True
        finite = self._unscale_and_check(grads) if grads else True
        if all_finite is not None:
            finite = all_finite(finite)
        if finite:
            self.clean_steps += 1
            if self.clean_steps >= self.growth_interval:
                self.scale *= 2.0
                self.clean_steps = 0
        else:
            self.scale = max(self.scale / 2.0, 1.0)
            self.clean_steps = 0
        return finite

    def _unscale_and_check(self, grads: list[torch.Tensor]) -> bool:
        # One fused pass that unscales and notes any Inf or NaN (torch.amp.GradScaler's own kernel, on the CPU
        # as on CUDA): it reads each gradient once, where a multiply pass and an isfinite reduction per tensor
        # read every gradient twice and launch two operations per tensor.
        found = torch.zeros(1, device=grads[0].device)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, torch.full_like(found, 1.0 / self.scale))
        return not bool(found.item())

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
