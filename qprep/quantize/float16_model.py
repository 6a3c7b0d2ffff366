"""A float16 model computes in float32 before it is quantized; its interface stays float16.

Why: ONNX Runtime's quantizer calibrates and quantizes float32 tensors only. Handed a model exported in
float16 (a `model_fp16.onnx`, or onnxconverter-common's output), it quantized nothing and the run returned the
float16 model under an INT8 config. Every float16 value is exact in float32, so the weights move over
unchanged; only the arithmetic gets more precise. The inputs and outputs keep their float16 type (a Cast at
each), so the result takes the same samples and feeds the same code as the model it replaces.

The rewrite is checked on calibration samples against the model as given: the outputs must agree to a cosine
of AGREEMENT (ONNX Runtime's CPU runs float16 ops in float32 already and drops the casts between them, so on the
models measured they agree to 1.00000; the check is there for a rewrite that got something wrong). A copy that
does not agree is not used (the record gives the figure), nor is one with float16 inside control-flow bodies.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from qprep.model.io import subgraphs
from qprep.model.prepare import infer_shapes
from qprep.model.runtime import run_model
from qprep.verify import cosine, is_numeric, same_nonfinite

AGREEMENT = 0.999  # above float16 rounding on any backend; a wrong rewrite (a type left over, a lost Cast) is far below
CHECKED_SAMPLES = 4
FP16, FP32 = TensorProto.FLOAT16, TensorProto.FLOAT
TYPE_ATTRIBUTES = ("to", "dtype")  # Cast's target, RandomNormal/EyeLike/…'s output type


def holds_float16(model: onnx.ModelProto) -> bool:
    """Whether any weight, constant, Cast target or interface tensor of the main graph is float16."""
    return _holds_float16(model.graph)


def _holds_float16(graph: onnx.GraphProto) -> bool:
    return (any(t.data_type == FP16 for t in graph.initializer)
            or any(_elem_type(v) == FP16 for v in [*graph.input, *graph.output])
            or any(_float16_attribute(a) for n in graph.node for a in n.attribute))


def to_float32(model: onnx.ModelProto, samples: list[dict], threads: int) -> tuple[onnx.ModelProto, dict]:
    """(model computing in float32, record) — or (model as given, record with why not) when the rewrite cannot
    be made or changes the outputs beyond float16's rounding."""
    if any(_holds_float16(g) for n in model.graph.node for a in n.attribute for g in subgraphs(a)):
        return model, {"applied": False, "why": "float16 inside a control-flow body (If/Loop/Scan), which qprep "
                                                "does not rewrite: convert the model to float32 before qprep"}
    upcast = _rewritten(model)
    agreement = _agreement(model, upcast, samples[:CHECKED_SAMPLES], threads) if samples else None
    def half_weights(graph: onnx.GraphProto) -> int:
        return sum(t.data_type == FP16 for t in graph.initializer)

    casts = sum(n.name.endswith(("/to_float32", "/to_float16")) for n in upcast.graph.node)
    record = {"applied": True, "weights": half_weights(model.graph) - half_weights(upcast.graph),
              "interface_casts": casts}
    if agreement is not None:
        record["cosine_min"] = round(agreement, 6)
        if agreement < AGREEMENT:
            return model, {"applied": False, "cosine_min": round(agreement, 6),
                           "why": f"its float32 copy's outputs differ from the float16 model's (cosine "
                                  f"{agreement:.4f} < {AGREEMENT}): convert the model to float32 before qprep"}
    return upcast, record


def _rewritten(model: onnx.ModelProto) -> onnx.ModelProto:
    """Weights, constants and type attributes float32; a Cast after each float16 input and before each float16
    output; value_info inferred again."""
    upcast = onnx.ModelProto()
    upcast.CopyFrom(model)
    graph = upcast.graph
    kept = {o.name for o in graph.output}  # an initializer that is itself an output keeps its type
    for index, tensor in enumerate(graph.initializer):
        if tensor.data_type == FP16 and tensor.name not in kept:
            graph.initializer[index].CopyFrom(_float32_tensor(tensor))
    weights = {t.name for t in graph.initializer if t.data_type == FP32}
    for value in graph.input:  # an initializer also listed as an input (IR < 4) declares its new type
        if value.name in weights and _elem_type(value) == FP16:
            value.type.tensor_type.elem_type = FP32
    for node in graph.node:
        for attribute in node.attribute:
            _upcast_attribute(attribute)
    inputs = {i.name for i in graph.input if _elem_type(i) == FP16} - {t.name for t in graph.initializer}
    outputs = {o.name for o in graph.output if _elem_type(o) == FP16} - inputs - {t.name for t in graph.initializer}
    renamed = {name: f"{name}/float32" for name in inputs | outputs}
    for node in graph.node:
        node.input[:] = [renamed.get(i, i) for i in node.input]
        node.output[:] = [renamed.get(o, o) for o in node.output]
    casts = [onnx.helper.make_node("Cast", [name], [renamed[name]], to=FP32, name=f"{name}/to_float32")
             for name in sorted(inputs)]
    casts_out = [onnx.helper.make_node("Cast", [renamed[name]], [name], to=FP16, name=f"{name}/to_float16")
                 for name in sorted(outputs)]
    nodes = casts + list(graph.node) + casts_out
    del graph.node[:]
    graph.node.extend(nodes)
    del graph.value_info[:]
    return infer_shapes(upcast)[0]


def _agreement(original: onnx.ModelProto, upcast: onnx.ModelProto, samples: list[dict], threads: int) -> float:
    """The lowest cosine over float outputs and samples between the two models; 0 when NaN/Inf differ."""
    worst = 1.0
    for before, after in zip(run_model(original, samples, threads), run_model(upcast, samples, threads)):
        for name, value in before.items():
            if not is_numeric(value) or value.dtype.kind != "f" or not value.size:
                continue
            a, b = value.astype(np.float64), after[name].astype(np.float64)
            if not same_nonfinite(a, b):
                return 0.0
            finite = np.isfinite(a)
            if np.any(a[finite]) and np.any(b[finite]):
                worst = min(worst, cosine(a[finite], b[finite]))
    return worst


def _float32_tensor(tensor: onnx.TensorProto) -> onnx.TensorProto:
    return numpy_helper.from_array(numpy_helper.to_array(tensor).astype(np.float32), tensor.name)


def _float16_attribute(attribute: onnx.AttributeProto) -> bool:
    if attribute.type == onnx.AttributeProto.TENSOR:
        return attribute.t.data_type == FP16
    return attribute.type == onnx.AttributeProto.INT and attribute.name in TYPE_ATTRIBUTES and attribute.i == FP16


def _upcast_attribute(attribute: onnx.AttributeProto) -> None:
    if attribute.type == onnx.AttributeProto.TENSOR and attribute.t.data_type == FP16:
        attribute.t.CopyFrom(_float32_tensor(attribute.t))
    elif attribute.type == onnx.AttributeProto.INT and attribute.name in TYPE_ATTRIBUTES and attribute.i == FP16:
        attribute.i = FP32


def _elem_type(value: onnx.ValueInfoProto) -> int:
    return value.type.tensor_type.elem_type
