"""FP16 conversion with onnxconverter-common, keeping the float set (LayerNorm at least) in float32 and the
model's input/output types unchanged, so callers feed and read the same dtypes as before."""

from __future__ import annotations

import onnx

from qprep.quantize.backend import BackendInput, Quantized
from qprep.schema import Key, section

OPTIONS = section(
    "float16 conversion (backend: fp16)",
    keep_io_types=Key("bool", default=True, doc="keep float32 inputs/outputs (casts inserted inside)"),
    op_block_list=Key("list", item=Key("str"), default=["LayerNormalization"],
                      doc="op types kept in float32 (besides onnxconverter-common's own list)"),
)


def quantize(job: BackendInput) -> Quantized:
    from onnxconverter_common import float16

    model, float_set, options = job.model, job.float_set, job.options
    blocked_ops = sorted(set(float16.DEFAULT_OP_BLOCK_LIST) | set(options["op_block_list"]))
    converted = float16.convert_float_to_float16(
        model, keep_io_types=options["keep_io_types"], op_block_list=blocked_ops,
        node_block_list=sorted(float_set), disable_shape_infer=False)
    restored = _restore_output_types(model, converted) if options["keep_io_types"] else []
    return Quantized(model=converted, details={"kept_float32_ops": blocked_ops, "kept_float32_nodes": sorted(float_set),
                                               "outputs_cast_back": restored})


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
