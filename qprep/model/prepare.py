"""Make a freshly loaded model ready for the stages: stable node names, fixed input dims, shapes inferred,
and for a backend with an opset ceiling (rknn-toolkit2: 19), the model converted down to it.

Why: rewrites, per-layer reports and RKNN's hybrid-quantization config all refer to nodes by name, so every
node needs a unique, reproducible one; quantizers and shape folding need the concrete input sizes the user
deploys with.
"""

from __future__ import annotations

import logging
import re

import numpy as np
import onnx
import onnx.version_converter
from onnx import helper, numpy_helper

from qprep.errors import ConfigError, ModelError
from qprep.model.info import default_opset, graph_inputs, has_control_flow, unique_name
from qprep.model.io import inferred_shapes, subgraphs, weightless

log = logging.getLogger("qprep")


def name_nodes(graph: onnx.GraphProto, taken: set[str] | None = None, prefix: str = "") -> int:
    """Give every unnamed (or duplicate-named) node a unique name `<op>_<n>`; returns how many were named.

    Names depend only on graph order and op types, so the same model always gets the same names.
    """
    taken = set() if taken is None else taken
    renamed = 0
    counters: dict[str, int] = {}
    for node in graph.node:
        if not node.name or node.name in taken:
            base = f"{prefix}{node.name or node.op_type}"
            n = counters.get(base, 0)
            while f"{base}_{n}" in taken:
                n += 1
            counters[base] = n + 1
            node.name = f"{base}_{n}"
            renamed += 1
        taken.add(node.name)
        for attr in node.attribute:
            for sub in subgraphs(attr):
                renamed += name_nodes(sub, taken, prefix=f"{node.name}/")
    return renamed


def fix_input_shapes(model: onnx.ModelProto, shapes: dict[str, list[int]]) -> list[str]:
    """Replace input dims by the concrete sizes the config gives; returns the inputs changed.

    A static dim may only be restated, never changed: a model exported for 224x224 does not run at 320.
    """
    inputs = {v.name: v for v in model.graph.input}
    real = {s.name for s in graph_inputs(model)}
    changed = []
    for name, dims in shapes.items():
        if name not in real:
            raise ConfigError(f"inputs.{name}: the model has no input '{name}' (inputs: {', '.join(sorted(real))})")
        shape = inputs[name].type.tensor_type.shape
        if len(shape.dim) != len(dims):
            raise ConfigError(
                f"inputs.{name}: {len(dims)} dims given, the model's input has rank {len(shape.dim)}"
            )
        for i, (dim, size) in enumerate(zip(shape.dim, dims)):
            if dim.HasField("dim_value") and dim.dim_value >= 0 and dim.dim_value != size:
                raise ConfigError(
                    f"inputs.{name}[{i}]: the model fixes this dim to {dim.dim_value}; {size} cannot be used"
                )
            dim.Clear()
            dim.dim_value = int(size)
        changed.append(name)
    return changed


