"""ONNX Runtime INT8 quantization (its static quantizer, or dynamic MatMuls), with defaults chosen for x86 CPUs.

Why these defaults (BENCHMARKS.md: "ORT defaults"): QDQ format, uint8 activations with int8
weights (U8S8: ORT's fast VNNI path; S8S8 QDQ is converted at session time and is often slower), per-channel
weights (per-tensor loses badly on depthwise convolutions); where this CPU's u8s8 kernels saturate
(model/saturation.py), symmetric uint8 weights for static models (`weight_type: auto`) or 7-bit int8 (`weight_type:
int8`, faster there, less accurate).
Nodes in the float set get no Q/DQ at all (nodes_to_exclude), so they and their edges compute in float32.
Weights are then re-rounded by GPTQ (gptq.py) and biases corrected for the drift of channel means
(bias_correction.py), each run only where its predicted cost is worth its expected gain (refinements.py) and
kept only where it lowers the output error (BENCHMARKS.md: "GPTQ weight rounding", "empirical bias correction").

The flow: `quantize` (below) → quantizer.py (OrtQuantizer: calibrate once, build per float set and settings)
→ with a fallback configured, search.py (the ORT trials around qprep.quantize.search) → the final build.
"""

from __future__ import annotations

import dataclasses
import logging

from qprep.errors import QprepError
from qprep.graph.names import require_unique
from qprep.qdq import float_maxpool
from qprep.quantize import rewrites, smooth_layernorm
from qprep.quantize.backend import Quantized, QuantizeJob
from qprep.schema import Key, section

log = logging.getLogger("qprep")

OPTIONS = section(
    "ONNX Runtime static quantization (backend: ort)",
    activations=Key("str", default="auto", choices=("auto", "static", "dynamic"),
                    doc="static: calibrated activation ranges (CNNs); dynamic: ranges computed per inference for "
                        "MatMul inputs (transformers, whose static ranges fail: MiniLM cosine 0.42 → 0.98); auto: "
                        "dynamic for a model with attention whose MatMul/Gemm layers carry most multiply-adds, "
                        "else static (activations.py)"),
    format=Key("str", default="qdq", choices=("qdq", "qoperator"), doc="QDQ (recommended) or QOperator; "
               "dynamic activations are always QOperator (MatMulInteger)"),
    activation_type=Key("str", default="uint8", choices=("uint8", "int8"), doc="activation integer type"),
    weight_type=Key("str", default="auto", choices=("auto", "int8", "uint8"),
                    doc="weight integer type; auto: symmetric uint8 for static activations where this CPU's u8s8 "
                        "kernels saturate (x86 without VNNI), else int8; uint8 weights are symmetric around 128 "
                        "(ORT's integer Conv needs one zero point per weight: quantize/ort/uint8_weights.py)"),
    per_channel=Key("bool", default=True, doc="per-output-channel weight scales"),
    reduce_range=Key("any", default="auto", choices=("auto", True, False),
                     doc="7-bit int8 weights; auto: where this CPU's ONNX Runtime u8s8 kernels saturate (x86 without "
                         "VNNI, measured by a probe: model/saturation.py) and the weights are int8, else full "
                         "8-bit; true/false with weight_type auto means int8"),
    calibrate_method=Key("str", default="minmax", choices=("minmax", "mse", "entropy", "percentile", "distribution"),
                         doc="how activation ranges are chosen from the calibration data (mse: qprep's per-tensor "
                             "least-squared-error range; the fallback tries it when minmax misses the target)"),
    op_types=Key("list", item=Key("str"), doc="op types to quantize (default: every op type ORT quantizes; "
                                              "dynamic: MatMul and Gemm)"),
    nodes_to_exclude=Key("list", item=Key("str"), default=[], doc="node names kept float (beside the float set)"),
    extra_options=Key("mapping", default={}, doc="passed to ORT's quantizer (and calibrator) extra_options as is"),
    weight_rounding=Key("str", default="gptq", choices=("gptq", "nearest"),
                        doc="gptq: integer weights rounded to minimise each layer's output error on the calibration "
                            "data (run where its predicted cost is worth its expected gain: refinements.py; kept only "
                            "if the model's output error goes down); nearest: ORT's rounding"),
    spread_tensors=Key("str", default="float", choices=("float", "int16", "off"),
                       doc="what the fallback may do with activations whose channels spread too far for one int8 "
                           "scale (BatchNorm folded into depthwise convolutions; channel_spread.py): float — their "
                           "producer and consumers left float; int16 — 16-bit QDQ, for NPU execution providers "
                           "that run it (ONNX Runtime's CPU runs it in float, slower than float); off"),
    fast_kernels=Key("bool", default=True,
                     doc="fit ONNX Runtime's fast int8 convolution kernels: channel counts padded to multiples of 16 "
                         "(exact; kept if faster, channel_padding.py) and Convs reading the model's input over a "
                         "channel count not a multiple of 4 kept float (input_convs.py)"),
    smooth_layernorm=smooth_layernorm.OPTION,
    bias_correction=Key("bool", default=True,
                        doc="move each layer's integer bias by the drift of its output channels' means measured on "
                            "the calibration data (static QDQ; run where its predicted cost is worth its expected "
                            "gain: refinements.py; kept only if the model's output error goes down)"),
)


