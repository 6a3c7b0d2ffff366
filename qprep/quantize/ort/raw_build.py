"""One call of ONNX Runtime's own quantizer (static QDQ, QOperator, or dynamic MatMuls) with a float set and
settings, and the fixes qprep makes to what it writes: 8-bit Q/DQ back in ONNX's domain, uint8 weights' equal
zero points (uint8_weights.py), int32 biases re-scaled where ORT clipped them (int32_bias.py).

Why apart from the quantizer: this is where ORT's quantization internals are driven (third_party.py wraps
them), with what the fallback's many builds keep between calls (the shape-inferred model, each weight's
quantization); GPTQ, bias correction and the Q/DQ rules then work on its result. What ORT writes, and what
qprep's fixes leave, is checked for names defined twice (graph/names.py): a duplicate is never one node's doing.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable

import onnx

from qprep.graph.names import require_unique
from qprep.model.io import compacted
from qprep.quantize.ort import int32_bias, uint8_weights
from qprep.quantize.ort.settings import OrtSettings
from qprep.third_party import (
    input_renaming_by_readers,
    ort_quantization,
    shapes_inferred_already,
    weight_quantization_memo,
)

ORT = ort_quantization()

_TYPES = {"uint8": "QUInt8", "int8": "QInt8"}


class RawBuild:
    """ORT's quantizer over `model` with the run's `options`. `weights` is the stage's weights record: each
    call says there how many bias channels it re-scaled. With `reuse` (the fallback), what every call would
    compute again is kept: the shape-inferred model (one more copy of the weights) and each weight's
    quantization; a single build keeps nothing."""

    def __init__(self, model: onnx.ModelProto, options: dict, op_types: list[str],
                 spread_nodes: Callable[[OrtSettings], set[str]], weights: dict, reuse: bool):
        self.model, self.options, self.op_types, self.spread_nodes = model, options, op_types, spread_nodes
        self.weights, self.reuse = weights, reuse
        self.dynamic = options.activations == "dynamic"
        self.op_type_of = {n.name: n.op_type for n in model.graph.node}
        self._said = _OncePerMessage(fitted_biases=options.format == "qdq")  # ORT repeats its warnings per build
        self._inferred: onnx.ModelProto | None = None  # the model with ORT's shape inference, copied per build
        self._weight_memo: dict = {}  # weight slices ORT's quantizer quantized already (third_party)

    def __call__(self, ranges, excluded: list[str], settings: OrtSettings) -> onnx.ModelProto:
        if self.reuse:  # shape inference once, a copy per build (ORT's quantizer changes the model it is given)
            self._inferred = self._inferred or self._shape_inferred()
            model = _copied(self._inferred)
        else:
            model = ORT.save_and_reload_model_with_shape_infer(self.model)
        sixteen_bit = settings.spread_tensors if self.options.spread_tensors == "int16" else frozenset()
        quantizer = self._quantizer(model, ranges, excluded, settings, sixteen_bit)
        root = logging.getLogger()
        root.addFilter(self._said)
        try:
            with (weight_quantization_memo(self._weight_memo) if self.reuse else contextlib.nullcontext(),
                  input_renaming_by_readers()):
                quantizer.quantize_model()
        finally:
            root.removeFilter(self._said)
        quantizer.model.topological_sort()  # what ORT's save_model_to_file does: new Q/DQ nodes are appended
        require_unique(quantizer.model.model, "ONNX Runtime's quantizer")  # it names what it adds by suffixes
        if sixteen_bit:
            _eight_bit_in_default_domain(quantizer.model.model)
        if self.options.weight_type == "uint8":
            uint8_weights.equal_zero_points(quantizer.model.model)
        if not self.dynamic:  # ORT clips a bias its weight scale makes too fine (it fixes that for int8 weights only)
            self.weights["bias_channels_rescaled"] = int32_bias.fit_biases(quantizer.model.model, self.model)
        result = compacted(quantizer.model.model)  # without the float weights ORT removed
        require_unique(result, "qprep's fixes to ORT's quantized model (16-bit Q/DQ domain, uint8 zero points, "
                               "int32 biases)")
        return result

    def _quantizer(self, model: onnx.ModelProto, ranges, excluded: list[str], settings: OrtSettings,
                   sixteen_bit: frozenset[str]):
        """ORT's quantizer object for this build (not run yet)."""
        common = dict(per_channel=self.options.per_channel, reduce_range=self.options.reduce_range,
                      weight_qType=getattr(ORT.QuantType, _TYPES[self.options.weight_type]),
                      activation_qType=getattr(ORT.QuantType, _TYPES[self.options.activation_type]),
                      tensors_range=ranges, nodes_to_quantize=[], nodes_to_exclude=excluded,
                      op_types_to_quantize=[t for t in self.op_types if t not in settings.float_op_types],
                      extra_options=dict(self.options.extra_options))
        if self.options.weight_type == "uint8":
            common["extra_options"] = uint8_weights.quantizer_options(common["extra_options"])
        if sixteen_bit:
            common["extra_options"] = with_16_bit(common["extra_options"], sixteen_bit,
                                                  self.options.activation_type)
        else:
            common["nodes_to_exclude"] = sorted(set(excluded) | self.spread_nodes(settings))
        if self.dynamic:  # as quantize_dynamic: uint8 activations, only MatMuls with a constant weight
            # ORT writes each Gemm as a MatMul named <gemm>_MatMul before it reads nodes_to_exclude: a float Gemm
            # is excluded under that name too (it was quantized all the same)
            gemms = {f"{n}_MatMul" for n in common["nodes_to_exclude"] if self.op_type_of.get(n) == "Gemm"}
            common["nodes_to_exclude"] = sorted({*common["nodes_to_exclude"], *gemms})
            extra = {"MatMulConstBOnly": True, **common.pop("extra_options")}
            common.update(activation_qType=ORT.QuantType.QUInt8, tensors_range=None, extra_options=extra)
            with shapes_inferred_already() if self.reuse else contextlib.nullcontext():
                return ORT.ONNXQuantizer(model, mode=ORT.QuantizationMode.IntegerOps, static=False, **common)
        if self.options.format == "qdq":
            return ORT.QDQQuantizer(model, **common)
        return ORT.ONNXQuantizer(model, mode=ORT.QuantizationMode.QLinearOps, static=True, **common)

    def _shape_inferred(self) -> onnx.ModelProto:
        """The model after ORT's shape inference, kept for the fallback's builds; for dynamic builds with the
        Gemms replaced by MatMuls first, as ORT's dynamic quantizer does before inferring shapes again (it is
        then told not to: third_party.shapes_inferred_already)."""
        if not self.dynamic:
            return ORT.save_and_reload_model_with_shape_infer(self.model)
        model = _copied(self.model)
        ORT.ONNXModel(model).replace_gemm_with_matmul()
        return ORT.save_and_reload_model_with_shape_infer(model)


