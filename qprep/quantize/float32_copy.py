"""A float16 or float64 model computes in float32 before it is quantized; its interface keeps its type.

Why: ONNX Runtime's quantizer calibrates and quantizes float32 tensors only. Handed a model exported in
float16 (a `model_fp16.onnx`, or onnxconverter-common's output) it quantized nothing, and the run returned the
float16 model under an INT8 config; a float64 model (skl2onnx with doubles, a scientific export) came back as
it was from ort, and from fp16 with its float64 weights unconverted. Every float16 value is exact in float32,
so a float16 model's weights move over unchanged and only its arithmetic gets more precise; a float64 model's
weights are rounded to float32 (what a float32 export of it would hold). The inputs and outputs keep their
type (a Cast at each), so the result takes the same samples and feeds the same code as the model it replaces.

The copy is checked on calibration samples against the model as given: the outputs must agree to a cosine of
AGREEMENT (ONNX Runtime's CPU runs float16 ops in float32 already and drops the casts between them, so on the
float16 models measured they agree to 1.00000; float64 → float32 rounding moves an output by ~1e-7). A copy
that does not agree is not used (the record gives the figure), nor is one with such types inside control-flow
bodies.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from qprep.graph.verify import cosine, is_numeric, same_nonfinite
from qprep.model.io import subgraphs
from qprep.model.prepare import infer_shapes
from qprep.model.runtime import run_model

AGREEMENT = 0.999  # above float16 rounding on any backend; a wrong rewrite (a type left over, a lost Cast) is far below
CHECKED_SAMPLES = 4
FP32 = TensorProto.FLOAT
OTHER_FLOATS = {TensorProto.FLOAT16: "float16", TensorProto.DOUBLE: "float64"}  # what the copy makes float32
TYPE_ATTRIBUTES = ("to", "dtype")  # Cast's target, RandomNormal/EyeLike/…'s output type


def other_floats(model: onnx.ModelProto) -> list[str]:
    """The float types other than float32 ("float16", "float64") the main graph computes in: float16 in a
    weight, constant, Cast target or interface tensor; float64 in a weight or interface tensor (a float32 model
    that casts to float64 inside, e.g. for a sum, keeps that)."""
    return [OTHER_FLOATS[t] for t in sorted(_other_floats(model.graph))]


def _other_floats(graph: onnx.GraphProto) -> set[int]:
    held = {t.data_type for t in graph.initializer} | {_elem_type(v) for v in [*graph.input, *graph.output]}
    named = {_type_of(a) for n in graph.node for a in n.attribute}
    return (held & set(OTHER_FLOATS)) | ({TensorProto.FLOAT16} & named)


def to_float32(model: onnx.ModelProto, samples: list[dict], threads: int) -> tuple[onnx.ModelProto, dict]:
    """(model computing in float32, record) — or (model as given, record with why not) when the rewrite cannot
    be made or changes the outputs beyond the rounding it may."""
    source = " and ".join(other_floats(model))
    if any(_other_floats(g) for n in model.graph.node for a in n.attribute for g in subgraphs(a)):
        return model, {"applied": False, "from": source,
                       "why": f"{source} inside a control-flow body (If/Loop/Scan), which qprep does not rewrite: "
                              "convert the model to float32 before qprep"}
    copy = _rewritten(model)
    agreement = _agreement(model, copy, samples[:CHECKED_SAMPLES], threads) if samples else None

    def other_weights(graph: onnx.GraphProto) -> int:
        return sum(t.data_type in OTHER_FLOATS for t in graph.initializer)

    casts = sum(n.name.endswith(tuple(f"/to_{name}" for name in ("float32", *OTHER_FLOATS.values())))
                for n in copy.graph.node)
    record = {"applied": True, "from": source, "weights": other_weights(model.graph) - other_weights(copy.graph),
              "interface_casts": casts}
    if agreement is not None:
        record["cosine_min"] = round(agreement, 6)
        if agreement < AGREEMENT:
            return model, {"applied": False, "from": source, "cosine_min": round(agreement, 6),
                           "why": f"its float32 copy's outputs differ from the {source} model's (cosine "
                                  f"{agreement:.4f} < {AGREEMENT}): convert the model to float32 before qprep"}
    return copy, record


def _rewritten(model: onnx.ModelProto) -> onnx.ModelProto:
    """Weights, constants and type attributes float32; a Cast after each float16/float64 input and back before
    each such output; value_info inferred again."""
    upcast = onnx.ModelProto()
    upcast.CopyFrom(model)
    graph = upcast.graph
    kept = {o.name for o in graph.output}  # an initializer that is itself an output keeps its type
    for index, tensor in enumerate(graph.initializer):
        if tensor.data_type in OTHER_FLOATS and tensor.name not in kept:
            graph.initializer[index].CopyFrom(_float32_tensor(tensor))
    weights = {t.name for t in graph.initializer if t.data_type == FP32}
    for value in graph.input:  # an initializer also listed as an input (IR < 4) declares its new type
        if value.name in weights and _elem_type(value) in OTHER_FLOATS:
            value.type.tensor_type.elem_type = FP32
    for node in graph.node:
        for attribute in node.attribute:
            _upcast_attribute(attribute)
    types = {v.name: _elem_type(v) for v in [*graph.input, *graph.output]}
    inputs = {i.name for i in graph.input if types[i.name] in OTHER_FLOATS} - {t.name for t in graph.initializer}
    outputs = ({o.name for o in graph.output if types[o.name] in OTHER_FLOATS} - inputs
               - {t.name for t in graph.initializer})
    renamed = {name: f"{name}/float32" for name in inputs | outputs}
    for node in graph.node:
        node.input[:] = [renamed.get(i, i) for i in node.input]
        node.output[:] = [renamed.get(o, o) for o in node.output]
    casts = [onnx.helper.make_node("Cast", [name], [renamed[name]], to=FP32, name=f"{name}/to_float32")
             for name in sorted(inputs)]
    casts_out = [onnx.helper.make_node("Cast", [renamed[name]], [name], to=types[name],
                                       name=f"{name}/to_{OTHER_FLOATS[types[name]]}") for name in sorted(outputs)]
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


def _type_of(attribute: onnx.AttributeProto) -> int | None:
    """The element type a tensor attribute holds or a type attribute names (None for any other attribute)."""
    if attribute.type == onnx.AttributeProto.TENSOR:
        return attribute.t.data_type
    return attribute.i if attribute.type == onnx.AttributeProto.INT and attribute.name in TYPE_ATTRIBUTES else None


def _upcast_attribute(attribute: onnx.AttributeProto) -> None:
    if _type_of(attribute) not in OTHER_FLOATS:
        return
    if attribute.type == onnx.AttributeProto.TENSOR:
        attribute.t.CopyFrom(_float32_tensor(attribute.t))
    else:
        attribute.i = FP32


def _elem_type(value: onnx.ValueInfoProto) -> int:
    return value.type.tensor_type.elem_type