def quantize(job: QuantizeJob) -> Quantized:
    """The float set and nodes_to_exclude left float; with a fallback configured, the search (search.py) first
    chooses which more nodes stay float and the settings of the final build."""
    # imported here, not at the top: onnxruntime.quantization is slow to import (BENCHMARKS.md: "ORT's
    # quantizer imported on use"), and the config schema imports this package for OPTIONS on every run, whatever
    # the backend
    import onnxruntime

    from qprep.quantize.ort import channel_padding
    from qprep.quantize.ort.activations import choose as choose_activations
    from qprep.quantize.ort.input_convs import narrow_input_convs
    from qprep.quantize.ort.quantizer import OrtQuantizer
    from qprep.quantize.ort.search import fallback

    # ORT's quantization tools (the calibrator) make sessions with default options, whose C++ warnings go
    # straight to fd 2, e.g. "Removing initializer 'w'. It is not used by any node" for a model with an unused
    # weight: the terminal shows qprep's lines only (qprep's own sessions set severity 3 in model/runtime.py)
    onnxruntime.set_default_logger_severity(3)
    options, float_set = job.options, job.float_set
    activations = {"configured": options.activations}
    if options.activations == "auto":
        chosen, why = choose_activations(job.model)
        options = dataclasses.replace(options, activations=chosen)
        job = job.but(options=options)
        activations.update(chosen=chosen, why=why)
        log.info("ort: activations %s (%s)", chosen, why)
    unknown = sorted(set(options.nodes_to_exclude) - {n.name for n in job.model.graph.node})
    if unknown:
        raise QprepError(f"quantize.ort.nodes_to_exclude: no node named {', '.join(unknown[:5])}; "
                         "run `qprep inspect` or see report.json for node names")
    require_unique(job.model, "the stages before quantize")
    job, smoothed = smooth_layernorm.smooth_job(job, "ort")
    if smoothed:
        require_unique(job.model, "smooth_layernorm (quantize/smooth_layernorm.py)")
    quantizer = OrtQuantizer(job.model, job.samples, options, job.work_dir, job.threads, job.progress, job.extremes,
                             many_builds=bool(job.fallback))
    float_set = float_set | smooth_layernorm.restoring_muls(smoothed)
    excluded = (set(options.nodes_to_exclude) | float_set) & quantizer.node_names
    speed_float = set()
    if options.fast_kernels and not quantizer.dynamic:
        speed_float = set(narrow_input_convs(job.model)) - excluded
        excluded |= speed_float
    settings, details = quantizer.settings, {}
    if job.fallback:
        outcome, settings = fallback(quantizer, excluded, job)
        excluded, details["fallback"] = set(outcome.float_nodes), outcome.record
    quantized = quantizer.build(excluded, settings)
    if rewrites.runs("maxpool_float", "ort", options):  # exact, for speed: ORT's uint8 MaxPool kernel is slow
        quantized, details["maxpool_float"] = float_maxpool.rewrite(quantized, job.samples[:8], job.threads)
        require_unique(quantized, "maxpool_float (qdq/float_maxpool.py)")
    if rewrites.runs("channel_padding", "ort", options):
        quantized, details["channel_padding"] = channel_padding.apply(quantized, job.samples[:8], job.threads)
        require_unique(quantized, "channel_padding (quantize/ort/channel_padding.py)")
    details.update({"activations": activations, "weights": quantizer.weights, "excluded_nodes": sorted(excluded),
                    "calibration_samples": len(job.samples),
                    "calibrate_method": settings.calibrate_method, "weight_rounding": quantizer.rounding,
                    "bias_correction": quantizer.bias,
                    "float_op_types": sorted(settings.float_op_types),
                    "spread_tensors": {"as": options.spread_tensors, "tensors": sorted(settings.spread_tensors),
                                       "float_nodes": sorted(quantizer.spread_nodes(settings))},
                    "qdq_simplified": quantizer.simplified, "float_for_speed": sorted(speed_float)})
    if smoothed:
        details["smoothed_layernorms"] = smoothed
    if quantizer.unquantizable:  # ORT's quantizer failed on them: kept float, with its message
        details["unquantizable"] = [{"node": node, "reason": reason} for node, reason in quantizer.unquantizable.items()]
    missing = sorted(float_set - quantizer.node_names)
    if missing:  # e.g. keep_float ran before optimize fused the decomposed LayerNorms it named
        details["float_set_unmatched"] = missing
        log.warning("ort: %d float-set nodes are not in the model any more (run keep_float after optimize): %s",
                    len(missing), ", ".join(missing[:10]))
    if quantizer.renamed:  # values whose names ORT's quantizer would also give what it adds (prepare.py)
        details["renamed_for_ort"] = quantizer.renamed
    if quantizer.upgraded_from is not None:
        details["opset_upgraded_from"] = quantizer.upgraded_from
    return Quantized(model=quantized, details=details, extremes=quantizer.extremes)

