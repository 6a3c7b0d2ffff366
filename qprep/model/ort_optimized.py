"""Models written by ONNX Runtime's transformer optimizer (HF Optimum's "optimized" exports, `optimize_model`).

Why: such a model is what ONNX Runtime's own docs advise to quantize, and it breaks two tools qprep relies on.
- It writes `LayerNormalization` in the ONNX domain at the model's opset (14 for most BERTs), where ONNX only
  has it from 17: ONNX Runtime registers it there for itself, onnx's checker refuses the model. Converted to
  opset 17 (ONNX's op is ORT's: same attributes, outputs and kernel), the model is valid ONNX and computes the
  same (tests/test_ort_optimized.py, on MiniLM).
- It writes RMS norms (LLaMA's, T5's) as `SimplifiedLayerNormalization` in the ONNX domain, an op no ONNX opset
  has: written out at load as the ONNX ops torch exports for them, each checked against ONNX Runtime's kernel.
- Its com.microsoft ops (SkipLayerNormalization, BiasGelu, Attention, …) have no ONNX schema, so ONNX's shape
  inference types nothing after the first of them, and ORT's quantizer then fails on every MatMul behind it
  ("Unable to find data type for weight_name"). ONNX Runtime knows those types: `with_runtime_types` asks a
  session for them.
"""

from __future__ import annotations

import logging
import re

import numpy as np
import onnx
from onnx import helper, numpy_helper

from qprep.model.info import default_opset, iter_nodes

log = logging.getLogger("qprep")

LAYERNORM_OPSET = 17  # LayerNormalization's first ONNX opset
_HELD = "qprep.held"  # the domain LayerNormalization waits in while the rest of the model is converted
# ops ONNX Runtime registers in the ONNX domain that ONNX does not have (at any opset)
ORT_ONLY_ONNX_DOMAIN_OPS = frozenset({"SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization"})


