"""Per-layer error: where along the network the quantized model drifts from the float one.

Tensors are matched by name: a float-model tensor T is compared with the quantized model's rounded copy
`T_DequantizeLinear_Output` when ORT's QDQ quantizer made one (the error quantizing T adds), else with T
itself. Both models run end to end, so this is the *accumulated* error at each tensor.
"""

from __future__ import annotations

import numpy as np
import onnx

from qprep.evaluate.metrics import compare_output
from qprep.model.runtime import intermediate_values

QDQ_SUFFIX = "_DequantizeLinear_Output"


def matched_tensors(float_model: onnx.ModelProto, quantized: onnx.ModelProto) -> list[tuple[str, str, str, str]]:
    """(float tensor, quantized tensor, op type, node name) for every float node output found in both."""
    produced = {out for node in quantized.graph.node for out in node.output}
    graph_outputs = {o.name for o in float_model.graph.output}
    pairs = []
    for node in float_model.graph.node:
        if node.op_type in ("Constant", "Shape") or not node.output:
            continue
        tensor = node.output[0]
        if not tensor or tensor in graph_outputs:
            continue
        for candidate in (tensor + QDQ_SUFFIX, tensor):
            if candidate in produced:
                pairs.append((tensor, candidate, node.op_type, node.name))
                break
    return pairs


def layer_errors(float_model: onnx.ModelProto, quantized: onnx.ModelProto, samples: list[dict],
                 threads: int = 2) -> list[dict]:
    """Cosine and SQNR per matched float tensor, worst (lowest SQNR) first."""
    pairs = matched_tensors(float_model, quantized)
    if not pairs:
        return []
    ref = _collect(float_model, [p[0] for p in pairs], samples, threads)
    res = _collect(quantized, [p[1] for p in pairs], samples, threads)
    rows = []
    for order, (tensor, twin, op_type, node) in enumerate(pairs):
        a, b = ref.get(tensor), res.get(twin)
        if a is None or b is None or a[0].dtype.kind != "f" or any(x.shape != y.shape for x, y in zip(a, b)):
            continue
        m = compare_output(a, b, "tensor")
        rows.append({"tensor": tensor, "node": node, "op_type": op_type, "order": order,
                     "cosine_mean": m["cosine_mean"], "cosine_min": m["cosine_min"], "sqnr_db": m["sqnr_db"],
                     "quantized": twin != tensor})
    return sorted(rows, key=lambda r: (-float("inf") if r["sqnr_db"] is None else r["sqnr_db"], r["order"]))


def _collect(model: onnx.ModelProto, names: list[str], samples: list[dict], threads: int) -> dict[str, list]:
    collected: dict[str, list[np.ndarray]] = {}
    for values in intermediate_values(model, names, samples, threads):
        for name, value in values.items():
            collected.setdefault(name, []).append(value)
    return collected
