"""A model written as a file of its graph: an ONNX graph (torch's dynamo exporter) or an AOTInductor package,
and such a file loaded back as a call (`load_compiled`).

`cnns export` writes both; inference_embedded.py writes and loads the package; `cnns benchmark`'s inference
backends time both. Each file is written under a temporary name in its destination folder and renamed, so the
destination never holds a partial file.

A dynamic batch is `torch.export.Dim("batch", min=1, max=...)`: no upper limit when tracing for the CPU,
`CUDA_MAX_BATCH` when tracing for a CUDA device (below). The exported program records the range it
accepts (`batch_range`), and the export functions return it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from torch import nn

from cnns.errors import CnnsError
from cnns.safe_writes import write_atomically_by_name

ONNX_OPSET = 18
INPUT_NAME = "images"
OUTPUT_NAME = "logits"
# The example batch traced for a dynamic batch dimension: 0 and 1 would be specialised by torch.export.
DYNAMIC_EXAMPLE_BATCH = 2
# The largest batch a dynamic export traced on a CUDA device can admit. In eval mode torch's batch norm runs
# cuDNN's kernel only for batches of at most 65535 (aten/src/ATen/native/Normalization.cpp,
# _select_batch_norm_backend: `input.sym_size(0) <= 65535 && !training`, "spatial, eval"; a larger batch
# takes torch's own kernel). Traced with a symbolic batch, that test becomes the guard `batch <= 65535`,
# and torch.export refuses a Dim wider than its guards: "Constraints violated (batch)! ... 2 <= batch <=
# 65535" (seen with torch 2.11.0+cu130 on an H100; reproduced on the CPU with torch 2.14.1 by tracing
# fake CUDA tensors, tests/test_export.py). The convolutions add no guard. The 2 is no limit: torch.export
# assumes every dynamic size is at least 2 while it traces (0 and 1 would be specialised) and still
# records and accepts min=1. Group-norm models never reach that test, but share the limit (one rule per
# device). A fixed batch has no symbolic guard, so any fixed size exports; the CPU selects no cuDNN, so a
# dynamic batch traced there has no upper limit.
CUDA_MAX_BATCH = 65535


def max_batch(device: torch.device | str) -> int | None:
    """The largest batch a dynamic export traced on `device` can admit: None for no limit."""
    return CUDA_MAX_BATCH if torch.device(device).type == "cuda" else None


def _dynamic_shapes(dynamic: bool, largest: int | None = None):
    if not dynamic:
        return None
    return ({0: torch.export.Dim("batch", min=1, max=largest)},)


def batch_range(program: torch.export.ExportedProgram) -> tuple[int, int | None] | None:
    """The batch sizes an exported program accepts, as torch.export recorded them: (smallest, largest or None
    for no limit); None when the batch is fixed."""
    from torch.utils._sympy.numbers import int_oo

    names = set(program.graph_signature.user_inputs)
    image = next(node for node in program.graph.nodes if node.op == "placeholder" and node.name in names)
    batch = image.meta["val"].shape[0]
    if not isinstance(batch, torch.SymInt):
        return None
    limits = program.range_constraints[batch.node.expr]
    return int(limits.lower), None if limits.upper == int_oo else int(limits.upper)


def export_onnx(module: nn.Module, example: torch.Tensor, dynamic: bool, out: Path,
                largest: int | None = None) -> tuple[int, tuple[int, int | None] | None]:
    """Write the ONNX graph to `out` (atomically), a dynamic batch up to `largest` (None: no limit); returns its
    default-domain opset and the batch range the traced program recorded (None for a fixed batch). The ONNX
    file itself names the dynamic batch but keeps no bounds."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(module, (example,), dynamo=True, opset_version=ONNX_OPSET,
                                    input_names=[INPUT_NAME], output_names=[OUTPUT_NAME],
                                    dynamic_shapes=_dynamic_shapes(dynamic, largest), verbose=False)
    write_atomically_by_name(out, lambda temporary: program.save(str(temporary), external_data=False), ".onnx")
    opset = next(entry.version for entry in program.model_proto.opset_import if entry.domain in ("", "ai.onnx"))
    traced = program.exported_program
    return opset, (batch_range(traced) if traced is not None else (1, largest) if dynamic else None)


def export_program(module: nn.Module, example: torch.Tensor, dynamic: bool,
                   largest: int | None = None) -> torch.export.ExportedProgram:
    """torch.export of the module on the example's device, a dynamic batch up to `largest` (None: no limit).
    A batch range the traced kernels do not allow (torch's "Constraints violated") is a CnnsError of one line
    naming torch's guard."""
    from torch._dynamo.exc import UserError

    try:
        with torch.no_grad():
            return torch.export.export(module, (example,), dynamic_shapes=_dynamic_shapes(dynamic, largest))
    except UserError as exc:
        text = str(exc)
        if "Constraints violated" not in text:
            raise
        guard = next((line.strip(" -") for line in text.splitlines() if "guard" in line), text.splitlines()[0])
        wanted = f"1 to {largest}" if largest is not None else "1 and up"
        raise CnnsError(f"torch {torch.__version__} cannot export a dynamic batch of {wanted} traced on "
                        f"{example.device}: {guard[:300]} (export a fixed --batch-size instead)") from None


def export_pt2(module: nn.Module, example: torch.Tensor, dynamic: bool, out: Path,
               largest: int | None = None) -> tuple[int, int | None] | None:
    """torch.export + AOTInductor into a .pt2 package at `out` (atomically), a dynamic batch up to `largest`
    (None: no limit; `max_batch(device)` is what the device allows); returns the batch range the exported
    program recorded (None for a fixed batch)."""
    exported = export_program(module, example, dynamic, largest)

    def compile_into(temporary: Path) -> None:
        with torch.no_grad():
            torch._inductor.aoti_compile_and_package(exported, package_path=str(temporary))

    write_atomically_by_name(out, compile_into, ".pt2")  # aoti_compile_and_package wants the .pt2 suffix
    return batch_range(exported)


def load_compiled(path: Path, device: torch.device = torch.device("cpu"),
                  threads: int | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """A call images -> logits (a torch tensor) of the file at `path`: an AOTInductor package on `device` (its
    kind's current device when it has no index), or an ONNX graph in onnxruntime on the CPU with `threads`
    intra-op threads (one inter-op thread, sequential execution, every graph optimisation)."""
    if Path(path).suffix != ".onnx":
        return torch._inductor.aoti_load_package(str(path), device_index=-1 if device.index is None else device.index)
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads or 0  # 0: onnxruntime's default
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    return lambda images: torch.from_numpy(session.run(None, {name: images.numpy()})[0])
