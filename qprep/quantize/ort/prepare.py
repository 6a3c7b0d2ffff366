"""The model as ONNX Runtime's quantizer needs it, made once before any calibration or build: at opset 13 or
later, with the types behind com.microsoft ops declared, no bias shared by two layers, and for dynamic builds
with no Gemm weight shared. Each step is exact: the model computes what it computed, and leaves every name
unique (checked after each: graph/names.py), so a duplicate ORT reports is found at the step that made it.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import onnx
import onnx.version_converter
from onnx import numpy_helper

from qprep.errors import QprepError
from qprep.graph.names import renamed, require_unique, value_names
from qprep.model.info import Links, attribute, default_opset, unique_name
from qprep.model.io import is_large
from qprep.model.ort_optimized import with_runtime_types
from qprep.model.prepare import drop_initializer_value_info
from qprep.quantize import nonfinite

log = logging.getLogger("qprep")

# Per-channel DequantizeLinear (its `axis`) needs opset 13; ORT's quantizer would emit it anyway.
MIN_OPSET = 13


def at_min_opset(model: onnx.ModelProto, extremes: nonfinite.Extremes
                 ) -> tuple[onnx.ModelProto, int | None, nonfinite.Extremes]:
    """(the model at MIN_OPSET or later, the opset it was upgraded from or None, the extremes of that model).
    The converter writes attributes as constants (an opset-10 Clip's max=+inf): those extreme constants join the
    extremes (never calibrated), in a copy: `extremes` is the stage's."""
    if default_opset(model) >= MIN_OPSET:
        return model, None, extremes
    upgraded_from, model = default_opset(model), _upgraded(model)
    added = {name: stats for name, stats in nonfinite.extreme_constants(model).items() if name not in extremes.tensors}
    return model, upgraded_from, dataclasses.replace(extremes, tensors={**extremes.tensors, **added})


def for_ort(model: onnx.ModelProto, threads: int, dynamic: bool) -> onnx.ModelProto:
    """`model` with what ORT's quantizer needs: the types behind com.microsoft ops, no value_info that only
    repeats an initializer's, (static) no bias two layers share and (dynamic) no Gemm weight that another node
    also reads."""
    model = with_runtime_types(model, threads)  # com.microsoft ops: ORT's quantizer needs the types behind them
    require_unique(model, "qprep's typing of com.microsoft outputs for ORT's quantizer")
    drop_initializer_value_info(model)  # in place: entries that only repeat what the initializers declare
    if dynamic:
        model = shared_gemm_weights_transposed(model)
        require_unique(model, "qprep's copy of shared Gemm weights for ORT's dynamic quantizer")
    else:
        model = shared_biases_copied(model)
        require_unique(model, "qprep's copy of shared biases for ORT's quantizer")
    return model


# What ORT's quantizers append to a tensor's name for what they add (quant_utils.py, qdq_quantizer.py,
# onnx_quantizer.py, base_quantizer.py: `_QuantizeLinear_Output`, `_zero_point`, `_scale_Div`, ...), as words
ORT_SUFFIX_WORDS = ("_quantized", "_scale", "_zero_point", "_QuantizeLinear", "_DequantizeLinear", "_Input", "_Output",
                    "_convert", "_clone", "_ReduceMin", "_ReduceMax", "_Abs", "_Max", "_Sub", "_Div", "_Floor", "_Cast")


def ort_names_apart(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, str]]:
    """(`model` with every value whose name ORT's quantizer could derive from another value's name renamed
    `<name>/apart`, {old: new}); the model itself and {} when no name is such (exact: names only).

    Why: ORT names what it adds by appending words to the tensor's name (`h_scale`, `h_zero_point`,
    `h_DequantizeLinear_Output`, ...) without asking whether the model has that name already. A model value `h`
    beside `h_scale` made ORT's quantizer fail on the nodes around `h` (kept float by the bisection for nothing);
    beside `h_DequantizeLinear_Output` it wrote a model whose readers of that value read ORT's instead, with no
    error (output error 1.1 on a test net). A name is taken apart when stripping such words from its end leaves
    another value's name; the graph's inputs and outputs keep theirs (the other name of the pair is renamed)."""
    names = value_names(model)
    contract = {v.name for v in (*model.graph.input, *model.graph.output)}
    renames: dict[str, str] = {}
    for name in sorted(names):
        base = _ort_base(name, names)
        if base is None:
            continue
        moved = name if name not in contract else base if base not in contract else None
        if moved is not None and moved not in renames:
            renames[moved] = unique_name(f"{moved}/apart", names)
    if not renames:
        return model, {}
    log.info("ort: %d value names renamed, which ONNX Runtime's quantizer would also give what it adds: %s",
             len(renames), ", ".join(f"{old} → {new}" for old, new in list(renames.items())[:5]))
    return renamed(model, renames), renames


def _ort_base(name: str, names: set[str]) -> str | None:
    """The value whose name, with ORT's words appended, is `name`; None when there is none."""
    stem = name
    while True:
        word = next((w for w in ORT_SUFFIX_WORDS if stem.endswith(w) and len(stem) > len(w)), None)
        if word is None:
            return None
        stem = stem[:-len(word)]
        if stem in names:
            return stem


