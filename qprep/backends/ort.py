"""ONNX Runtime static INT8 quantization (`quantize_static`), with defaults chosen for x86 CPUs.

Why these defaults (measured on this machine, see BENCHMARKS.md): QDQ format, uint8 activations with int8
weights (U8S8: ORT's fast VNNI path; S8S8 QDQ is converted at session time and is often slower), per-channel
weights (per-tensor loses badly on depthwise convolutions), no reduce_range (only for CPUs without VNNI).
Nodes in the float set get no Q/DQ at all (nodes_to_exclude), so they and their edges compute in float32.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import onnx
import onnx.version_converter

from qprep.backends import BackendInput, Quantized
from qprep.errors import QprepError
from qprep.model_info import default_opset
from qprep.schema import Key, section

log = logging.getLogger("qprep")

OPTIONS = section(
    "ONNX Runtime static quantization (backend: ort)",
    format=Key("str", default="qdq", choices=("qdq", "qoperator"), doc="QDQ (recommended) or QOperator"),
    activation_type=Key("str", default="uint8", choices=("uint8", "int8"), doc="activation integer type"),
    weight_type=Key("str", default="int8", choices=("int8", "uint8"), doc="weight integer type"),
    per_channel=Key("bool", default=True, doc="per-output-channel weight scales"),
    reduce_range=Key("bool", default=False, doc="7-bit weights, only for CPUs without VNNI"),
    calibrate_method=Key("str", default="minmax", choices=("minmax", "entropy", "percentile", "distribution"),
                         doc="how activation ranges are chosen from the calibration data"),
    op_types=Key("list", item=Key("str"), doc="op types to quantize (default: every op type ORT quantizes)"),
    nodes_to_exclude=Key("list", item=Key("str"), default=[], doc="node names kept float (beside the float set)"),
    extra_options=Key("mapping", default={}, doc="passed to quantize_static's extra_options as is"),
)

# Per-channel DequantizeLinear (its `axis`) needs opset 13; ORT's quantizer would emit it anyway.
MIN_OPSET = 13
_TYPES = {"uint8": "QUInt8", "int8": "QInt8"}
_METHODS = {"minmax": "MinMax", "entropy": "Entropy", "percentile": "Percentile", "distribution": "Distribution"}


class _Reader:
    """quantize_static's CalibrationDataReader over qprep samples (a reader is consumed once: make a new one)."""

    def __init__(self, samples: list[dict], input_names: list[str]):
        self._items = iter([{n: s[n] for n in input_names} for s in samples])

    def get_next(self):
        return next(self._items, None)

    def rewind(self):  # pragma: no cover - ORT calls it only for some calibrators
        pass


def quantize(job: BackendInput) -> Quantized:
    model, samples, float_set, options, work_dir = job.model, job.samples, job.float_set, job.options, job.work_dir
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    upgraded_from = None
    if default_opset(model) < MIN_OPSET:
        upgraded_from, model = default_opset(model), onnx.version_converter.convert_version(model, MIN_OPSET)
    names = {n.name for n in model.graph.node}
    excluded = sorted((set(options["nodes_to_exclude"]) | float_set) & names)
    unknown = sorted(set(options["nodes_to_exclude"]) - names)
    if unknown:
        raise QprepError(f"quantize.ort.nodes_to_exclude: no node named {', '.join(unknown[:5])}; "
                         "run `qprep inspect` or see report.json for node names")
    input_names = [i.name for i in model.graph.input if i.name not in {t.name for t in model.graph.initializer}]
    with tempfile.TemporaryDirectory(dir=work_dir, prefix="ort-") as tmp:
        source, target = Path(tmp) / "float.onnx", Path(tmp) / "int8.onnx"
        onnx.save_model(model, str(source))
        try:
            quantize_static(
                str(source), str(target), _Reader(samples, input_names),
                quant_format=QuantFormat.QDQ if options["format"] == "qdq" else QuantFormat.QOperator,
                op_types_to_quantize=options["op_types"], per_channel=options["per_channel"],
                reduce_range=options["reduce_range"],
                activation_type=getattr(QuantType, _TYPES[options["activation_type"]]),
                weight_type=getattr(QuantType, _TYPES[options["weight_type"]]),
                nodes_to_exclude=excluded or None,
                calibrate_method=getattr(CalibrationMethod, _METHODS[options["calibrate_method"]]),
                extra_options=dict(options["extra_options"]),
            )
        except Exception as exc:  # ORT raises bare exceptions with the op/tensor in the text
            raise QprepError(f"ONNX Runtime quantization failed: {str(exc).splitlines()[0][:300]} "
                             "(try format: qdq, per_channel: false, or exclude the node named in the message)") from None
        quantized = onnx.load(str(target))
    details = {"excluded_nodes": excluded, "calibration_samples": len(samples)}
    missing = sorted(float_set - names)
    if missing:  # e.g. keep_float ran before optimize fused the decomposed LayerNorms it named
        details["float_set_unmatched"] = missing
        log.warning("ort: %d float-set nodes are not in the model any more (run keep_float after optimize): %s",
                    len(missing), ", ".join(missing[:10]))
    if upgraded_from is not None:
        details["opset_upgraded_from"] = upgraded_from
    return Quantized(model=quantized, details=details)
