"""FP16 conversion with onnxconverter-common, keeping the float set (LayerNorm at least) in float32 and the
model's input/output types unchanged, so callers feed and read the same dtypes as before."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
from onnx import numpy_helper

from qprep.errors import ModelError
from qprep.model import io
from qprep.quantize.backend import Quantized, QuantizeJob
from qprep.schema import Key, section

# onnxconverter-common's defaults, passed to it and used when filling a heavy model's weights, so both agree
MIN_POSITIVE, MAX_FINITE = 1e-7, 1e4

OPTIONS = section(
    "float16 conversion (backend: fp16)",
    keep_io_types=Key("bool", default=True, doc="keep float32 inputs/outputs (casts inserted inside)"),
    op_block_list=Key("list", item=Key("str"), default=["LayerNormalization"],
                      doc="op types kept in float32 (besides onnxconverter-common's own list)"),
)


def quantize(job: QuantizeJob) -> Quantized:
    from onnxconverter_common import float16

    model, float_set, options = job.model, job.float_set, job.options
    blocked_ops = sorted(set(float16.DEFAULT_OP_BLOCK_LIST) | set(options.op_block_list))
    casts = _casts_kept(model, blocked_ops)
    blocked_nodes, blocked_ops = sorted(set(float_set) | casts), [op for op in blocked_ops if op != "Cast"]
    # onnxconverter-common converts in place what its shape inference returns: a copy, and over 2 GB an empty
    # model. A heavy model is converted as its weightless skeleton, its weights filled in after.
    skeleton, weights = io.weightless(model) if io.is_heavy(model) else (model, [])
    with warnings.catch_warnings():  # one per tensor it clips (hundreds in the run log): _clipped names them
        warnings.filterwarnings("ignore", message="the float32 number .* will be truncated")
        converted = float16.convert_float_to_float16(
            io.inferred_shapes(skeleton), keep_io_types=options.keep_io_types, op_block_list=blocked_ops,
            node_block_list=blocked_nodes, disable_shape_infer=True, min_positive_val=MIN_POSITIVE,
            max_finite_val=MAX_FINITE)
        _fill_weights(converted, weights)
    retyped = _cast_float32_identities(converted)
    clipped = _clipped(weights or model.graph.initializer, converted)
    restored = _restore_output_types(model, converted) if options.keep_io_types else []
    _require_loadable(converted)
    details = {"kept_float32_ops": blocked_ops, "kept_float32_nodes": sorted(float_set),
               "casts_left_as_they_are": sorted(casts),
               "outputs_cast_back": restored, "clipped_to_float16_range": clipped,
               **({"identities_cast": retyped} if retyped else {})}
    notes = []
    if clipped:
        largest = max(clipped.values())
        names = ", ".join(sorted(clipped)[:3]) + (", …" if len(clipped) > 3 else "")
        notes.append(f"quantize: float16 clipped {len(clipped)} weight tensor(s) to ±{MAX_FINITE:g}: {names} "
                     f"(|value| up to {largest:.3g}); if the accuracy suffers, keep the nodes that read them "
                     "float32 (keep_float)")
    return Quantized(model=converted, details=details, warnings=notes)


def _casts_kept(model: onnx.ModelProto, blocked_ops: list[str]) -> set[str]:
    """The model's own Cast nodes the conversion must leave as they are, by name: those that cast to float32,
    and every Cast when the op block list holds "Cast". Why by name: onnxconverter-common retypes a float32
    value to float16 but leaves a Cast's `to` as it was, so the model's Cast of an integer (a dynamo export's Cast
    of the int64 attention_mask to float) disagreed with its declared output and ONNX Runtime refused the model; a
    blocked node keeps its float32 output and the converter casts it to float16 after. And not by op type: the
    converter puts a Cast to float32 before a blocked node's float16 input, and as a Cast that new node was
    blocked in turn, casts inserted without end (minutes of silence, memory growing)."""
    every = "Cast" in blocked_ops
    return {node.name for node in model.graph.node if node.op_type == "Cast" and node.name
            and (every or next((a.i for a in node.attribute if a.name == "to"), None) == onnx.TensorProto.FLOAT)}


def _require_loadable(converted: onnx.ModelProto) -> None:
    """Refuse in one line, naming the fp16 settings, a converted model ONNX Runtime cannot load: else the
    evaluation that runs it next advised the ORT backend's settings for the converter's fault."""
    from qprep.model.runtime import failing_node, ort_session, short_ort_message

    try:
        ort_session(converted, threads=1, log_severity=4)
    except Exception as exc:  # noqa: BLE001 - ORT raises its own exception types
        message = " ".join(str(exc).split())
        node = failing_node(message)
        op = next((n.op_type for n in converted.graph.node if node and n.name == node), None)
        blocked = f"quantize.fp16.op_block_list: [{op}]" if op and op != "Cast" else "quantize.fp16.op_block_list"
        fix = f"keep_float: {{nodes: [{node or '...'}]}} or {blocked}"
        raise ModelError(f"quantize: the float16 conversion (onnxconverter-common) wrote a model ONNX Runtime "
                         f"cannot load ({short_ort_message(message)}); keep that node float32 ({fix})") from None


def _cast_float32_identities(converted: onnx.ModelProto) -> list[str]:
    """Identity nodes over a float32 initializer whose output the converter typed float16 become Casts to
    float16; returns their names. Why: TorchScript exports tied parameters as `Identity(initializer)` (BERT's
    pooler bias is `Identity(bert.embeddings.LayerNorm.bias)`); when the initializer also feeds a node kept in
    float32 (LayerNormalization), onnxconverter-common leaves it float32 but declares the Identity's output
    float16, and ONNX Runtime refuses the model ("Type (tensor(float16)) of output arg … does not match")."""
    float32 = {t.name for t in converted.graph.initializer if t.data_type == onnx.TensorProto.FLOAT}
    halves = {v.name for v in converted.graph.value_info if v.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16}
    retyped = []
    for node in converted.graph.node:
        if node.op_type == "Identity" and node.input[0] in float32 and node.output[0] in halves:
            node.op_type = "Cast"
            node.attribute.append(onnx.helper.make_attribute("to", onnx.TensorProto.FLOAT16))
            retyped.append(node.name or node.output[0])
    return retyped


def _clipped(originals, converted: onnx.ModelProto) -> dict[str, float]:
    """Float32 weights the conversion clipped to ±MAX_FINITE: name → largest |value|. onnxconverter-common only
    warns, without the tensor's name; values under MIN_POSITIVE it raises to it change nothing measurable."""
    halves = {t.name for t in converted.graph.initializer if t.data_type == onnx.TensorProto.FLOAT16}
    clipped = {}
    for tensor in originals:
        if tensor.name in halves and tensor.data_type == onnx.TensorProto.FLOAT:
            largest = float(np.abs(numpy_helper.to_array(tensor)).max(initial=0.0))
            if largest > MAX_FINITE:
                clipped[tensor.name] = largest
    return clipped