# ORT's static quantizer quantizes input 2 of these as a bias (scale = input scale × weight scale)
BIAS_READERS = frozenset({"Conv", "Gemm", "InstanceNormalization", "LayerNormalization", "BatchNormalization"})


def shared_biases_copied(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` with each bias initializer that several layers read as their bias given one copy per further
    layer, named unique among every value of the model; the model itself when no bias is shared (exact either
    way).

    Why: ORT's QDQ quantizer copies a shared bias itself (each layer's bias scale follows its own input), naming
    the copy `<bias><n>` with n one above the largest number ending an *initializer* name that starts with the
    bias's name (`QDQQuantizer._dup_initializer`). Node outputs are not counted: torch's dynamo exporter names
    values `val_N` and shares equal constants, so the copy of bias `val_1` next to weight `val_10` is `val_11`,
    which a node output may already be. ONNX Runtime then refused the quantized model ("Duplicate definition of
    name (val_3589)"; issue #61's U-Net: GroupNorm as InstanceNormalization on one shared zero bias). Copies
    made here leave ORT nothing to copy."""
    initializers = {t.name: t for t in model.graph.initializer}
    readers: dict[str, list[int]] = {}
    for index, node in enumerate(model.graph.node):
        if node.op_type in BIAS_READERS and node.domain in ("", "ai.onnx") and len(node.input) > 2 \
                and node.input[2] in initializers:
            readers.setdefault(node.input[2], []).append(index)
    shared = {bias: indices for bias, indices in readers.items() if len(indices) > 1}
    if not shared:
        return model
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    model, taken = copy, value_names(copy)
    for bias, indices in shared.items():
        for index in indices[1:]:
            node = model.graph.node[index]
            name = unique_name(f"{bias}/{node.name or node.op_type}", taken)
            tensor = onnx.TensorProto()
            tensor.CopyFrom(initializers[bias])
            tensor.name = name
            model.graph.initializer.append(tensor)
            node.input[2] = name
    log.info("ort: %d biases shared by %d layers: each further layer given its own copy (ORT's quantizer names "
             "its copies after initializers only)", len(shared), sum(len(i) for i in shared.values()))
    return model


def shared_gemm_weights_transposed(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` with each Gemm(transB=1) whose weight another node also reads given one transposed copy of that
    weight (transB=0), shared by those Gemms; the model itself when no weight is shared (exact either way).

    Why: ORT's dynamic quantizer makes each Gemm a MatMul first, transposing its weight initializer in place and
    assuming nothing else reads it ("assume B is not used by any other node", onnx_model.py). A weight two Gemms
    share (ALBERT's shared layers, a tied head, two layers with equal weights that cleanup merged) was then
    transposed twice and the second Gemm computed with the wrong matrix (BENCHMARKS.md: "a shared Gemm weight
    transposed once")."""
    links = Links(model)
    shared = [i for i, n in enumerate(model.graph.node) if n.op_type == "Gemm" and len(n.input) > 1
              and n.input[1] in links.initializers and not links.own_constant(n.input[1], n)
              and attribute(n, "transB", 0) == 1]
    if not shared:
        return model
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    model = copy
    taken = {t.name for t in model.graph.initializer} | {o for n in model.graph.node for o in n.output}
    transposed: dict[str, str] = {}
    for node in (model.graph.node[i] for i in shared):
        weight = node.input[1]
        if weight not in transposed:
            transposed[weight] = unique_name(f"{weight}/transposed", taken)
            model.graph.initializer.append(numpy_helper.from_array(
                np.ascontiguousarray(numpy_helper.to_array(links.initializers[weight]).T), transposed[weight]))
        node.input[1] = transposed[weight]
        kept = [a for a in node.attribute if a.name != "transB"]
        del node.attribute[:]
        node.attribute.extend(kept)
    log.info("ort: %d Gemms share %d weights with other nodes: each weight transposed once for them (ORT's dynamic "
             "quantizer transposes a Gemm's weight in place)", len(shared), len(transposed))
    return model




def _upgraded(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model at MIN_OPSET (ORT's quantizer needs it), or a one-line error when onnx's converter cannot."""
    if is_large(model):
        raise QprepError(f"the model is opset {default_opset(model)} and over 2 GB: ONNX Runtime's quantizer needs "
                         f"opset {MIN_OPSET}+ and onnx's converter cannot upgrade models this large; re-export it "
                         f"at opset {MIN_OPSET} or later")
    try:
        return onnx.version_converter.convert_version(model, MIN_OPSET)
    except Exception as exc:  # the converter raises bare RuntimeErrors naming the op it could not adapt
        raise QprepError(f"the model is opset {default_opset(model)}; ONNX Runtime's quantizer needs {MIN_OPSET}+ "
                         f"and onnx's converter failed ({str(exc).splitlines()[0][:200]}): re-export it at opset "
                         f"{MIN_OPSET} or later") from None
