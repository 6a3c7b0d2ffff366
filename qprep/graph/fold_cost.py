"""What evaluating one node costs, in multiply-adds or element operations, before it is run: constant folding
leaves a node whose cost is over a budget as it is (and says so) instead of running it for minutes.

Why an estimate, not a timer: a timer can only stop work already spent, and an evaluation inside ONNX Runtime
cannot be interrupted. Cost = output elements × a per-op factor; MatMul/Gemm/Conv by multiply-adds; Resize by
the taps its mode reads per output element (cubic: 4 per resized axis, so 16 for a 2-D resize). Unknown shapes
fall back to the elements read, so a node is never free.
"""

from __future__ import annotations

import math

import numpy as np

# A node over this many operations is left unfolded. ONNX Runtime runs ~1e9 simple operations a second on one
# core: the budget keeps one node to seconds, far above any weight transpose, shape computation or position
# embedding resize of a real model (a ViT-L's bicubic pos-embedding resize to 518 px: ~6e7).
BUDGET = 4_000_000_000

_PER_ELEMENT = {  # operations per output element, for ops dearer than one
    "Erf": 8, "Exp": 4, "Log": 4, "Pow": 8, "Sqrt": 2, "Tanh": 8, "Sigmoid": 4, "Softmax": 6, "LogSoftmax": 6,
    "Sin": 8, "Cos": 8, "Gelu": 10, "LayerNormalization": 8, "InstanceNormalization": 8,
    "BatchNormalization": 2, "CumSum": 2, "GridSample": 16,
}
_TAPS = {"nearest": 1, "linear": 2, "cubic": 4}  # Resize: samples read per resized axis


def node_cost(op_type: str, attributes: dict, inputs: list[tuple | None], outputs: list[tuple | None]) -> int:
    """Estimated operations for one evaluation. `inputs`/`outputs` are shapes (tuples of ints) or None when
    unknown; `attributes` maps names to Python values (only `mode` and `group` are read)."""
    read = sum(elements(shape) for shape in inputs if shape is not None)
    written = sum(elements(shape) for shape in outputs if shape is not None)
    out = outputs[0] if outputs else None
    if out is None:  # unknown result: at least what it reads (a MatMul of unknown shape: its inputs' product)
        return max(read, 1) * (_matmul_fallback(inputs) if op_type in ("MatMul", "Gemm") else 1)
    if op_type in ("MatMul", "Gemm", "MatMulInteger") and inputs and inputs[0]:
        depth = inputs[0][-1] if op_type != "Gemm" or not attributes.get("transA") else inputs[0][0]
        return elements(out) * max(int(depth), 1)
    if op_type in ("Conv", "ConvInteger", "ConvTranspose") and len(inputs) > 1 and inputs[1]:
        weight = inputs[1]  # [M, C/group, k...]: each output element reads C/group × kernel inputs
        per = elements(weight[1:]) if op_type != "ConvTranspose" else elements(weight) // max(int(weight[0]), 1)
        base = elements(out) if op_type != "ConvTranspose" else elements(inputs[0] or out)
        return base * max(per, 1)
    if op_type == "Resize":
        resized = _resized_axes(inputs[0], out)
        return elements(out) * _TAPS.get(str(attributes.get("mode", "nearest")), 4) ** resized
    if op_type.startswith("Reduce") or op_type in ("ArgMax", "ArgMin", "TopK", "Einsum"):
        return max(read, written)
    return max(written * _PER_ELEMENT.get(op_type, 1), read)


def elements(shape) -> int:
    """Elements of a static shape (0 for an unknown one)."""
    return int(math.prod(int(d) for d in shape)) if shape is not None else 0


def _resized_axes(before, after) -> int:
    if before is None or len(before) != len(after):
        return max(len(after) - 2, 1)
    return max(sum(1 for a, b in zip(before, after) if a != b), 1)


def _matmul_fallback(inputs) -> int:
    """A MatMul whose result shape is unknown: the shared dimension is at most the first input's last one."""
    first = inputs[0] if inputs else None
    return int(first[-1]) if first else int(np.sqrt(max(sum(elements(s) for s in inputs if s), 1)))
