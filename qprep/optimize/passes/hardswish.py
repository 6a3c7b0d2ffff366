"""hardswish_for_ort: HardSwish written out as x · clip(x + 3, 0, 6) / 6 when ONNX Runtime will quantize the model.

Why: ONNX Runtime's quantizer has no int8 HardSwish, so each one ran in float between a DequantizeLinear and a
QuantizeLinear, and a model made of them can run slower as INT8 than as FP32. Written out, the Add and Mul are
quantized (QLinearAdd, QLinearMul; the Clip and Div fold into their ranges), as a paddle2onnx export spells it
(BENCHMARKS.md: "HardSwish written out for ORT"). Other backends keep the op: RKNN runs HardSwish on the NPU, and
float16 has nothing to quantize.

Form: HardSwish(x) on a float32 x (its dtype known), default domain.
Math: HardSwish(x) = x · max(0, min(1, x/6 + 1/2)) = x · clip(x + 3, 0, 6) / 6 (ONNX's definition, α = 1/6,
β = 1/2). The stage verifies the numbers, as for every pass.
Replacement: Add(x, 3) → Clip(·, 0, 6) → Div(·, 6) → Mul(x, ·), named under the HardSwish; the Mul takes over its output.
"""

from __future__ import annotations

import onnx_ir as ir

from qprep.graph.ir import default_opset
from qprep.graph.rules import ReplacementBuilder, all_graphs, names_in_use, take_over
from qprep.optimize.passes import GraphPass, PassOutcome, PassSettings


def apply(model: ir.Model, settings: PassSettings) -> PassOutcome:
    if settings.backend != "ort":
        return PassOutcome(0)
    names, opset = names_in_use(model), default_opset(model)
    written, left = 0, 0
    for graph in all_graphs(model):
        for node in [n for n in graph if n.op_type == "HardSwish" and n.domain == ""]:
            x = node.inputs[0]
            if x is None or x.dtype != ir.DataType.FLOAT:
                left += 1
                continue
            b = ReplacementBuilder(node, names, opset)
            six = b.scalar(6.0, "six")
            clip = b.op("Clip", b.op("Add", x, b.scalar(3.0, "three")), b.scalar(0.0, "zero"), six)
            mul = b.op("Mul", x, b.op("Div", clip, six))
            graph.insert_before(node, b.nodes)
            take_over(node.outputs[0], mul)
            graph.remove(node, safe=True)
            written += 1
    details = {**({"written_out": written} if written else {}), **({"left_not_float32": left} if left else {})}
    return PassOutcome(written, details)


PASS = GraphPass(name="hardswish_for_ort", apply=apply,
                 doc="HardSwish written out as x·clip(x+3, 0, 6)/6 for backend ort, whose quantizer has no int8 "
                     "HardSwish (it ran float between Q/DQ pairs)")