def fix_input_dims_ort_accepts(model: onnx.ModelProto, shapes: dict[str, list[int]]) -> tuple[list[str], dict[str, str]]:
    """fix_input_shapes, but only for the inputs whose fixed dims ONNX Runtime still loads the model with →
    (inputs fixed, {input left symbolic: ORT's reason}). Why: in a model with If/Loop bodies, concrete dims let
    ORT infer the shapes of a branch that never runs at these dims (torch exports `if state.shape[1] == 1:
    squeeze`); ORT then refuses the model ("Graph attribute inferencing failed") or its optimizer folds that
    branch into a broken subgraph initializer ("HasExternalDataInMemory was false"). Such an input keeps its
    symbolic dims, which the samples still fill; every other input is fixed. Only models with control flow are
    checked (on a copy); the others are fixed in place: a proto copied back keeps the old copy in its memory
    (protobuf frees a message's memory only with the whole message), and BERT-large was held twice from load on."""
    if not shapes:
        return [], {}
    if not has_control_flow(model):
        fix_input_shapes(weightless(model)[0], shapes)  # every entry validated before the model is touched
        return fix_input_shapes(model, shapes), {}
    trial = onnx.ModelProto()
    trial.CopyFrom(model)
    changed = fix_input_shapes(trial, shapes)  # validates every entry first: a wrong name or rank is an error
    if _ort_refusal(trial) is None or _ort_refusal(model) is not None:
        model.CopyFrom(trial)  # (a model ORT refuses anyway is not this fix's doing: later steps say why)
        return changed, {}
    fixed, refused = [], {}
    for name in changed:  # one input at a time: keep each fix ORT still accepts with the ones kept before
        trial.CopyFrom(model)
        fix_input_shapes(trial, {n: shapes[n] for n in [*fixed, name]})
        problem = _ort_refusal(trial)
        if problem is None:
            fixed.append(name)
        else:
            refused[name] = problem
            log.warning(left_symbolic_warning(name, problem))
    fix_input_shapes(model, {n: shapes[n] for n in fixed})
    return fixed, refused


def left_symbolic_warning(name: str, problem: str) -> str:
    return (f"inputs.{name}: not written into the model: with these dims ONNX Runtime refuses it ({problem}), as "
            f"it infers shapes in If/Loop branches that do not run at these dims; the input keeps its symbolic dims")


