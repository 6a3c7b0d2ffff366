"""Every private (underscore) API of a dependency qprep relies on, in one place.

A dependency may change or drop these in any release without notice. Keeping them here means one module to
read when upgrading onnx, onnxscript or onnxruntime, and tests/test_third_party.py calls each one on a tiny
input and checks the result qprep relies on, so an upgrade that breaks one fails there, by name, instead of
deep inside a pipeline run. Callers import the names below from here, never the private paths.

It sits in qprep/ itself (the base layer), not in model/ or optimize/, because its users are spread over the tree:
model/ (onnx), optimize/ (onnxscript), quantize/ort/raw_build.py and calibration.py (onnxruntime).
"""

from __future__ import annotations

import copy
import gc
import sys
from collections.abc import Iterable
from contextlib import contextmanager
from types import SimpleNamespace

import numpy as np
import onnx
import onnx_ir as ir
from onnx.external_data_helper import _get_all_tensors
from onnxscript.rewriter._ir_utils import get_numpy_value
from onnxscript.rewriter._matcher import SimplePatternMatcher
from onnxscript.rewriter.rules.common._materialize_reshape_shape import MaterializeReshapeShape

# ---------------------------------------------------------------------------------------------------------
# onnx
# ---------------------------------------------------------------------------------------------------------


def all_tensors(model: onnx.ModelProto) -> Iterable[onnx.TensorProto]:
    """Every TensorProto of the model: initializers and tensor attributes, subgraphs included (the tensors
    that may live in external data). onnx's `external_data_helper._get_all_tensors`."""
    return _get_all_tensors(model)


# ---------------------------------------------------------------------------------------------------------
# onnxscript (the rewriter)
# ---------------------------------------------------------------------------------------------------------


def numpy_value(value: ir.Value | None) -> np.ndarray | None:
    """The value's array when it is an initializer or the output of a Constant node, else None.
    onnxscript's `rewriter._ir_utils.get_numpy_value`."""
    return get_numpy_value(value)


def materialized_dims(rule: MaterializeReshapeShape) -> list[int]:
    """The constant shape `MaterializeReshapeShape.check` computed for the match it just accepted (the rule
    keeps it in its private `_new_dims` for its `rewrite`)."""
    return rule._new_dims


def forget_rewrite_matches() -> None:
    """Clear what onnxscript's pattern matchers keep of their last match (`_graph`, `_current_node`, `_match`,
    `_tracer` of every SimplePatternMatcher). Why: its rules are module-level objects, so the last graph they
    saw outlives the rewrite, and its tensors pin the proto the IR was read from (protobuf frees a message's
    memory only with the whole message): a released input model stayed in memory (BERT-base: 0.44 GB)."""
    for matcher in gc.get_objects():
        if isinstance(matcher, SimplePatternMatcher):
            matcher._graph = matcher._current_node = matcher._match = matcher._tracer = None


# ---------------------------------------------------------------------------------------------------------
# onnxruntime (quantization internals the ORT backend builds on: qprep/quantize/ort/raw_build.py, calibration.py)
# ---------------------------------------------------------------------------------------------------------


def ort_quantization() -> SimpleNamespace:
    """ONNX Runtime's quantizer classes and helpers (modules with no stability promise between releases).
    Imported on first use, not with this module, and with torch hidden (`_without_torch`): only the ort
    backend needs them."""
    with _without_torch():
        from onnxruntime.quantization import CalibrationMethod, QuantType
        from onnxruntime.quantization.calibrate import TensorsData, create_calibrator
        from onnxruntime.quantization.onnx_model import ONNXModel
        from onnxruntime.quantization.onnx_quantizer import ONNXQuantizer
        from onnxruntime.quantization.qdq_quantizer import QDQQuantizer
        from onnxruntime.quantization.quant_utils import QuantizationMode, save_and_reload_model_with_shape_infer
        from onnxruntime.quantization.registry import QDQRegistry, QLinearOpsRegistry

    return SimpleNamespace(CalibrationMethod=CalibrationMethod, QuantType=QuantType,
                           TensorsData=TensorsData, create_calibrator=create_calibrator, ONNXModel=ONNXModel,
                           ONNXQuantizer=ONNXQuantizer,
                           QDQQuantizer=QDQQuantizer, QuantizationMode=QuantizationMode,
                           save_and_reload_model_with_shape_infer=save_and_reload_model_with_shape_infer,
                           QDQRegistry=QDQRegistry, QLinearOpsRegistry=QLinearOpsRegistry)