def ort_layernorm_below_17(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """ONNX-domain LayerNormalization nodes in a model below opset 17 (ONNX Runtime's own registration)."""
    if default_opset(model) >= LAYERNORM_OPSET:
        return []
    return [n for n in iter_nodes(model.graph) if n.op_type == "LayerNormalization" and n.domain in ("", "ai.onnx")]


def lift_layernorm_opset(model: onnx.ModelProto, path) -> onnx.ModelProto:
    """`model` converted to opset 17 when it holds ONNX Runtime's below-17 LayerNormalization, else as it is.
    onnx's converter has no adapter for an op that did not exist at the source opset, so those nodes wait in a
    domain of their own while the rest is converted."""
    from qprep.errors import ModelError

    held = ort_layernorm_below_17(model)
    if not held:
        return model
    source = default_opset(model)
    for node in held:
        node.domain = _HELD
    model.opset_import.append(helper.make_opsetid(_HELD, 1))
    try:
        lifted = onnx.version_converter.convert_version(model, LAYERNORM_OPSET)
    except Exception as exc:  # the converter raises bare RuntimeErrors naming the op it could not adapt
        raise ModelError(f"{path} uses ONNX Runtime's LayerNormalization at opset {source} (ONNX has it from 17) "
                         f"and onnx's converter cannot take the model to 17 ({str(exc).splitlines()[0][:200]}): "
                         "export at opset 17, or quantize the export from before ONNX Runtime's optimizer") from None
    finally:
        for node in held:
            node.domain = ""
        del model.opset_import[-1]
    for node in iter_nodes(lifted.graph):
        if node.domain == _HELD:
            node.domain = ""
    kept = [o for o in lifted.opset_import if o.domain != _HELD]
    del lifted.opset_import[:]
    lifted.opset_import.extend(kept)
    log.warning("model: %d LayerNormalization nodes at opset %d, which only ONNX Runtime runs (its graph "
                "optimizers write them): the model was converted to opset %d, where ONNX has the op",
                len(held), source, LAYERNORM_OPSET)
    return lifted


def split_simplified_layernorm(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` with each main-graph SimplifiedLayerNormalization (ONNX Runtime's RMS norm, ONNX domain) written
    out as x / sqrt(mean(x², normalized axes) + ε) · scale, computed in float32 as its stash_type says; unchanged
    (the same object) without one. A node whose replacement ONNX Runtime's own kernel does not confirm on random
    input, or that it cannot take (scale not a constant, inv_std_var read), stays: the checker then refuses it."""
    nodes = [n for n in model.graph.node if n.op_type == "SimplifiedLayerNormalization" and n.domain in ("", "ai.onnx")]
    if not nodes:
        return model
    result = onnx.ModelProto()
    result.CopyFrom(model)
    graph = result.graph
    constants = {t.name: t for t in graph.initializer}
    read = {name for node in graph.node for name in node.input} | {o.name for o in graph.output}
    opset = default_opset(result)
    split = 0
    for index in reversed(range(len(graph.node))):
        node = graph.node[index]
        if node.op_type != "SimplifiedLayerNormalization" or node.domain not in ("", "ai.onnx"):
            continue
        scale = constants.get(node.input[1]) if len(node.input) > 1 else None
        axis = next((a.i for a in node.attribute if a.name == "axis"), -1)
        if scale is None or not scale.dims or axis >= 0 or (len(node.output) > 1 and node.output[1] in read):
            continue
        replacement, initializers = _rms_norm(node, scale, opset)
        if not _same_as_kernel(node, scale, replacement, initializers, opset):
            continue
        del graph.node[index]
        for offset, new in enumerate(replacement):
            graph.node.insert(index + offset, new)
        graph.initializer.extend(initializers)
        split += 1
    if split:
        log.warning("model: %d SimplifiedLayerNormalization nodes (ONNX Runtime's RMS norm, which no ONNX opset has) "
                    "written out as ONNX ops, each checked against ONNX Runtime's kernel", split)
    return result if split else model


def _rms_norm(node: onnx.NodeProto, scale: onnx.TensorProto, opset: int):
    """(nodes, initializers) computing the node's Y from its X and scale, named under the node."""
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    axis, epsilon = attributes.get("axis", -1), attributes.get("epsilon", 1e-5)
    count = -axis  # the axes from `axis` to the last (a positive axis, which needs the rank, is left as it is)
    prefix = f"{node.name or node.output[0]}/"
    dtype = helper.tensor_dtype_to_np_dtype(scale.data_type)
    stash = attributes.get("stash_type", 1) == 1 and dtype != np.float32
    x, nodes = node.input[0], []
    if stash:
        nodes.append(helper.make_node("Cast", [x], [prefix + "x_float"], to=onnx.TensorProto.FLOAT,
                                      name=prefix + "cast"))
        x = prefix + "x_float"
    work = np.float32 if stash else dtype
    initializers = [numpy_helper.from_array(np.array(2, work), prefix + "two"),
                    numpy_helper.from_array(np.array(epsilon, work), prefix + "epsilon")]
    axes = list(range(-count, 0))
    mean_inputs = [prefix + "square"]
    mean_attributes = {"keepdims": 1}
    if opset >= 18:
        initializers.append(numpy_helper.from_array(np.array(axes, np.int64), prefix + "axes"))
        mean_inputs.append(prefix + "axes")
    else:
        mean_attributes["axes"] = axes
    normalized = prefix + "normalized"
    nodes += [helper.make_node("Pow", [x, prefix + "two"], [prefix + "square"], name=prefix + "pow"),
              helper.make_node("ReduceMean", mean_inputs, [prefix + "mean_square"], name=prefix + "mean",
                               **mean_attributes),
              helper.make_node("Add", [prefix + "mean_square", prefix + "epsilon"], [prefix + "shifted"],
                               name=prefix + "add_epsilon"),
              helper.make_node("Sqrt", [prefix + "shifted"], [prefix + "rms"], name=prefix + "sqrt"),
              helper.make_node("Div", [x, prefix + "rms"], [normalized], name=prefix + "div")]
    if stash:
        nodes.append(helper.make_node("Cast", [normalized], [prefix + "normalized_back"], to=scale.data_type,
                                      name=prefix + "cast_back"))
        normalized = prefix + "normalized_back"
    nodes.append(helper.make_node("Mul", [normalized, node.input[1]], [node.output[0]], name=prefix + "scale"))
    return nodes, initializers


def _same_as_kernel(node: onnx.NodeProto, scale: onnx.TensorProto, replacement, initializers, opset: int) -> bool:
    """ONNX Runtime's SimplifiedLayerNormalization and `replacement` agree on x ~ N(0, 3) of shape [2, 3, *scale]."""
    from qprep.model.runtime import run_model

    elem = scale.data_type
    shape = [2, 3, *scale.dims]
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(shape) * 3).astype(helper.tensor_dtype_to_np_dtype(elem))
    outputs = []
    for nodes, extra in (([node], []), (replacement, initializers)):
        graph = helper.make_graph(list(nodes), "check", [helper.make_tensor_value_info(node.input[0], elem, shape)],
                                  [helper.make_tensor_value_info(node.output[0], elem, None)], [scale, *extra])
        check = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
        try:
            outputs.append(run_model(check, [{node.input[0]: x}])[0][node.output[0]].astype(np.float64))
        except Exception:  # noqa: BLE001 - a node ORT cannot run alone stays as it was
            return False
    reference, ours = outputs
    return bool(np.allclose(ours, reference, rtol=1e-3 if elem != onnx.TensorProto.FLOAT else 1e-5, atol=1e-5))


def refuse_session_layouts(model: onnx.ModelProto, path) -> None:
    """A model saved from an ONNX Runtime session at ORT_ENABLE_ALL holds com.microsoft.nchwc ops: a blocked
    memory layout for the CPU it was saved on (ORT warns so when it writes it), which ORT's quantizer cannot take
    apart (its calibration then failed: "com.microsoft.nchwc:Mul(-1) is not a registered function/op")."""
    from qprep.errors import ModelError

    found = next((n for n in iter_nodes(model.graph) if n.domain == "com.microsoft.nchwc"), None)
    if found is not None:
        raise ModelError(f"{path} holds com.microsoft.nchwc ops (e.g. '{found.name or found.output[0]}' "
                         f"{found.op_type}): it was saved from an ONNX Runtime session at ORT_ENABLE_ALL, for the "
                         "CPU it ran on; quantize the export from before, or save it at ORT_ENABLE_EXTENDED")


def with_runtime_types(model: onnx.ModelProto, threads: int = 1) -> onnx.ModelProto:
    """`model` with a value_info for each node output (main graph) that ONNX's shape inference leaves untyped
    behind an op it has no schema for, its element type as an ONNX Runtime session reports it. Unchanged
    (the same object) when the model has no such op or nothing is missing."""
    from qprep.model.io import inferred_shapes
    from qprep.model.runtime import ort_session

    if not any(n.domain not in ("", "ai.onnx") for n in model.graph.node):
        return model
    inferred = inferred_shapes(model, shapes_only=True)
    typed = {v.name for v in (*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output)
             if v.type.HasField("tensor_type") and v.type.tensor_type.elem_type}
    typed |= {t.name for t in model.graph.initializer}
    missing = [name for node in model.graph.node for name in node.output if name and name not in typed]
    if not missing:
        return model
    session = ort_session(model, threads, extra_outputs=missing, log_severity=4)
    known = {value.name: value for value in session.get_outputs()}
    infos = [info for info in (_value_info(known[name]) for name in missing if name in known) if info is not None]
    del session
    result = onnx.ModelProto()
    result.CopyFrom(model)
    result.graph.value_info.extend(infos)
    return result


_ORT_TYPE = re.compile(r"^tensor\((\w+)\)$")


def _value_info(value) -> onnx.ValueInfoProto | None:
    """An ORT NodeArg's element type as a value_info, without a shape: ORT reports an unknown shape as [] (a
    scalar's), which written out made a Gemm's input rank 0 to ONNX's inference (EfficientNet-Lite0 saved from
    an ORT session)."""
    match = _ORT_TYPE.match(value.type)
    if not match:  # a sequence or map: nothing to quantize there
        return None
    try:
        elem_type = onnx.TensorProto.DataType.Value(match.group(1).upper())
    except ValueError:
        return None
    return helper.make_tensor_value_info(value.name, elem_type, None)
