"""Squeeze-and-excitation (EfficientNet's SE block) on the fused passes of ``norm_act.cpp``.

``x * gate(mean_hw(x))`` with torch's operators makes, on a bfloat16 channels_last tensor, a float32 copy of x
for the mean, a multiply, and in the backward two full multiplies, a sum and the mean's broadcast gradient
added into x's: a large share of an EfficientNet training step (docs/performance-history.md). The same arithmetic
is one statistics pass and one scale pass forward, one reduction and one apply backward, all of which
``norm_act.cpp`` already has: the per-sample channel means are its moments with one group per sample, the
scale its affine pass, ``sum_hw(dy * x)`` its backward reduction (no activation, zero mean), and
``dx = gate * dy + d(mean)/HW`` its input-gradient pass.

The gate's small network (two 1x1 convolutions on (N, C, 1, 1) and their activations) runs in torch's
autograd: forward inside this Function, and again in the backward to take its gradient (as activation
checkpointing recomputes), under the forward's autocast state.
"""

from __future__ import annotations

from typing import Callable

import torch

from cnns.kernels import norm_act

_NONE = norm_act.ACTIVATIONS["none"]


class _SqueezeExcite(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")
    def forward(ctx, x: torch.Tensor, excite: Callable[[torch.Tensor], torch.Tensor], *params: torch.Tensor):
        n, c, h, w = x.shape
        rows = norm_act._rows(x, n)  # (N, HW, C)
        # The per-sample channel means, rounded to x's dtype as x.mean((2, 3)) returns them.
        squeezed = norm_act._ext.moments(rows)[0].to(x.dtype).view(n, c, 1, 1)
        gate = excite(squeezed)
        zeros = torch.zeros(n, c, dtype=torch.float32)
        y = norm_act._ext.affine_act(rows, gate.float().view(n, c), zeros, None, _NONE)
        ctx.excite = excite
        ctx.shape = x.shape
        ctx.save_for_backward(rows, squeezed, gate, *params)
        return norm_act._unrows(y, x.shape)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, grad: torch.Tensor):
        rows, squeezed, gate, *params = ctx.saved_tensors
        n, c, h, w = ctx.shape
        g = norm_act._rows(grad, n).to(rows.dtype)
        zeros = torch.zeros(n, c, dtype=torch.float32)
        # d(loss)/d(gate) = sum over pixels of dy * x: the reduction pass with no activation and a zero mean.
        grad_gate = norm_act._ext.backward_reduce(g, rows, None, zeros, zeros, zeros, _NONE)[2]
        with torch.enable_grad():
            inputs = [squeezed.detach().requires_grad_()] + [p for p in params if p.requires_grad]
            recomputed = ctx.excite(inputs[0])
            grads = torch.autograd.grad(recomputed, inputs, grad_gate.to(recomputed.dtype).view_as(recomputed))
        grad_squeezed, grad_params = grads[0], iter(grads[1:])
        # dx = gate * dy + d(loss)/d(mean) / HW: the input-gradient pass with no x term.
        dx = norm_act._ext.input_gradient(g, rows, gate.float().view(n, c), zeros,
                                          grad_squeezed.float().view(n, c) / (h * w))
        param_grads = [next(grad_params) if p.requires_grad else None for p in params]
        return (norm_act._unrows(dx, ctx.shape), None, *param_grads)


def squeeze_excite(x: torch.Tensor, excite: Callable[[torch.Tensor], torch.Tensor],
                   params: list[torch.Tensor]) -> torch.Tensor:
    """``x * excite(x.mean((2, 3), keepdim=True))`` for a (N, C, H, W) CPU tensor; ``excite`` maps the
    (N, C, 1, 1) means to the (N, C, 1, 1) gate using ``params`` (whose gradients are returned)."""
    return _SqueezeExcite.apply(x, excite, *params)