def calibrate_all_but(calibrator, tensors: set[str]) -> bool:
    """Keep `tensors` out of what ONNX Runtime's histogram calibrators (entropy, percentile, distribution)
    collect: their `collect_data` keeps only `tensors_to_calibrate`, chosen when the graph was augmented, and
    fails on a ±inf it meets ("autodetected range of [0.0, inf] is not finite"). MinMax has no such set: it
    reduces every tensor to its min and max, which for ±inf is harmless, and the caller drops those ranges.
    → whether anything is left to calibrate (a histogram calibrator with nothing fails: "Histogram has not been
    collected")."""
    chosen = getattr(calibrator, "tensors_to_calibrate", None)
    if chosen is None:
        return True
    calibrator.tensors_to_calibrate = set(chosen) - set(tensors)
    return bool(calibrator.tensors_to_calibrate)


@contextmanager
def weight_quantization_memo(memo: dict):
    """Within it, ONNX Runtime's quantizer takes a weight's quantization from `memo` when it quantized the same
    values with the same settings before. Its weight loops run in Python, once per channel: QDQ builds compute
    scales in `QDQQuantizer._calc_initializer_quant_params` and integers in `quantize_onnx_initializer`,
    QOperator and dynamic builds both in `BaseQuantizer.quantize_weight_per_channel_impl`; each is memoized a
    whole tensor at a time (a memo per channel still pays the loop per channel). Why: the fallback rebuilds the
    model for every trial from the same weights, so that loop can be most of a search (BENCHMARKS.md: "ORT's
    quantizer loops done once"). Keyed by every argument and the weight's bytes (compared),
    so a changed weight is quantized again; results are handed out as copies. An ORT without one of these methods
    builds without its memo (slower, not wrong)."""
    from onnxruntime.quantization import base_quantizer, qdq_quantizer

    wraps = [(base_quantizer.BaseQuantizer, "quantize_weight_per_channel_impl", _memoized_weight),
             (qdq_quantizer, "quantize_onnx_initializer", _memoized_initializer),
             (qdq_quantizer.QDQQuantizer, "_calc_initializer_quant_params", _memoized_quant_params)]
    present = [(module, name, wrap, getattr(module, name)) for module, name, wrap in wraps if hasattr(module, name)]
    for module, name, wrap, original in present:
        setattr(module, name, wrap(original, memo))
    try:
        yield
    finally:
        for module, name, _, original in present:
            setattr(module, name, original)


@contextmanager
def input_renaming_by_readers():
    """Within it, ONNX Runtime's quantizer renames an input (`ONNXModel.replace_input_of_all_nodes`, called once
    per quantized tensor) only in the nodes that read it: its own loop visits every input of every node for each
    tensor, so a build's cost grows with quantized tensors × nodes (BENCHMARKS.md: "ORT's quantizer loops done
    once"). Same result: a node that does not read the name is left as it is either way."""
    from onnxruntime.quantization.onnx_model import ONNXModel

    original = ONNXModel.replace_input_of_all_nodes

    def replace_input_of_all_nodes(self, old_input_name, new_input_name):
        for node in self.model.graph.node:
            if old_input_name in node.input:
                ONNXModel.replace_node_input(node, old_input_name, new_input_name)

    ONNXModel.replace_input_of_all_nodes = replace_input_of_all_nodes
    try:
        yield
    finally:
        ONNXModel.replace_input_of_all_nodes = original


@contextmanager
def shapes_inferred_already():
    """Within it, ONNX Runtime's dynamic quantizer takes the model it is given as shape-inferred: its
    `ONNXQuantizer.__init__` replaces Gemms with MatMuls and runs ORT's shape inference again (a save and reload) on
    every build of a search (BENCHMARKS.md: "ORT's quantizer loops done once"). Only for a model that went through
    that same replacement and inference already (the ORT backend's copy kept for the fallback's builds)."""
    from onnxruntime.quantization import onnx_quantizer

    original = onnx_quantizer.save_and_reload_model_with_shape_infer
    onnx_quantizer.save_and_reload_model_with_shape_infer = lambda model: model
    try:
        yield
    finally:
        onnx_quantizer.save_and_reload_model_with_shape_infer = original


def _memoized_weight(method, memo: dict):
    """ORT's per-channel weight quantization (QOperator and dynamic builds), whole weight at a time: the
    initializers it adds to the model (integers, scales, zero points) are kept and added again as copies, and its
    return value (their names) given back. Not memoized when the build has tensor overrides (they may name any
    weight). A weight is recognised by name, shape and settings, then its bytes compared with the ones kept: a
    compare runs at memory speed, faster than hashing every weight of every build (BENCHMARKS.md: "ORT's weight
    memo compares bytes")."""

    def call(self, weight_name, weight_qType, channel_axis, reduce_range=True, keep_float_weight=False):
        weight = next((t for t in self.model.initializer() if t.name == weight_name), None)
        if weight is None or len(self.tensor_quant_overrides):
            return method(self, weight_name, weight_qType, channel_axis, reduce_range, keep_float_weight)
        key = ("weight", weight_name, tuple(weight.dims), weight.data_type, weight_qType, channel_axis,
               bool(reduce_range), bool(keep_float_weight), bool(self.reduce_range),
               bool(self.is_weight_symmetric(weight_qType)), self.min_real_range)
        values = weight.raw_data or weight.SerializeToString()
        kept = memo.get(key)
        if kept is not None and kept[0] == values:
            self.model.initializer_extend([_copied(t) for t in kept[2]])
            return kept[1]
        before = {t.name for t in self.model.initializer()}
        names = method(self, weight_name, weight_qType, channel_axis, reduce_range, keep_float_weight)
        memo[key] = (values, names, [_copied(t) for t in self.model.initializer() if t.name not in before])
        return names

    return call


