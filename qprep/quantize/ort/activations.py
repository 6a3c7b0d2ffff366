"""`activations: auto` — static (calibrated) or dynamic activation ranges, chosen from the model's structure.

Why: ONNX Runtime's own guidance is static quantization for CNNs and dynamic for transformers and RNNs, and
the zoo measured it (BENCHMARKS.md: "activations: auto"): a transformer with static ranges can stay far from
its target after a long fallback search where dynamic MatMuls meet it with no search at all; CNNs need static
ranges to quantize their Convs at all. The rule: dynamic when the model has attention (a MatMul of two
activations) and its weighted MatMul/Gemm layers carry more multiply-adds than its convolutions; static otherwise.
"""

from __future__ import annotations

import onnx

from qprep.model.info import constant_names, multiply_adds


def attention_matmuls(model: onnx.ModelProto) -> int:
    """MatMul nodes whose two inputs are both computed (Q·Kᵀ, attention·V), not a weight."""
    constants = constant_names(model.graph)
    return sum(1 for n in model.graph.node if n.op_type == "MatMul" and len(n.input) == 2
               and not (set(n.input) & constants))


def choose(model: onnx.ModelProto) -> tuple[str, str]:
    """("static" | "dynamic", the reason in words for the report)."""
    attention = attention_matmuls(model)
    macs = multiply_adds(model)
    ops = {n.name: n.op_type for n in model.graph.node}
    dense = sum(m for name, m in macs.items() if ops.get(name) in ("MatMul", "Gemm"))
    conv = sum(m for name, m in macs.items() if ops.get(name) in ("Conv", "ConvTranspose"))
    share = dense / (dense + conv) if dense + conv else 0.0
    if attention and share > 0.5:
        return "dynamic", (f"auto: {attention} attention MatMuls and {share:.0%} of the multiply-adds in "
                           "MatMul/Gemm (a transformer): dynamic ranges")
    what = f"{attention} attention MatMuls, " if attention else "no attention, "
    return "static", f"auto: {what}{share:.0%} of the multiply-adds in MatMul/Gemm: calibrated static ranges"
