"""`python -m cnns.bench.passes [--shape N C H W ...]`: each fused pass alone, against a copy and ATen's layer.

The fused normalisation kernels (`cnns.kernels.norm_act`) make three passes over memory forward and two
backward. This times each on bfloat16 channels_last activations (best of `--calls` calls, by
`cnns.bench.rates.best_seconds`) with its effective bandwidth (the bytes it must move over its time), beside a
copy of the same tensor and batch norm + ReLU forward and backward through ATen and through the fused passes.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from cnns.config.strict_parser import StrictParser
from cnns.bench.rates import best_seconds

SHAPES = [(32, 256, 56, 56), (32, 2048, 7, 7), (128, 16, 32, 32)]  # ResNet-50 stages 1 and 4, ResNet-20 stage 1


def best_ms(fn, calls: int) -> float:
    return 1e3 * best_seconds(fn, calls)


def pass_times(shape: tuple[int, int, int, int], calls: int) -> dict[str, float]:
    """ms per call of each pass and of the reference operations, for one activation shape."""
    from cnns.kernels.norm_act import ACTIVATIONS, _ext, batch_norm_act

    relu = ACTIVATIONS["relu"]
    n, c, h, w = shape
    rows = torch.randn(1, n * h * w, c).bfloat16()
    grad = torch.randn_like(rows)
    scale, shift, mean = torch.ones(1, c), torch.zeros(1, c), torch.zeros(1, c)
    out = _ext.affine_act(rows, scale, shift, None, relu)
    gz = _ext.backward_reduce(grad, rows, out, scale, shift, mean, relu)[0]
    x = rows.view(n, h, w, c).permute(0, 3, 1, 2).detach().requires_grad_()  # channels_last (N, C, H, W)
    g = grad.view(n, h, w, c).permute(0, 3, 1, 2)
    weight, bias = torch.ones(c, requires_grad=True), torch.zeros(c, requires_grad=True)
    running_mean, running_var = torch.zeros(c), torch.ones(c)

    def aten_layer():
        F.relu(F.batch_norm(x, running_mean, running_var, weight, bias, True, 0.1, 1e-5)).backward(g)

    def fused_layer():
        batch_norm_act(x, weight, bias, running_mean, running_var, None, 0.1, 1e-5, "relu").backward(g)

    return {
        "moments": best_ms(lambda: _ext.moments(rows), calls),
        "apply": best_ms(lambda: _ext.affine_act(rows, scale, shift, None, relu), calls),
        "backward reduce": best_ms(lambda: _ext.backward_reduce(grad, rows, out, scale, shift, mean, relu), calls),
        "input gradient": best_ms(lambda: _ext.input_gradient(gz, rows, scale, scale, shift), calls),
        "copy": best_ms(lambda: rows.clone(), calls),
        "ATen BN+ReLU fwd+bwd": best_ms(aten_layer, calls),
        "fused BN+ReLU fwd+bwd": best_ms(fused_layer, calls),
    }


# Tensors each pass must read plus write, in units of the activation: what its bandwidth is counted over.
TENSOR_PASSES = {"moments": 1, "apply": 2, "backward reduce": 4, "input gradient": 3, "copy": 2}


def main(argv: list[str] | None = None) -> int:
    parser = StrictParser(prog="python -m cnns.bench.passes", description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, nargs=4, action="append", metavar=("N", "C", "H", "W"),
                        help="activation shapes (repeatable); default: " + ", ".join("x".join(map(str, shape)) for shape in SHAPES))
    parser.add_argument("--calls", type=int, default=9, help="timed calls per figure (the best is kept)")
    args = parser.parse_args(argv)
    from cnns.engine.build import keep_freed_host_memory
    from cnns.kernels import norm_act

    if not norm_act.available():
        print("cnns.bench.passes: the fused kernels are not built here")
        return 1
    keep_freed_host_memory(torch.device("cpu"), enabled=True)  # as a run does unless --no-malloc-tuning
    print(f"build {norm_act._ext.name}, {torch.get_num_threads()} threads, bfloat16")
    for shape in [tuple(s) for s in args.shape] if args.shape else SHAPES:
        megabytes = torch.Size(shape).numel() * 2 / 1e6
        times = pass_times(shape, args.calls)
        cells = [f"{name} {ms:.3f} ms" + (f" ({TENSOR_PASSES[name] * megabytes / ms:.0f} GB/s)"
                                          if name in TENSOR_PASSES else "") for name, ms in times.items()]
        print(f"{shape} {megabytes:.0f} MB: " + ", ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