def _memoized_quant_params(method, memo: dict):
    """ORT's QDQ scales and zero points of the initializers it quantizes (`_calc_initializer_quant_params`: a
    Python loop over channels), a whole tensor at a time: memoized per channel, a model's thousands of channels
    still cost each build the loop (BENCHMARKS.md: "ORT's quantizer loops done once"). A tensor is recognised by
    name, shape, type, its quantization info and the quantizer's settings, then its bytes compared with the ones
    kept; one with overrides, or not kept yet, goes to ORT's own method. The parameters are handed out as copies
    (ORT adjusts a weight's for its bias afterwards), in ORT's order."""

    def call(self):
        initializers = {t.name: t for t in self.model.initializer()}
        settings = (self.weight_qType, self.activation_qType, bool(self.is_weight_symmetric(self.weight_qType)),
                    bool(self.is_activation_symmetric), bool(self.reduce_range), self.min_real_range)
        kept, left, new = {}, {}, {}
        for name, info in self.tensors_to_quantize.items():
            tensor = initializers.get(name)
            if tensor is None or name in self.tensor_quant_overrides:
                left[name] = info
                continue
            key = ("params", name, tuple(tensor.dims), tensor.data_type, str(info.tensor_type), info.axis,
                   info.data_type, settings)
            values = tensor.raw_data or tensor.SerializeToString()
            entry = memo.get(key)
            if entry is not None and entry[0] == values:
                kept[name] = copy.deepcopy(entry[1])
            else:
                left[name], new[name] = info, (key, values)
        everything, self.tensors_to_quantize = self.tensors_to_quantize, left
        try:
            computed = method(self)
        finally:
            self.tensors_to_quantize = everything
        for name, (key, values) in new.items():
            if name in computed:
                memo[key] = (values, copy.deepcopy(computed[name]))
        return {name: kept[name] if name in kept else computed[name] for name in everything
                if name in kept or name in computed}

    return call


def _memoized_initializer(function, memo: dict):
    """ORT's QDQ weight quantization (`quantize_onnx_initializer`, a Python loop over channels), whole weight at a
    time (BENCHMARKS.md: "ORT's quantizer loops done once"). Recognised by name, shape, type and the scales and
    zero points asked for, then its bytes compared with the ones kept (as _memoized_weight); the integers are
    handed out as a copy."""

    def call(weight, *args, **kwargs):  # its other arguments as ORT passes them (1.32 added block_size)
        key = ("initializer", weight.name, tuple(weight.dims), weight.data_type, tuple(_exact(a) for a in args),
               tuple(sorted((k, _exact(v)) for k, v in kwargs.items())))
        values = weight.raw_data or weight.SerializeToString()
        kept = memo.get(key)
        if kept is None or kept[0] != values:
            kept = memo[key] = (values, function(weight, *args, **kwargs))
        return _copied(kept[1])

    return call


def _copied(tensor: onnx.TensorProto) -> onnx.TensorProto:
    copy = onnx.TensorProto()
    copy.CopyFrom(tensor)
    return copy


def _exact(value):
    """A memo key for an argument that tells apart every value it could hold: arrays (and numpy scalars) by bytes,
    type and shape, lists and tuples item by item."""
    if isinstance(value, np.ndarray | np.generic):
        array = np.asarray(value)
        return (array.tobytes(), array.dtype.str, array.shape)
    if isinstance(value, list | tuple):
        return tuple(_exact(item) for item in value)
    return value


@contextmanager
def _without_torch():
    """Importing onnxruntime.quantization imports torch when it is installed (`onnxruntime.tools` loads a
    PyTorch export helper whenever `importlib.util.find_spec("torch")` finds it): seconds of every run
    (BENCHMARKS.md: "ORT's quantization imported without torch"), for a helper qprep never calls. `find_spec`
    answers None for a module whose `sys.modules` entry is None, so torch is marked absent for that import and
    unmarked after it; a torch imported already is left alone."""
    if "torch" in sys.modules:
        yield
        return
    sys.modules["torch"] = None
    try:
        yield
    finally:
        if sys.modules.get("torch", ...) is None:
            del sys.modules["torch"]