def _ort_refusal(model: onnx.ModelProto) -> str | None:
    """Why ONNX Runtime refuses to load the model as deployed (its default, fully optimized session), if it does."""
    from qprep.model.runtime import ort_session

    try:
        ort_session(model, threads=1, optimize=True, log_severity=4)
    except Exception as exc:  # ORT raises its own exception types; its C++ signatures say nothing to a user
        text = re.sub(r"/onnxruntime_src/\S+ onnxruntime::.*?\) (?=\S)", "", " ".join(str(exc).split()))
        return re.sub(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ", "", text)[:200]
    return None


def drop_initializer_value_info(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` (changed in place) without value_info entries for its initializers, which declare their own type
    and shape. Why: ONNX Runtime's dynamic quantizer transposes a Gemm's weight in place to make it a MatMul;
    a value_info left with the old shape then fails its shape inference ("Inferred shape and existing shape
    differ in dimension 0: (64) vs (10)" on a ViT's head: onnx-ir writes such entries)."""
    weights = {t.name for t in model.graph.initializer}
    kept = [v for v in model.graph.value_info if v.name not in weights]
    if len(kept) < len(model.graph.value_info):
        del model.graph.value_info[:]
        model.graph.value_info.extend(kept)
    return model


def infer_shapes(model: onnx.ModelProto) -> tuple[onnx.ModelProto, str | None]:
    """ONNX shape inference with data propagation; never fatal. Returns (model, warning or None)."""
    try:
        return inferred_shapes(model, data_prop=True), None
    except Exception as exc:  # noqa: BLE001 - inference failures must not stop a run
        message = f"shape inference failed ({str(exc).splitlines()[0][:200]}); continuing without inferred shapes"
        log.warning(message)
        return model, message


def ops_newer_than(model: onnx.ModelProto, opset: int) -> list[str]:
    """Op types of the default domain (subgraphs included) that do not exist at `opset` (Gelu came in 20):
    what stops a model from being converted down that far."""
    return sorted({node.op_type for node in _all_nodes(model.graph)
                   if node.domain in ("", "ai.onnx") and not onnx.defs.has(node.op_type, opset)})


def convert_down(model: onnx.ModelProto, opset: int) -> onnx.ModelProto:
    """`model` at `opset` by onnx's version converter, or a one-line error naming what blocks it (an op that
    does not exist at `opset`, or the converter's own complaint). Gelu (opset 20) is written out as its
    definition first. The caller verifies the numbers."""
    if opset < GELU_OPSET and "Gelu" in ops_newer_than(model, opset):
        model = gelu_written_out(model)
    blocking = ops_newer_than(model, opset)
    if blocking:
        raise ModelError(f"the model is opset {default_opset(model)} and uses {', '.join(blocking)}, which opset "
                         f"{opset} does not have: export it at opset {opset} (without {blocking[0]})")
    try:
        return onnx.version_converter.convert_version(model, opset)
    except Exception as exc:  # the converter raises bare RuntimeErrors naming the op it could not adapt
        raise ModelError(f"the model is opset {default_opset(model)} and onnx's converter cannot take it down to "
                         f"{opset} ({str(exc).splitlines()[0][:200]}): export it at opset {opset}") from None


GELU_OPSET = 20  # Gelu's first opset


def gelu_written_out(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `model` whose Gelu nodes (main graph) are their definition in elementwise ops every opset ≥ 13
    has: 0.5·x·(1 + Erf(x/√2)), or with approximate "tanh" 0.5·x·(1 + Tanh(√(2/π)·(x + 0.044715·x³))).

    Why: torch's dynamo exporter writes GELU as one Gelu (opset 20), and rknn-toolkit2 takes opset 19 at most
    (limits.py); the toolkit fuses the Erf form back into its own GELU layer (exGelu). Constants take x's
    float type, read from the graph's type information after shape inference (float32 where it has none)."""
    model = onnx.ModelProto.FromString(model.SerializeToString())

    def known_types() -> dict[str, int]:
        values = [*model.graph.input, *model.graph.value_info, *model.graph.output]
        return {**{v.name: v.type.tensor_type.elem_type for v in values},
                **{t.name: t.data_type for t in model.graph.initializer}}

    types = known_types()
    if any(n.op_type == "Gelu" and n.input[0] not in types for n in model.graph.node):
        model, _ = infer_shapes(model)  # an intermediate x's float type (a float16 model's constants must match)
        types = known_types()
    graph = model.graph
    taken = {o for n in graph.node for o in n.output} | set(types)
    nodes = []
    for node in graph.node:
        if node.op_type != "Gelu" or node.domain not in ("", "ai.onnx"):
            nodes.append(node)
            continue
        x, y = node.input[0], node.output[0]
        dtype = helper.tensor_dtype_to_np_dtype(types.get(x) or onnx.TensorProto.FLOAT)
        tanh = any(a.name == "approximate" and a.s == b"tanh" for a in node.attribute)

        def tensor(role: str) -> str:
            return unique_name(f"{node.name or y}/{role}", taken)

        def constant(role: str, value: float) -> str:
            name = tensor(role)
            graph.initializer.append(numpy_helper.from_array(np.array(value, dtype), name))
            return name

        def op(op_type: str, inputs: list[str], role: str, output: str | None = None) -> str:
            output = output or tensor(role)
            nodes.append(helper.make_node(op_type, inputs, [output], name=tensor(role + "_node")))
            return output

        if tanh:
            cube = op("Mul", [op("Mul", [x, x], "square"), x], "cube")
            inner = op("Add", [x, op("Mul", [cube, constant("c", 0.044715)], "cubic_term")], "inner")
            core = op("Tanh", [op("Mul", [inner, constant("sqrt_2_over_pi", np.sqrt(2 / np.pi))], "u")], "tanh")
        else:
            core = op("Erf", [op("Div", [x, constant("sqrt_2", np.sqrt(2.0))], "u")], "erf")
        half_x = op("Mul", [x, constant("half", 0.5)], "half_x")
        op("Mul", [half_x, op("Add", [core, constant("one", 1.0)], "one_plus")], "gelu", output=y)
    del graph.node[:]
    graph.node.extend(nodes)
    return model


def _all_nodes(graph: onnx.GraphProto):
    for node in graph.node:
        yield node
        for attr in node.attribute:
            for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
                yield from _all_nodes(sub)