class _OncePerMessage(logging.Filter):
    """Lets each distinct message through once (ORT's "16-bit Q/DQ need opset 21" warning, on every build); with
    `fitted_biases`, none of ORT's clipped-bias warnings: int32_bias.py re-scales those QDQ channels after it."""

    def __init__(self, fitted_biases: bool = False):
        super().__init__()
        self.seen: set[str] = set()
        self.fitted_biases = fitted_biases

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message in self.seen or (self.fitted_biases and message.startswith("Quantized bias")
                                    and "exceeds the range" in message):
            return False
        self.seen.add(message)
        return True


def with_16_bit(extra_options: dict, wide: frozenset[str], activation_type: str) -> dict:
    """ORT's extra_options with `wide` activations quantized to 16 bits (TensorQuantOverrides; ORT writes their
    Q/DQ in the com.microsoft domain below opset 21). Overrides the config already gives a tensor are kept.
    Offered on its own, not only through a build: a build with 16-bit tensors is checked by its outputs, while
    which overrides ORT is handed (and that a configured one wins) is only seen here."""
    extra = dict(extra_options)
    if not wide:
        return extra
    wide_type = ORT.QuantType.QUInt16 if activation_type == "uint8" else ORT.QuantType.QInt16
    overrides = dict(extra.get("TensorQuantOverrides") or {})
    for name in sorted(wide):
        overrides.setdefault(name, [{"quant_type": wide_type}])
    extra["TensorQuantOverrides"] = overrides
    return extra


def _eight_bit_in_default_domain(model: onnx.ModelProto) -> None:
    """With one 16-bit tensor, ORT writes every Q/DQ node in the com.microsoft domain; the 8-bit ones go back to
    ONNX's (the same operator for 8-bit types), so the exact Q/DQ rewrites (qdq/) and tools that read only ONNX's
    Q/DQ still see them."""
    types = {i.name: i.data_type for i in model.graph.initializer}
    wide = {onnx.TensorProto.UINT16, onnx.TensorProto.INT16, onnx.TensorProto.UINT4, onnx.TensorProto.INT4}
    for node in model.graph.node:
        if (node.domain == "com.microsoft" and node.op_type in ("QuantizeLinear", "DequantizeLinear")
                and not any(types.get(name) in wide for name in list(node.input)[::2])):  # x and zero point
            node.domain = ""


def _copied(model: onnx.ModelProto) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    return copy
