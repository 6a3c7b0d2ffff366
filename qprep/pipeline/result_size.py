"""A result bigger than the float model it came from: a warning with both sizes, the likely reason when the graph
shows one.

Why: quantizing is done to make a model smaller and faster; an int8 result (ort, rknn) larger than its float
model, or an fp16 one larger than half of it, is never what the user asked for, and the report's size line alone
went unread (a CRNN whose .rknn was 4× its 19 MB float model). The bound has a slack for what a quantized graph
adds beside its weights (Q/DQ nodes, scales, a toolkit's own structures), which outweighs the weights of a tiny
model. The reference's size counts its external data files: the .onnx of a model saved with them is only its
graph.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx

# The result's expected size against its float32 model: int8 weights are a quarter, but a float-kept layer keeps
# its float weights, so the bound is the float size itself; fp16 halves every weight it converts
BOUND_SHARE = {"ort": 1.0, "rknn": 1.0, "fp16": 0.5, None: 1.0}
EXPECTED = {"ort": "an int8 result", "rknn": "an int8 result", "fp16": "an fp16 result (half the float size)",
            None: "a float result (about the same size)"}
SLACK_SHARE, SLACK_BYTES = 0.10, 256 * 1024


def record(report: dict, model: onnx.ModelProto) -> None:
    """The evaluation's sizes as the run wrote them (the reference with its external data), and the warning, first
    in the report's warnings (the terminal shows the first few), when the result is larger than it should be.
    `model`: the result's ONNX model (RKNN: the float model the .rknn was built from)."""
    sizes = report["evaluation"]["size_bytes"]
    try:
        sizes["reference"] = model_bytes(report.get("reference_model") or report["model"])
    except OSError:  # a data file moved since the run read it: the .onnx file's size stays
        pass
    if (report.get("model") or {}).get("kind") != "float":  # a QDQ input is no float model to compare with
        return
    quantize = next((s for s in reversed(report.get("stages", [])) if s.get("name") == "quantize"), {})
    backend = quantize.get("backend") if quantize.get("status") == "ok" else None
    float16_input = (quantize.get("float32_copy") or {}).get("from") == "float16"
    name = (report["result"].get("deployable") or report["result"])["path"]
    excess = sizes["result"] - sizes["reference"]
    reason = shared_weights_reason(model, excess) if backend == "rknn" and excess > 0 else ""
    warning = size_warning(sizes["reference"], sizes["result"], backend, name, reason, float16_input)
    if warning:
        report["warnings"].insert(0, warning)


def model_bytes(record: dict) -> int:
    """A model file's bytes with its external data files' (preflight's record of it: `path`, and `data_files`
    named from the model's folder)."""
    path = Path(record["path"])
    return path.stat().st_size + sum((path.parent / name).stat().st_size for name in record.get("data_files") or {})


def bound(reference: int, backend: str | None, float16_input: bool = False) -> int:
    """The largest result size that is not a surprise: the backend's share of the reference (an fp16 input's
    weights are already half: its fp16 result is not), plus the slack."""
    share = 1.0 if float16_input else BOUND_SHARE.get(backend, 1.0)
    return int(reference * share * (1 + SLACK_SHARE)) + SLACK_BYTES


def size_warning(reference: int, result: int, backend: str | None, name: str, reason: str = "",
                 float16_input: bool = False) -> str | None:
    """The warning for a result of `result` bytes built by `backend` (ort, rknn, fp16; None: nothing quantized)
    from a float model of `reference` bytes, or None when it is within the bound."""
    if reference <= 0 or result <= bound(reference, backend, float16_input):
        return None
    expected = "an fp16 input's result" if float16_input else EXPECTED.get(backend, EXPECTED[None])
    return (f"the result {name} is {result / 1e6:.2f} MB, {result / reference:.1f}× the float model it came from "
            f"({reference / 1e6:.2f} MB); {expected} is expected to be smaller"
            + (f"; likely reason: {reason}" if reason else "; check which layers carry the weight"))


def shared_weights_reason(model: onnx.ModelProto, excess: int) -> str:
    """RKNN: weights read by several nodes (an unrolled recurrent layer's steps: one Gemm per step reading the same
    weight) are counted once in the ONNX file; a .rknn that holds a copy per reading node grows by their int8
    bytes per extra reader. Named when those copies would explain at least half of the excess `excess` bytes.
    Not always so: the toolkit kept one copy for 8 Gemms sharing a weight in a small test; a CRNN's 33 weights
    read up to 42 times each made its .rknn 4× the float model, about what one int8 copy per reader adds."""
    initializers = {t.name: t for t in model.graph.initializer}
    readers = Counter(name for node in model.graph.node for name in set(node.input) if name in initializers)
    shared = {name: count for name, count in readers.items() if count > 1}
    if not shared:
        return ""
    float_bytes = {name: _bytes(initializers[name]) for name in shared}
    copies = sum((count - 1) * float_bytes[name] // 4 for name, count in shared.items())  # at int8
    if copies * 2 < excess:
        return ""
    return (f"{len(shared)} weight(s) ({sum(float_bytes.values()) / 1e6:.2f} MB) are each read by several nodes "
            f"(up to {max(shared.values())}, e.g. an unrolled recurrent layer's steps), and rknn-toolkit2 may store "
            f"a copy per reading node: {copies / 1e6:.2f} MB more at int8 if it does")


def _bytes(tensor: onnx.TensorProto) -> int:
    return int(np.prod(tensor.dims, dtype=np.int64)) * onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