def _fill_weights(converted: onnx.ModelProto, weights: list[onnx.TensorProto]) -> None:
    """Put the heavy model's weights into its converted skeleton: float16 (as onnxconverter-common rounds and
    clips them) where the converter turned the stub to float16, the original otherwise. One tensor at a time,
    so the float32 model is never copied whole."""
    from onnxconverter_common import float16

    originals = {tensor.name: tensor for tensor in weights}
    for stub in converted.graph.initializer:
        original = originals.get(stub.name)
        if original is None:
            continue
        if stub.data_type == onnx.TensorProto.FLOAT16 and original.data_type == onnx.TensorProto.FLOAT:
            values = float16.convert_np_to_float16(numpy_helper.to_array(original), MIN_POSITIVE, MAX_FINITE)
            stub.CopyFrom(numpy_helper.from_array(values.astype(np.float16), stub.name))
        else:
            stub.CopyFrom(original)


def _restore_output_types(original: onnx.ModelProto, converted: onnx.ModelProto) -> list[str]:
    """onnxconverter-common leaves an output float16 when a blocked op (e.g. LayerNormalization) produces
    it; cast such outputs back so callers read the dtype they always did."""
    wanted = {o.name: o.type.tensor_type.elem_type for o in original.graph.output}
    restored = []
    for output in converted.graph.output:
        dtype = wanted.get(output.name)
        if dtype is None or output.type.tensor_type.elem_type == dtype:
            continue
        inner = f"{output.name}/fp16"
        for node in converted.graph.node:
            node.output[:] = [inner if o == output.name else o for o in node.output]
            node.input[:] = [inner if i == output.name else i for i in node.input]
        converted.graph.node.append(onnx.helper.make_node("Cast", [inner], [output.name], to=dtype,
                                                          name=f"{output.name}/cast_back"))
        output.type.tensor_type.elem_type = dtype
        restored.append(output.name)
    return restored
