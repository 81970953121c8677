"""cnns profile (cnns.bench.opprofile): an update's time by op family, read from profiler traces."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch

from cnns import profiling
from cnns.bench.opprofile import FAMILIES, family_times, read_trace, split_convolution_backward
from cnns.cli.measure import profile_main
from cnns.engine.fusion import fused_norms


def _op(name, ts, dur, cat="cpu_op", tid=1):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid}


def _mark(name, ts, dur):
    return _op(name, ts, dur, cat="user_annotation")


def test_own_times_go_to_the_family_of_the_mark_then_the_name_then_the_parent():
    events = [
        _mark(profiling.UPDATE, 0, 1000),  # skipped: the first update is the warm-up
        _op("aten::convolution", 10, 500),
        _mark(profiling.UPDATE, 2000, 1000),
        _mark(profiling.DATA, 2000, 100), _op("aten::copy_", 2010, 50),  # the data's copy is data
        _op("aten::conv2d", 2100, 300), _op("aten::empty", 2110, 20),  # an empty inside a conv is the conv's
        _op("aten::mkldnn_convolution", 2150, 200),
        _op("autograd::engine::evaluate_function: ConvolutionBackward0", 2400, 200),
        _op("aten::convolution_backward", 2410, 180),
        _op("aten::native_batch_norm_backward", 2600, 100), _op("aten::relu_", 2700, 40),
        _mark(profiling.OPTIMISER, 2750, 200), _op("aten::add_", 2760, 100),  # an addition in the optimiser
        _op("_DepthwiseConvBackward", 2950, 10),  # cnns' routed depthwise backward: a convolution's, not "conv"
        _op("aten::add_", 2960, 10),  # an addition outside it: a gradient accumulation
        _op("aten::relu_", 2970, 10, tid=2),  # another thread: not this update's
    ]
    totals, wall, count = family_times(events, skip=1)
    assert (wall, count) == (1000, 1)
    assert totals["data"] == 100 and totals["convolution forward"] == 300
    assert totals["convolution backward"] == 210 and totals["normalisation backward"] == 100
    assert totals["activations"] == 40 and totals["optimiser"] == 200 and totals["additions"] == 10
    assert totals["other"] == 1000 - 960  # the time in no operator
    split = split_convolution_backward(totals, 0.2)
    assert split["convolution input-gradient"] == 42 and split["convolution weight-gradient"] == 168
    assert set(split) == set(FAMILIES) and sum(split.values()) == wall


def test_the_fused_passes_count_as_normalisation(tmp_path):
    from cnns.kernels import norm_act as kernels

    if not kernels.available():
        pytest.skip("the fused kernels were not built")
    # Large enough (8 MB) that the passes, not the profiler's and autograd's per-call costs, fill the update.
    x = torch.randn(16, 64, 32, 32).contiguous(memory_format=torch.channels_last).requires_grad_()
    weight, bias = torch.ones(64, requires_grad=True), torch.zeros(64, requires_grad=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            with profiling.marked(profiling.UPDATE):
                kernels.group_norm_act(x, 4, weight, bias, 1e-5, "silu").sum().backward()
    prof.export_chrome_trace(str(tmp_path / "x.pt.trace.json"))
    totals, wall, _ = family_times(read_trace(tmp_path))
    # The extension's calls and the layout views around them, inside the marks
    forward, backward = totals["normalisation forward"], totals["normalisation backward"]
    assert forward > 0 and backward > 0
    assert totals.get("activations", 0) == 0  # SiLU is inside the passes
    assert forward + backward > 0.5 * wall


def test_cnns_profile_breaks_both_loops_updates_down(tmp_path, capsys):
    spec = tmp_path / "tiny.yml"
    spec.write_text(textwrap.dedent("""\
        cifar10_images: 256
        benchmarks:
          - name: tiny
            command: >-
              train.py --model resnet --model-size 8 --dataset cifar-10 --data-dir {cifar10}
              --micro-batch-size 16 --iterations 20 --log-freq 1 --no-validation --ckpts-per-epoch 0
        """))
    assert profile_main(["--spec", str(spec), "--benchmark", "tiny", "--updates", "2",
                         "--output-dir", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    rows = {line[:28].strip(): line[28:].split() for line in printed.splitlines()
            if line[:28].strip() in FAMILIES + ("update",)}
    assert set(rows) == set(FAMILIES) | {"update"}, printed
    cnns_ms = {family: float(cells[0]) for family, cells in rows.items()}
    plain_ms = {family: float(cells[2]) for family, cells in rows.items()}
    # Where the norms are fused, cnns's ReLUs run inside the normalisation passes (and are counted there).
    fused = bool(fused_norms(torch.device("cpu"), "auto"))  # the benchmark's run leaves --fused-norm at auto
    for side in (cnns_ms, plain_ms):
        for family in ("convolution forward", "convolution weight-gradient", "convolution input-gradient",
                       "normalisation forward", "normalisation backward", "activations", "optimiser"):
            if not (family == "activations" and side is cnns_ms and fused):
                assert side[family] > 0, (family, printed)
        # every microsecond of an update is in one family (the table's rounding aside)
        assert sum(side[f] for f in FAMILIES) == pytest.approx(side["update"], abs=0.1 * len(FAMILIES))
    if fused:
        assert cnns_ms["activations"] == 0, printed
    assert plain_ms["data"] > 0  # the plain loop waits for its DataLoader's batches
    assert "mean of 2 updates after the first" in printed


def test_a_failing_or_hanging_side_is_one_line(tmp_path):
    import sys

    from cnns.bench.opprofile import run_profiled
    from cnns.errors import CnnsError

    with pytest.raises(CnnsError, match=r"exit 3: boom \(log: "):
        run_profiled([sys.executable, "-c", "import sys; print('boom', file=sys.stderr); sys.exit(3)"], 60,
                     tmp_path / "a.log")
    assert "boom" in (tmp_path / "a.log").read_text()
    with pytest.raises(CnnsError, match="timed out after 1s"):
        run_profiled([sys.executable, "-c", "import time; time.sleep(30)"], 1, tmp_path / "b.log")


def test_only_training_entries_are_profiled(tmp_path):
    from cnns.errors import ConfigError

    spec = tmp_path / "infer.yml"
    spec.write_text(textwrap.dedent("""\
        benchmarks:
          - name: infer
            command: validation.py --model resnet --model-size 8 --dataset cifar-10 --synthetic-data
        """))
    with pytest.raises(ConfigError, match="^benchmark infer: cnns profile takes training entries"):
        profile_main(["--spec", str(spec), "--benchmark", "infer", "--output-dir", str(tmp_path / "out")])


# ------------------------------------------------------------------------------------------------
# CUDA entries: GPU kernels by family (cnns.bench.gpuprofile), from traces of the shape torch.profiler writes

from cnns.bench import gpuprofile  # noqa: E402
from cnns.bench.gpuprofile import (  # noqa: E402
    ACTIVATION, ADD, CONVOLUTION, COPIES, NORM_APPLY, NORM_STATISTICS, OPTIMISER, OTHER, gpu_updates, kernel_family)
from cnns.errors import CnnsError  # noqa: E402

# Kernel names as GPU profilers printed them, verbatim, with the family each must land in.
REAL_KERNELS = [
    # nvprof of a channels_last grouped convolution in float16, pytorch/pytorch#34977
    ("void wgrad2d_grouped_direct_kernel<__half, float, float, cudnnTensorFormat_t=1>(cudnnTensorStruct, __half "
     "const *, cudnnTensorStruct, __half const *, cudnnConvolutionStruct, cudnnFilterStruct, __half*, float, float, "
     "cudnn::reduced_divisor, cudnn::reduced_divisor, cudnn::reduced_divisor, cudnn::reduced_divisor, "
     "cudnn::reduced_divisor, cudnn::reduced_divisor, int)", CONVOLUTION),
    ("void conv2d_grouped_direct_kernel<__half, __half, __half, float, float, bool=1, bool=0, int=1, int=0, int=0>"
     "(cudnnTensorStruct, __half const *, cudnnFilterStruct, __half const *, cudnnConvolutionStruct, "
     "cudnnTensorStruct, __half*, float, float, cudnn::reduced_divisor, cudnn::reduced_divisor, "
     "cudnn::reduced_divisor, cudnn::reduced_divisor, cudnn::reduced_divisor, int, __half const *, float const *, "
     "cudnnActivationStruct)", CONVOLUTION),
    ("[CUDA memcpy DtoD]", COPIES),
    # nvprof, apache/mxnet#14684 and kblomdahl/dream-go#25 (an epilogue's "relu" in a cuDNN name)
    ("volta_scudnn_128x128_stridedB_splitK_xregs_large_nn_v1", CONVOLUTION),
    ("maxwell_scudnn_winograd_128x128_ldg1_ldg4_relu_tile418n_nt", CONVOLUTION),
    # TensorFlow profiler kernel stats of a ResNet, mholmeslinder/semi-supervised-cv,
    # logs/scalars5/20201222-020845/train/plugins/profile/2020_12_22_02_08_58/a0ecb7033138.kernel_stats.pb
    ("void cudnn::detail::bn_bw_1C11_kernel_new<float, float, float2, 512, true, 1>(float, float, float, float, "
     "cudnnTensorStruct, float const*, cudnnTensorStruct, float const*, cudnnTensorStruct, float*, float const*, "
     "float*, float*, float const*, float const*, float)", NORM_STATISTICS),
    ("void cudnn::detail::wgrad_alg0_engine<float, 512, 6, 5, 3, 3, 3, false, 512>(int, int, int, float const*, int, "
     "float*, float const*, kernel_grad_params, int, float, int, int, int, int)", CONVOLUTION),
    # torch.profiler kernel names in a public per-kernel time table from an sm80 GPU (found by exact-string
    # search of public GitHub files; the search index does not name the repository)
    ("sm80_xmma_fprop_implicit_gemm_f16f16_f16f32_f32_nhwckrsc_nhwc_tilesize256x64x32_stage3_warpsize4x1x1_g1_"
     "tensor16x8x16_execute_kernel__5x_cudnn", CONVOLUTION),
    ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x256_32x4_tn_align8>(T1::Params)",
     CONVOLUTION),
    ("void at::native::vectorized_elementwise_kernel<(int)4, at::native::CUDAFunctor_add<c10::Half>, "
     "std::array<char *, (unsigned long)3>>(int, T2, T3)", ADD),
    ("void at::native::vectorized_elementwise_kernel<(int)4, at::native::FillFunctor<int>, "
     "std::array<char *, (unsigned long)1>>(int, T2, T3)", COPIES),
    # Inductor kernels: intel/intel-xpu-backend-for-triton#7863 and #7100 (timm CNNs under torch.compile)
    ("triton_poi_fused__native_batch_norm_legit_no_training_cat_relu_27", NORM_APPLY),
    ("triton_per_fused__native_batch_norm_legit_no_training_add_convolution_mul_native_layer_norm_permute_view_21",
     NORM_STATISTICS),
    # Inductor output_code.py dumps of ResNet/timm training graphs in public repositories (their kernel_name
    # fields, found by exact-string code search)
    ("triton_red_fused__native_batch_norm_legit_functional_0", NORM_STATISTICS),
    ("triton_poi_fused__native_batch_norm_legit_functional_hardswish_2", NORM_APPLY),
    ("triton_poi_fused__native_batch_norm_legit_functional_add_relu_22", NORM_APPLY),
    ("triton_red_fused_native_batch_norm_backward_threshold_backward_14", NORM_STATISTICS),
    ("triton_poi_fused_add_convolution_backward_native_batch_norm_backward_threshold_backward_31", NORM_APPLY),
    ("triton_poi_fused_convolution_0", COPIES),
    ("triton_poi_fused_0", COPIES),
]

# Kernels named in PyTorch's CUDA sources (aten/src/ATen/native/cuda: Normalization.cuh, group_norm_kernel.cu,
# ActivationThresholdKernel.cu, UnaryOpsKernel/clamp, MultiTensorApply.cuh, AmpKernels.cu) as the profiler
# prints templates: not copied from a trace, so kept apart from the verbatim ones above.
SOURCE_NAMED_KERNELS = [
    ("void at::native::batch_norm_collect_statistics_channels_last_kernel<at::native::InvStd, c10::Half, float, 4>"
     "(c10::Half const*, float*, float*, float volatile*, int*, int, int, float)", NORM_STATISTICS),
    ("void at::native::batch_norm_transform_input_channels_last_kernel<c10::Half, float, float, int>(...)",
     NORM_APPLY),
    ("void at::native::batch_norm_backward_reduce_channels_last_kernel<4, c10::Half, float, float, int>(...)",
     NORM_STATISTICS),
    ("void at::native::batch_norm_backward_elemt_channels_last_kernel<4, c10::Half, float, float, int>(...)",
     NORM_APPLY),
    ("void at::native::(anonymous namespace)::RowwiseMomentsCUDAKernel<float>(long, float, float const*, float*, "
     "float*)", NORM_STATISTICS),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::(anonymous namespace)::launch_clamp_scalar("
     "at::TensorIteratorBase&, c10::Scalar, c10::Scalar, at::native::detail::ClampLimits)::{lambda()#1}::operator()"
     "() const::{lambda()#14}::operator()() const::{lambda(c10::Half)#1}, at::detail::Array<char*, 2> >(int, ...)",
     ACTIVATION),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::(anonymous namespace)::threshold_kernel_impl"
     "<c10::Half>(at::TensorIteratorBase&, c10::Half, c10::Half)::{lambda(c10::Half, c10::Half)#1}, "
     "at::detail::Array<char*, 3> >(int, ...)", ACTIVATION),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
     "TensorListMetadata<3>, at::native::(anonymous namespace)::FusedSgdMathFunctor<float, 3>, ...>(...)", OPTIMISER),
    ("void at::native::(anonymous namespace)::amp_update_scale_cuda_kernel(float*, int*, float const*, double, "
     "double, int)", OPTIMISER),
    ("void cudnn::engines_precompiled::nchwToNhwcKernel<__half, __half, float, false, true, "
     "(cudnnKernelDataType_t)0>(...)", COPIES),
    ("void at::native::(anonymous namespace)::max_pool_forward_nhwc<c10::Half, float>(...)", OTHER),
]


@pytest.mark.parametrize("name, family", REAL_KERNELS + SOURCE_NAMED_KERNELS)
def test_each_kernel_name_lands_in_its_family(name, family):
    assert kernel_family(name) == family


def _kernel(name, ts, dur, correlation=None, stream=7, cat="kernel"):
    args = {"device": 0, "stream": stream}
    if correlation is not None:
        args["correlation"] = correlation
    return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur, "args": args}


def _launch(ts, correlation, name="cudaLaunchKernel", cat="cuda_runtime"):
    return {"ph": "X", "cat": cat, "name": name, "pid": 4242, "tid": 1, "ts": ts, "dur": 4,
            "args": {"correlation": correlation, "cbid": 211}}


def _flow_start(ts, correlation):
    return {"ph": "s", "id": correlation, "pid": 4242, "tid": 1, "ts": ts, "cat": "ac2g", "name": "ac2g"}


def _update(ts, dur):
    return {"ph": "X", "cat": "user_annotation", "name": profiling.UPDATE, "pid": 4242, "tid": 1, "ts": ts,
            "dur": dur}


CONV = "sm80_xmma_fprop_implicit_gemm_f16f16_f16f32_f32_nhwckrsc_nhwc_tilesize256x64x32_stage3_warpsize4x1x1_g1_" \
       "tensor16x8x16_execute_kernel__5x_cudnn"
ADD_KERNEL = "void at::native::vectorized_elementwise_kernel<(int)4, at::native::CUDAFunctor_add<c10::Half>, " \
             "std::array<char *, (unsigned long)3>>(int, T2, T3)"
BN_STATS = "triton_red_fused__native_batch_norm_legit_functional_0"


def test_kernels_belong_to_the_update_that_launched_them():
    events = [
        _update(0, 1000),  # the warm-up: its kernels are nobody's
        _launch(500, 1), _kernel(CONV, 2005, 40, correlation=1),  # launched then, run inside update 1's span
        _update(2000, 1000),
        # launched in update 1, run after its CPU span (the CPU left before the GPU finished)
        _launch(2100, 11), _kernel(CONV, 3500, 400, correlation=11),
        # launched in update 1, run while the CPU is inside update 2 (the CPU ran ahead)
        _launch(2950, 12), _kernel(BN_STATS, 5050, 150, correlation=12),
        # the launch only as an ac2g flow (no runtime event in the trace)
        _flow_start(2200, 13), _kernel(ADD_KERNEL, 2300, 30, correlation=13),
        # an addition launched in the optimiser's mark is the optimiser's
        {"ph": "X", "cat": "user_annotation", "name": profiling.OPTIMISER, "pid": 4242, "tid": 1, "ts": 2600,
         "dur": 100},
        _launch(2650, 14), _kernel(ADD_KERNEL, 3950, 20, correlation=14),
        _update(5000, 1000),
        _launch(5100, 21), _kernel(CONV, 5300, 300, correlation=21),
        # a Triton kernel launched by the driver API
        _launch(5150, 22, name="cuLaunchKernel", cat="cuda_driver"),
        _kernel("triton_poi_fused_add_relu_3", 5610, 60, correlation=22),
        _kernel(ADD_KERNEL, 5700, 10),  # no correlation: its own start puts it in update 2
        # a CUDA graph's replay: every kernel in it carries the correlation id of the one cudaGraphLaunch
        _launch(5200, 23, name="cudaGraphLaunch"), _kernel(CONV, 5720, 10, correlation=23),
        _kernel(BN_STATS, 5740, 10, correlation=23),
        _launch(6500, 31), _kernel(CONV, 6600, 100, correlation=31),  # launched after every update: nobody's
    ]
    first, second = gpu_updates(events, skip=1)
    assert first.family_us == {CONVOLUTION: 400, NORM_STATISTICS: 150, ADD: 30, OPTIMISER: 20}
    assert second.family_us == {CONVOLUTION: 300 + 10, ADD: 60 + 10, NORM_STATISTICS: 10}
    # update 1's window runs from its start to its last kernel's end (5200), cut at the next update's start
    assert first.wall_us == 5000 - 2000
    # busy: all GPU activity in the window, the warm-up's late kernel included, the BN kernel (after 5000) not
    assert first.busy_us == 40 + 30 + 400 + 20
    # update 2's: to the later of its CPU end (6000) and its last kernel's end (5750); the BN kernel that
    # update 1 launched runs inside it and keeps the GPU busy there
    assert second.wall_us == 6000 - 5000
    assert second.busy_us == 150 + 300 + 60 + 10 + 10 + 10


def test_traces_read_with_torch_2_11s_function_event_which_takes_no_correlation_keyword(monkeypatch):
    # The H200's torch (2.11.0+cu130) failed here: its FunctionEvent has no linked_correlation_id keyword.
    from torch.autograd.profiler_util import FunctionEvent

    from cnns.bench import opprofile

    class FunctionEventOf2_11(FunctionEvent):
        def __init__(self, *args, **kwargs):
            assert not {"linked_correlation_id", "is_user_annotation"} & kwargs.keys(), "keyword torch 2.11 lacks"
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(opprofile, "FunctionEvent", FunctionEventOf2_11)
    events = [_update(0, 1000), _update(2000, 1000), _launch(2100, 11), _kernel(CONV, 3500, 400, correlation=11),
              _flow_start(2200, 13), _kernel(ADD_KERNEL, 2300, 30, correlation=13), _update(5000, 100)]
    first, _ = gpu_updates(events, skip=1)
    assert first.family_us == {CONVOLUTION: 400, ADD: 30}


def test_kernels_launched_from_autograds_thread_belong_to_the_update_in_whose_time_they_were_launched():
    # On a GPU the backward pass runs on autograd's own thread: its launches are outside the update's mark on
    # the main thread, inside its time.
    backward = _launch(2300, 11)
    backward["tid"] = 2
    events = [_update(0, 1000), _update(2000, 1000), backward, _kernel(CONV, 2400, 100, correlation=11),
              _update(5000, 100)]
    first, _ = gpu_updates(events, skip=1)
    assert first.family_us == {CONVOLUTION: 100}


def test_launch_gaps_are_the_wall_time_less_the_union_of_kernels_on_all_streams():
    events = [
        _update(0, 100), _launch(10, 1), _kernel(CONV, 20, 50, correlation=1),
        _update(1000, 400),
        _launch(1010, 2), _kernel(CONV, 1050, 400, correlation=2, stream=7),
        _launch(1020, 3), _kernel(BN_STATS, 1200, 400, correlation=3, stream=13),  # overlaps on a second stream
        _launch(1030, 4), _kernel(ADD_KERNEL, 1700, 100, correlation=4, stream=7),
        _launch(1040, 5), _kernel("Memcpy DtoD (Device -> Device)", 1650, 20, correlation=5, stream=7,
                                  cat="gpu_memcpy"),
        _update(3000, 100), _launch(3010, 6), _kernel(CONV, 3020, 50, correlation=6),
    ]
    updates = gpu_updates(events, skip=1)
    assert len(updates) == 2  # the first update is skipped
    first = updates[0]
    assert first.wall_us == 1800 - 1000
    union = (1600 - 1050) + 20 + 100  # [1050, 1600] across both streams, the copy, the addition
    assert first.busy_us == union and first.gaps_us == 800 - union
    # kernel time by family counts both overlapping kernels in full
    assert sum(first.family_us.values()) == 400 + 400 + 100 + 20 > first.busy_us
    assert first.family_us[COPIES] == 20
    breakdown = gpuprofile.breakdown_of_updates(updates)
    assert breakdown.updates == 2
    assert breakdown.update_ms == pytest.approx((800 + 100) / 2 / 1e3)
    assert breakdown.gaps_ms == pytest.approx((800 - union + 100 - 50) / 2 / 1e3)
    assert breakdown.ms[CONVOLUTION] == pytest.approx((400 + 50) / 2 / 1e3)


def test_a_cuda_trace_without_kernels_is_one_clear_line(tmp_path):
    trace = {"traceEvents": [_update(0, 100), _update(200, 100),
                             {"ph": "X", "cat": "cpu_op", "name": "aten::conv2d", "pid": 1, "tid": 1, "ts": 210,
                              "dur": 50}]}
    (tmp_path / "host.1.pt.trace.json").write_text(json.dumps(trace))
    with pytest.raises(CnnsError, match=r"^the profiler trace in .* holds no GPU kernels: its profiler did not "
                                        r"record CUDA activity \(ProfilerActivity.CUDA\)$"):
        gpuprofile.gpu_breakdown_of_trace(tmp_path, skip=1)
    with pytest.raises(CnnsError, match=r"holds 2 update\(s\); 3 warm-up"):
        gpuprofile.gpu_breakdown_of_trace(tmp_path, skip=3)


def _resnet8():
    from cnns.models import ModelSpec

    return ModelSpec(arch="resnet", size="8", num_classes=10, image_size=32, norm="batch")


def test_rooflines_count_the_models_flops_and_the_norms_bytes():
    from torch.utils.flop_counter import FlopCounterMode

    from cnns.models import build_model

    spec, batch = _resnet8(), 16
    # FLOPs bound (a bandwidth no memory has): the convolution family's roofline is the training step's
    # FLOPs as torch's own counter counts them, at the matmul rate
    rooflines = gpuprofile.family_rooflines(spec, batch, 1, torch.float16, 1000.0, 1e12)
    with torch.device("meta"):
        model = build_model(spec).train()
        counter = FlopCounterMode(display=False)
        with counter:
            images = torch.empty(batch, 3, 32, 32)
            torch.nn.functional.cross_entropy(model(images), torch.zeros(batch, dtype=torch.long)).backward()
    assert rooflines[CONVOLUTION] == pytest.approx(counter.get_total_flops() / (1000.0 * 1e9) * 1e3, rel=1e-9)
    # bandwidth bound: the statistics read each batch norm's input forward, its input and gradient backward
    inputs = []
    with torch.device("meta"):
        model = build_model(spec).train()
        for module in model.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.register_forward_hook(lambda m, args, out: inputs.append(args[0].numel()))
        model(torch.empty(batch, 3, 32, 32))
    half = 2  # bytes per float16 activation
    bandwidth = 100.0  # GB/s
    rooflines = gpuprofile.family_rooflines(spec, batch, 2, torch.float16, 1e12, bandwidth)
    statistics_bytes = 3 * half * sum(inputs)
    assert rooflines[NORM_STATISTICS] == pytest.approx(2 * statistics_bytes / (bandwidth * 1e9) * 1e3, rel=1e-9)
    # apply: input and output forward, input, gradient and input gradient backward (+ per-channel tensors)
    apply_bytes = rooflines[NORM_APPLY] / 2 * bandwidth * 1e9 / 1e3
    assert 5 * half * sum(inputs) <= apply_bytes <= 5 * half * sum(inputs) + 40 * 4 * sum(
        m.num_features for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d))
    # the optimiser once per update (float32 weight, gradient, momentum read; weight, momentum written)
    params = sum(p.numel() for p in model.parameters())
    assert rooflines[OPTIMISER] == pytest.approx(20 * params / (bandwidth * 1e9) * 1e3, rel=1e-9)
    # norm + act + add reads a norm's input once for both passes: the apply pass's bytes, no statistics pass
    fused = rooflines[NORM_APPLY] + rooflines[ACTIVATION] + rooflines[ADD]
    assert rooflines["norm + act + add"] == pytest.approx(fused)
    assert rooflines[ACTIVATION] > 0 and rooflines[ADD] > 0


def _trace_of_updates(conv_us, norm_us, gap_us, updates=4):
    """A trace of ``updates`` updates, each launching a convolution, a BN statistics kernel and a ReLU with
    ``gap_us`` of idle GPU after each of the first two; the GPU starts 60 us after the update."""
    events, correlation, t = [], 0, 1000.0
    for _ in range(updates):
        events.append(_update(t, 50))
        kernel_start = t + 60
        for name, dur in ((CONV, conv_us), (BN_STATS, norm_us), ("triton_poi_fused_relu_4", 10)):
            correlation += 1
            events += [_launch(t + correlation % 40, correlation), _kernel(name, kernel_start, dur, correlation)]
            kernel_start += dur + gap_us
        t = kernel_start + 100
    return {"traceEvents": events}


def test_profiling_a_cuda_entry_reports_both_sides_against_the_rooflines(tmp_path):
    """The CUDA path end to end but for the GPU: each side's command (cnns compiled, cnns eager, the plain
    loop) is stood in for by one writing a trace where its profiler would."""
    from cnns.bench.rates import DeviceRates
    from cnns.bench.runner import Plan

    spec = _resnet8()
    plan = Plan(argv=["--model", "resnet", "--iterations", "7", "--profile", "--profile-dir",
                      str(tmp_path / "out" / "cnns")],
                script="train.py", mode="train", model_spec=spec, model_label="resnet-8 32px on cuda",
                data="synthetic", batch_size=16, grad_accum=1, baseline={"mode": "train", "device": "cuda"},
                activation_dtype=torch.bfloat16, device="cuda")
    kernels = {"cnns": (300, 100, 20), "cnns-eager": (300, 250, 80), "plain": (310, 260, 90)}
    ran = []

    def fake_run(argv, timeout, log_path):
        if argv[1:3] == ["-m", "cnns.bench.baseline"]:
            where = Path(json.loads(argv[3])["profile_dir"])
        else:
            where = Path(argv[len(argv) - 1 - argv[::-1].index("--profile-dir") + 1])
        ran.append((where.name, "--no-compile" in argv))
        where.mkdir(parents=True)
        (where / "host.1.pt.trace.json").write_text(json.dumps(_trace_of_updates(*kernels[where.name], updates=7)))

    rates = DeviceRates(torch.device("cpu"), peak=2000.0, rates={"bfloat16": 2000.0, "float32": 500.0},
                        bandwidth=100.0)
    report = gpuprofile.profile_cuda_entry("tiny-gpu", plan, tmp_path, tmp_path / "out", 60, run=fake_run, eager=True,
                                           warmup=3, rates=rates)
    assert ran == [("cnns", False), ("cnns-eager", True), ("plain", False)]
    assert report.sides["cnns"].updates == 4 and report.sides["cnns"].ms[CONVOLUTION] == pytest.approx(0.3)
    assert report.sides["cnns eager"].ms[NORM_STATISTICS] == pytest.approx(0.25)
    assert report.sides["cnns"].gaps_ms == pytest.approx((60 + 2 * 20) / 1e3)
    assert report.sides["plain"].gaps_ms == pytest.approx((60 + 2 * 90) / 1e3)
    expected = gpuprofile.family_rooflines(spec, 16, 1, torch.bfloat16, 2000.0, 100.0)
    assert report.rooflines == expected
    text = gpuprofile.format_gpu_report(report)
    rows = {line[:26].strip(): line[26:].split() for line in text.splitlines()}
    # family | cnns ms % | cnns eager ms % | plain ms % | roofline ms | cnns/roofline | cnns eager/roofline
    conv = rows[CONVOLUTION]
    assert float(conv[0]) == pytest.approx(0.30) and float(conv[2]) == pytest.approx(0.30)
    assert float(conv[4]) == pytest.approx(0.31)
    assert float(conv[6]) == pytest.approx(expected[CONVOLUTION], abs=0.005)
    assert float(conv[7]) == pytest.approx(0.30 / expected[CONVOLUTION], abs=0.006)
    assert rows["copies"][6] == "-" and rows["launch gaps"][6] == "-"  # no roofline
    assert float(rows["launch gaps"][4]) > float(rows["launch gaps"][0])  # the plain loop's gaps are longer
    assert "mean of 4 updates after the first 3" in text and "bfloat16 matmul 2000 GFLOP/s" in text


def test_a_cuda_entry_on_a_machine_without_a_gpu_is_one_line(tmp_path):
    from cnns.errors import ConfigError

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    spec = tmp_path / "gpu.yml"
    spec.write_text(textwrap.dedent("""\
        benchmarks:
          - name: gpu
            device: cuda
            command: >-
              train.py --model resnet --model-size 8 --dataset cifar-10 --synthetic-data
              --micro-batch-size 16 --iterations 20 --no-validation --ckpts-per-epoch 0
        """))
    with pytest.raises(ConfigError, match=r"^nothing to run here: benchmark gpu needs cuda; this machine has 0 "):
        profile_main(["--spec", str(spec), "--benchmark", "gpu", "--output-dir", str(tmp_path / "out")])
