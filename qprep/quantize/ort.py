"""ONNX Runtime INT8 quantization (its static quantizer, or dynamic MatMuls), with defaults chosen for x86 CPUs.

Why these defaults (measured on this machine, see BENCHMARKS.md): QDQ format, uint8 activations with int8
weights (U8S8: ORT's fast VNNI path; S8S8 QDQ is converted at session time and is often slower), per-channel
weights (per-tensor loses badly on depthwise convolutions), no reduce_range (only for CPUs without VNNI).
Nodes in the float set get no Q/DQ at all (nodes_to_exclude), so they and their edges compute in float32.
Weights are then re-rounded by GPTQ (gptq.py), which takes EfficientNet-Lite0 from cosine 0.989 to
0.997, and biases corrected for the drift of channel means (bias_correction.py: calibration SQNR 22.8 → 26.0 dB
on top). Calibration runs once per model: `OrtQuantizer.build` re-quantizes with another float set in about a
second, which is what the accuracy-driven fallback needs.
"""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path

import numpy as np

import onnx
import onnx.version_converter

from qprep.quantize.backend import BackendInput, Quantized
from qprep.quantize import ranges as activation_ranges
from qprep.qdq import float_maxpool
from qprep.errors import QprepError
from qprep.evaluate.gate import check_gate
from qprep.evaluate.metrics import sqnr_db
from qprep.model.runtime import run_model
from qprep.model.info import default_opset, graph_inputs, multiply_adds
from qprep.model.io import is_large, save_model
from qprep.qdq import remove_redundant
from qprep.schema import Key, section

log = logging.getLogger("qprep")

OPTIONS = section(
    "ONNX Runtime static quantization (backend: ort)",
    activations=Key("str", default="static", choices=("static", "dynamic"),
                    doc="static: calibrated activation ranges (CNNs); dynamic: ranges computed per inference for "
                        "MatMul inputs (transformers, whose static ranges fail: MiniLM cosine 0.42 → 0.98)"),
    format=Key("str", default="qdq", choices=("qdq", "qoperator"), doc="QDQ (recommended) or QOperator; "
               "dynamic activations are always QOperator (MatMulInteger)"),
    activation_type=Key("str", default="uint8", choices=("uint8", "int8"), doc="activation integer type"),
    weight_type=Key("str", default="int8", choices=("int8", "uint8"), doc="weight integer type"),
    per_channel=Key("bool", default=True, doc="per-output-channel weight scales"),
    reduce_range=Key("bool", default=False, doc="7-bit weights, only for CPUs without VNNI"),
    calibrate_method=Key("str", default="minmax", choices=("minmax", "mse", "entropy", "percentile", "distribution"),
                         doc="how activation ranges are chosen from the calibration data (mse: qprep's per-tensor "
                             "least-squared-error range; the fallback tries it when minmax misses the target)"),
    op_types=Key("list", item=Key("str"), doc="op types to quantize (default: every op type ORT quantizes; "
                                              "dynamic: MatMul and Gemm)"),
    nodes_to_exclude=Key("list", item=Key("str"), default=[], doc="node names kept float (beside the float set)"),
    extra_options=Key("mapping", default={}, doc="passed to ORT's quantizer (and calibrator) extra_options as is"),
    weight_rounding=Key("str", default="gptq", choices=("gptq", "nearest"),
                        doc="gptq: integer weights rounded to minimise each layer's output error on the calibration "
                            "data (kept only if the model's output error goes down); nearest: ORT's rounding"),
    bias_correction=Key("bool", default=True,
                        doc="move each layer's integer bias by the drift of its output channels' means measured on "
                            "the calibration data (static QDQ; kept only if the model's output error goes down)"),
)

# Per-channel DequantizeLinear (its `axis`) needs opset 13; ORT's quantizer would emit it anyway.
MIN_OPSET = 13
_TYPES = {"uint8": "QUInt8", "int8": "QInt8"}
_METHODS = {"minmax": "MinMax", "entropy": "Entropy", "percentile": "Percentile", "distribution": "Distribution"}


# extra_options ORT's quantize_static hands to the calibrator (its own names → the calibrator's)
_CALIBRATOR_OPTIONS = {"CalibTensorRangeSymmetric": "symmetric", "CalibMovingAverage": "moving_average",
                       "CalibMovingAverageConstant": "averaging_constant",
                       "CalibMaxIntermediateOutputs": "max_intermediate_outputs", "CalibPercentile": "percentile"}


class _Reader:
    """The calibrator's CalibrationDataReader over qprep samples (a reader is consumed once: make a new one)."""

    def __init__(self, samples: list[dict], input_names: list[str]):
        self._items = iter([{n: s[n] for n in input_names} for s in samples])

    def get_next(self):
        return next(self._items, None)

    def rewind(self):  # pragma: no cover - ORT calls it only for some calibrators
        pass


class OrtQuantizer:
    """Calibrate once, quantize as often as needed: activation ranges, the GPTQ input moments and the
    re-rounded integers of every layer are computed on the first build and reused by later builds."""

    def __init__(self, model: onnx.ModelProto, samples: list[dict], options: dict, work_dir: Path, threads: int = 2,
                 progress=None):
        self.upgraded_from = None
        if default_opset(model) < MIN_OPSET:
            self.upgraded_from, model = default_opset(model), _upgraded(model)
        self.model, self.samples, self.options, self.work_dir, self.threads = model, samples, options, work_dir, threads
        self.progress = progress
        self.node_names = {n.name for n in model.graph.node}
        self.range_method = options["calibrate_method"]
        self._ranges: dict = {}  # range method → ORT TensorsData
        self._moments: dict | None = None
        self._integers: dict = {}  # (node, scale bytes) → re-rounded integers
        self.rounding: dict = {"method": options["weight_rounding"]}
        self._can_correct = bool(options["bias_correction"]) and options["format"] == "qdq" and not self.dynamic
        self.correcting = self._can_correct
        self._float_outputs: list | None = None  # the float model's outputs on the calibration samples
        self.bias: dict = {"applied": False}  # what bias correction did on the last build
        self._bias: dict = {}  # (float set, float op types, range method) → {shifts, layers, …, kept}
        self.float_op_types: set[str] = set()  # op types the fallback measured better left float
        self._last: tuple | None = None  # (float set, float op types, range method, correcting) → last build
        self.simplified: dict = {}  # exact Q/DQ rewrites on the last build (qdq/remove_redundant.py), by kind

    @property
    def dynamic(self) -> bool:
        return self.options["activations"] == "dynamic"

    def calibrate(self):
        """Activation ranges from the calibration samples (computed once per method; none when dynamic)."""
        if self.dynamic:
            return None
        method = self.range_method
        if method not in self._ranges:
            if method == "mse":  # refined from min/max with one more run of the float model
                minmax = self._ort_ranges("minmax")
                pairs = {name: tuple(float(np.asarray(v).ravel()[0]) for v in data.range_value)
                         for name, data in minmax.items()}
                self._ranges[method] = _tensors_data(activation_ranges.mse_ranges(self.model, pairs, self.samples,
                                                                                   self.threads))
            else:
                self._ranges[method] = self._ort_ranges(method)
        return self._ranges[method]

    def use_ranges(self, method: str) -> None:
        self.range_method = method

    def use_bias_correction(self, on: bool) -> None:
        self.correcting = on and self._can_correct

    def _ort_ranges(self, method: str):
        """ONNX Runtime's calibrator (run once per method)."""
        from onnxruntime.quantization import CalibrationMethod
        from onnxruntime.quantization.calibrate import create_calibrator

        if method in self._ranges:
            return self._ranges[method]
        extra = self.options["extra_options"]
        calibrator_options = {key: extra[name] for name, key in _CALIBRATOR_OPTIONS.items() if name in extra}
        inputs = [spec.name for spec in graph_inputs(self.model)]
        with tempfile.TemporaryDirectory(dir=self.work_dir, prefix="ort-calibrate-") as tmp:
            source = Path(tmp) / "float.onnx"
            save_model(self.model, source)
            calibrator = create_calibrator(
                source, self._op_types(for_calibration=True), augmented_model_path=str(Path(tmp) / "augmented.onnx"),
                calibrate_method=getattr(CalibrationMethod, _METHODS[method]), extra_options=calibrator_options,
                use_external_data_format=is_large(self.model))  # the augmented model outgrows 2 GB with it
            calibrator.collect_data(_Reader(self.samples, inputs))
            self._ranges[method] = calibrator.compute_data()
            del calibrator
        return self._ranges[method]

    def build(self, excluded: set[str]) -> onnx.ModelProto:
        """The quantized model with `excluded` nodes (and their edges) left float. The fallback asks for the
        same float set several times in a row (ranking base, candidates, search base): the last build is kept."""
        key = (frozenset(excluded & self.node_names), frozenset(self.float_op_types), self.range_method,
               self.correcting)
        if self._last is not None and self._last[0] == key:
            return self._last[1]
        try:
            quantized = self._quantize(self.calibrate(), sorted(excluded & self.node_names))
        except QprepError:
            raise
        except Exception as exc:  # ORT raises bare exceptions with the op/tensor in the text
            raise QprepError(f"ONNX Runtime quantization failed: {str(exc).splitlines()[0][:300]} "
                             "(try format: qdq, per_channel: false, or exclude the node named in the message)") from None
        if self.options["weight_rounding"] == "gptq" and self.options["format"] == "qdq" and not self.dynamic:
            quantized = self._round_weights(quantized)
        elif self.options["weight_rounding"] == "gptq":
            self.rounding.update(kept=False, reason="GPTQ re-rounds DequantizeLinear weights: static QDQ only")
        if self.correcting:
            quantized = self._correct_biases(quantized, key[:3])
        else:
            self.bias = {"applied": False}
        if self.options["format"] == "qdq" and not self.dynamic:  # exact rules: verified on the first build only
            quantized, self.simplified = remove_redundant.simplify(quantized, self.samples[:8], self.threads,
                                                                   verify=self._last is None)
        self._last = (key, quantized)
        return quantized

    def _op_types(self, for_calibration: bool = False) -> list[str]:
        from onnxruntime.quantization.registry import QDQRegistry, QLinearOpsRegistry

        if self.options["op_types"]:
            chosen = list(self.options["op_types"])
        elif self.dynamic:  # ConvInteger is slower than float Conv on x86; Gather/Attention are not worth it
            chosen = ["MatMul", "Gemm"]
        else:
            chosen = sorted(set(QDQRegistry) | set(QLinearOpsRegistry))
        return chosen if for_calibration else [t for t in chosen if t not in self.float_op_types]

    def _quantize(self, ranges, excluded: list[str]) -> onnx.ModelProto:
        from onnxruntime.quantization import QuantType
        from onnxruntime.quantization.onnx_quantizer import ONNXQuantizer
        from onnxruntime.quantization.qdq_quantizer import QDQQuantizer
        from onnxruntime.quantization.quant_utils import QuantizationMode, save_and_reload_model_with_shape_infer

        model = save_and_reload_model_with_shape_infer(self.model)
        common = dict(per_channel=self.options["per_channel"], reduce_range=self.options["reduce_range"],
                      weight_qType=getattr(QuantType, _TYPES[self.options["weight_type"]]),
                      activation_qType=getattr(QuantType, _TYPES[self.options["activation_type"]]),
                      tensors_range=ranges, nodes_to_quantize=[], nodes_to_exclude=excluded,
                      op_types_to_quantize=self._op_types(), extra_options=dict(self.options["extra_options"]))
        if self.dynamic:  # as quantize_dynamic: uint8 activations, only MatMuls with a constant weight
            extra = {"MatMulConstBOnly": True, **common.pop("extra_options")}
            common.update(activation_qType=QuantType.QUInt8, tensors_range=None, extra_options=extra)
            quantizer = ONNXQuantizer(model, mode=QuantizationMode.IntegerOps, static=False, **common)
        elif self.options["format"] == "qdq":
            quantizer = QDQQuantizer(model, **common)
        else:
            quantizer = ONNXQuantizer(model, mode=QuantizationMode.QLinearOps, static=True, **common)
        quantizer.quantize_model()
        quantizer.model.topological_sort()  # what ORT's save_model_to_file does: new Q/DQ nodes are appended
        return quantizer.model.model

    def _round_weights(self, quantized: onnx.ModelProto) -> onnx.ModelProto:
        """GPTQ integers; on the first build the result is compared with nearest rounding on the calibration
        samples and kept only if the output error went down (then every later build uses it too)."""
        from qprep.quantize import gptq

        if self.rounding.get("kept") is False:
            return quantized
        layers = gptq.find_layers(quantized, self.model)
        if self._moments is None:
            self._moments = gptq.input_moments(quantized, layers, self.samples, self.threads)
        rounded, changed = gptq.apply(quantized, layers, self._moments, cache=self._integers)
        if "kept" not in self.rounding:
            nearest_db, rounded_db = self._calibration_sqnr(quantized, rounded)
            self.rounding.update(layers=changed, calibration_sqnr_db={"nearest": nearest_db, "gptq": rounded_db},
                                 kept=bool(rounded_db > nearest_db))
            log.info("ort: GPTQ weight rounding on %d layers: calibration SQNR %.2f → %.2f dB (%s)", changed,
                     nearest_db, rounded_db, "kept" if self.rounding["kept"] else "not better, nearest kept")
        return rounded if self.rounding["kept"] else quantized

    def _calibration_sqnr(self, *models: onnx.ModelProto) -> list[float]:
        """Each model's output SQNR (dB) against the float model on the calibration samples (the float outputs
        computed once): how GPTQ and bias correction decide whether they are kept."""
        if self._float_outputs is None:
            self._float_outputs = run_model(self.model, self.samples, self.threads, optimize=True)
        return [output_sqnr(self._float_outputs, run_model(m, self.samples, self.threads, optimize=True))
                for m in models]

    def _note(self, message: str) -> None:
        log.info("ort: %s", message)
        if self.progress is not None:
            self.progress.note(message)

    def _correct_biases(self, quantized: onnx.ModelProto, key: tuple) -> onnx.ModelProto:
        """Bias shifts (bias_correction.py) measured for this float set and range method: they compensate the
        drift of the layers upstream, which another float set changes, so each build measures its own (~1 min
        on PP-OCRv4 rec, which is why the fallback searches without them). Kept only if the calibration output
        error goes down."""
        from qprep.quantize import bias_correction

        layers = bias_correction.find_layers(quantized, self.model)
        if key not in self._bias:
            started = time.perf_counter()
            self._note(f"bias correction: {len(layers)} layers in {len(bias_correction.waves(layers))} waves over "
                       f"{len(self.samples)} calibration samples")
            shifts = bias_correction.corrections(quantized, self.model, layers, self.samples, self.threads)
            before_db, after_db = self._calibration_sqnr(quantized, bias_correction.apply(quantized, layers, shifts))
            kept = bool(after_db > before_db)
            self._bias[key] = {"shifts": shifts if kept else {}, "layers": len(shifts), "kept": kept,
                               "calibration_sqnr_db": {"before": round(before_db, 2), "after": round(after_db, 2)},
                               "seconds": round(time.perf_counter() - started, 1)}
            self._note(f"bias correction: calibration SQNR {before_db:.2f} → {after_db:.2f} dB, "
                       f"{'kept' if kept else 'not better, left out'} ({self._bias[key]['seconds']:.0f} s)")
        result = self._bias[key]
        self.bias = {"applied": result["kept"], **{k: v for k, v in result.items() if k != "shifts"}}
        return bias_correction.apply(quantized, layers, result["shifts"]) if result["shifts"] else quantized


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


def _tensors_data(ranges: dict[str, tuple[float, float]]):
    from onnxruntime.quantization import CalibrationMethod
    from onnxruntime.quantization.calibrate import TensorsData

    return TensorsData(CalibrationMethod.MinMax, {name: (np.array(low, np.float32), np.array(high, np.float32))
                                                  for name, (low, high) in ranges.items()})


def output_sqnr(expected: list[dict], actual: list[dict]) -> float:
    """SQNR (dB) of all float outputs together, over the samples."""
    pairs = [(e[name], a[name]) for e, a in zip(expected, actual) for name in e
             if np.asarray(e[name]).dtype.kind == "f" and np.shape(e[name]) == np.shape(a[name])]
    return sqnr_db([p[0] for p in pairs], [p[1] for p in pairs])


def quantize(job: BackendInput) -> Quantized:
    import onnxruntime

    # ORT's quantization tools (the calibrator) make sessions with default options, whose C++ warnings go
    # straight to fd 2, e.g. "Removing initializer 'w'. It is not used by any node" for a model with an unused
    # weight: the terminal shows qprep's lines only (qprep's own sessions set severity 3 in model/runtime.py)
    onnxruntime.set_default_logger_severity(3)
    options, float_set = job.options, job.float_set
    unknown = sorted(set(options["nodes_to_exclude"]) - {n.name for n in job.model.graph.node})
    if unknown:
        raise QprepError(f"quantize.ort.nodes_to_exclude: no node named {', '.join(unknown[:5])}; "
                         "run `qprep inspect` or see report.json for node names")
    quantizer = OrtQuantizer(job.model, job.samples, options, job.work_dir, job.threads, job.progress)
    excluded = (set(options["nodes_to_exclude"]) | float_set) & quantizer.node_names
    details = {}
    if job.fallback:
        outcome = _fallback(quantizer, excluded, job)
        excluded, details["fallback"] = set(outcome.float_nodes), outcome.record
    quantized = quantizer.build(excluded)
    if not quantizer.dynamic:  # exact, for speed: ORT would run these MaxPools on uint8 with a slow kernel
        quantized, details["maxpool_float"] = float_maxpool.rewrite(quantized, job.samples[:8], job.threads)
    details.update({"excluded_nodes": sorted(excluded), "calibration_samples": len(job.samples),
                    "calibrate_method": quantizer.range_method, "weight_rounding": quantizer.rounding,
                    "bias_correction": quantizer.bias,
                    "float_op_types": sorted(quantizer.float_op_types),
                    "qdq_simplified": quantizer.simplified})
    missing = sorted(float_set - quantizer.node_names)
    if missing:  # e.g. keep_float ran before optimize fused the decomposed LayerNorms it named
        details["float_set_unmatched"] = missing
        log.warning("ort: %d float-set nodes are not in the model any more (run keep_float after optimize): %s",
                    len(missing), ", ".join(missing[:10]))
    if quantizer.upgraded_from is not None:
        details["opset_upgraded_from"] = quantizer.upgraded_from
    return Quantized(model=quantized, details=details)


def _fallback(quantizer: OrtQuantizer, excluded: set[str], job: BackendInput):
    """The accuracy-driven search with ORT: a trial is a re-quantization (ranges and GPTQ cached) and an
    ORT run on the evaluation samples; candidates are activation edges (`_edges`; MatMul nodes with dynamic
    quantization), those losing most accuracy first, promoted by gain per multiply-add."""
    from qprep.quantize import search

    started = time.perf_counter()  # the op-type phase counts against the budget too
    ops = {n.name: n.op_type for n in quantizer.model.graph.node}

    def measure(float_nodes: set[str], samples: list[dict]) -> dict:
        return job.measure(run_model(quantizer.build(float_nodes), samples, job.threads, optimize=True))

    evaluate = search.remembered(measure, lambda: (quantizer.range_method, frozenset(quantizer.float_op_types),
                                                     quantizer.correcting))
    wanted = quantizer.correcting
    # bias correction is measured per float set (a minute on large models), so not per trial: tried first on the
    # configured ranges (EfficientNet-Lite0 meets its target so, not with mse ranges), the search runs without it
    corrected_base = _corrected_base(quantizer, excluded, job, evaluate) if wanted else None

    ranges = search.choose_setting(
        "calibrate_method", quantizer.range_method,
        ["mse"] if quantizer.range_method == "minmax" and not quantizer.dynamic else [],
        quantizer.use_ranges, evaluate, excluded, job.evaluation_samples, job.fallback["target"], job.progress)
    op_types = _float_op_types(quantizer, excluded, job, evaluate)
    candidates = _candidates(quantizer.model, quantizer.build(excluded), job.evaluation_samples[:8], excluded,
                             job.threads)
    groups = {} if quantizer.dynamic else _edges(quantizer.model, candidates)
    if groups:
        candidates = list(groups)
    macs = multiply_adds(quantizer.model)
    total = sum(macs.values()) or 1
    cost = {c: sum(macs.get(n, 0) for n in groups.get(c, (c,))) / total for c in candidates}
    outcome = search.search(evaluate, candidates, excluded, job.evaluation_samples, job.fallback,
                              describe=lambda n: _describe(n, groups, ops), progress=job.progress, started=started,
                              groups=groups, cost=cost)
    outcome.record.update(float_op_types=op_types, ranges=ranges)
    if wanted:
        outcome.record["bias_correction"] = _correct_final(quantizer, outcome, corrected_base, job, evaluate, started)
    return outcome


def _corrected_base(quantizer: OrtQuantizer, excluded: set[str], job: BackendInput, evaluate) -> dict:
    """The base float set with bias correction: if that meets the target, the search ends at its base trial
    with it (EfficientNet-Lite0: 0 float nodes); otherwise the search runs without it."""
    from qprep.quantize import search

    started = time.perf_counter()
    quantizer.use_bias_correction(True)
    outputs = evaluate(excluded, job.evaluation_samples)
    passed = check_gate(job.fallback["target"], outputs)["passed"]
    quantizer.use_bias_correction(passed)
    score = search.score_of(outputs, job.fallback["target"])
    log.info("fallback: bias correction on the base: score %.5f%s", score, ", target met" if passed else "")
    return {"score": score, "passed": passed, "float_set": set(excluded), "seconds": time.perf_counter() - started}


def _correct_final(quantizer: OrtQuantizer, outcome, base: dict, job: BackendInput, evaluate, started: float) -> dict:
    """Bias correction on the float set the search chose (measured again unless that is the base's set, if the
    budget has room for a measurement as long as the base's took) and kept if the score goes up."""
    from qprep.quantize import search

    target, float_set = job.fallback["target"], set(outcome.float_nodes)
    record = {"base": {"score": base["score"], "passed": base["passed"]}}
    if base["passed"]:
        record["kept"] = True
        return record
    late = time.perf_counter() - started + base["seconds"] > job.fallback["time_budget_s"]
    if float_set != base["float_set"] and late:
        record.update(kept=False, why="no time left in the budget to measure it on the chosen float set")
        return record
    without = outcome.record["best"]["score"]
    quantizer.use_bias_correction(True)
    outputs = evaluate(float_set, job.evaluation_samples)
    gate = check_gate(target, outputs)
    score, passed = search.score_of(outputs, target), gate["passed"]
    kept = score > without and (passed or not outcome.passed)
    quantizer.use_bias_correction(kept)
    record["final"] = {"without": without, "with": score, "passed": passed}
    record["kept"] = kept
    log.info("fallback: bias correction on the chosen float set: score %.5f → %.5f (%s)", without, score,
             "kept" if kept else "left out")
    if kept:
        outcome.passed = passed
        metrics = {c["metric"]: c["value"] for c in gate.get("checks", [])}
        outcome.record.update(passed=passed, best={"score": score, "metrics": metrics},
                              seconds=round(time.perf_counter() - started, 1))
        if passed:
            outcome.record.pop("why", None)
    return record


def _edges(model: onnx.ModelProto, ordered_nodes: list[str]) -> dict[str, tuple[str, ...]]:
    """Activation tensor → the quantized nodes that must all be float for it to stay float (its producer and
    every consumer: with Q/DQ, a tensor is rounded when any of them is quantized). Why edges, not nodes: on
    EfficientNet-Lite0 keeping one edge float (2 nodes) did what four single nodes did not (0.9973 → 0.9980).
    Ordered as `ordered_nodes` (most accuracy lost first) by the edge's first member; duplicates dropped."""
    position = {name: i for i, name in enumerate(ordered_nodes)}
    consumers: dict[str, list[str]] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node.name)
    tensors = [(o, node.name) for node in model.graph.node for o in node.output]
    tensors += [(spec.name, None) for spec in graph_inputs(model)]
    edges, seen = [], set()
    for tensor, producer in tensors:
        members = tuple(dict.fromkeys(n for n in [producer, *consumers.get(tensor, [])] if n in position))
        if members and frozenset(members) not in seen:
            seen.add(frozenset(members))
            edges.append((min(position[n] for n in members), tensor, members))
    return {tensor: members for _, tensor, members in sorted(edges, key=lambda e: e[0])}


def _describe(candidate: str, groups: dict, ops: dict) -> str:
    if candidate in groups:
        return " + ".join(ops.get(n, "?") for n in groups[candidate]) + " (edge)"
    return ops.get(candidate, "?")


# Ops without weights whose int8 version only re-rounds an activation (elementwise, data movement, softmax).
# Conv/MatMul/Gemm are where INT8 pays; these are judged as whole op types before nodes are ranked.
_COMPUTE = {"Conv", "ConvTranspose", "MatMul", "Gemm"}


def _float_op_types(quantizer: OrtQuantizer, excluded: set[str], job: BackendInput, evaluate) -> dict:
    """Leave an op type float when that measurably helps: on PP-OCRv4 rec, quantizing the hardswish chains
    (Add, Clip, Mul) re-rounds every activation three times. Greedy: rank each type on the ranking samples, keep
    each drop that helps on all samples; then try all these types at once (one of a chain's ops left float
    alone only adds Q/DQ pairs), kept if better still."""
    from qprep.quantize.search import score_of
    from qprep.evaluate.gate import check_gate

    target = job.fallback["target"]
    outputs = evaluate(excluded, job.evaluation_samples)
    if check_gate(target, outputs)["passed"]:
        return {"chosen": [], "trials": [], "nodes": 0}
    current = score_of(outputs, target)
    present = {n.op_type for n in quantizer.model.graph.node if n.name not in excluded}
    types = [t for t in quantizer._op_types() if t in present and t not in _COMPUTE]
    rank_samples = job.evaluation_samples[: job.fallback["rank_samples"]]
    base = score_of(evaluate(excluded, rank_samples), target)
    gains = {}
    for op_type in types:
        quantizer.float_op_types = {op_type}
        gains[op_type] = score_of(evaluate(excluded, rank_samples), target) - base
    quantizer.float_op_types = set()
    trials = []

    def attempt(chosen: set[str], label: str, rank_gain) -> None:
        """Leave `chosen` float if that beats the current score on all samples, else put the last set back."""
        nonlocal current
        previous, quantizer.float_op_types = quantizer.float_op_types, chosen
        score = score_of(evaluate(excluded, job.evaluation_samples), target)
        kept = score > current
        trials.append({"op_type": label, "rank_gain": rank_gain, "score": score, "kept": kept})
        current, quantizer.float_op_types = (score, chosen) if kept else (current, previous)

    for op_type in sorted((t for t in gains if gains[t] > 0), key=lambda t: -gains[t]):
        attempt(quantizer.float_op_types | {op_type}, op_type, gains[op_type])
    union = set(types)  # every re-rounding type at once: a hardswish chain only pays when all its ops stay float
    if len(union) > 1 and union != quantizer.float_op_types:
        attempt(union, "+".join(sorted(union)), None)
    if job.progress is not None and quantizer.float_op_types:
        job.progress.note(f"fallback: op types left float: {', '.join(sorted(quantizer.float_op_types))} "
                          f"(score {base:.5f} → {current:.5f})")
    log.info("ort fallback: op types left float %s, score %.5f → %.5f", sorted(quantizer.float_op_types), base,
             current)
    return {"chosen": sorted(quantizer.float_op_types), "trials": trials,
            "nodes": sum(n.op_type in quantizer.float_op_types for n in quantizer.model.graph.node)}


def _candidates(float_model: onnx.ModelProto, quantized: onnx.ModelProto, samples: list[dict], excluded: set[str],
                threads: int) -> list[str]:
    """Nodes the quantizer touched (an input from DequantizeLinear, or replaced by an integer op), ordered by
    the accuracy lost across the node itself: SQNR at its inputs minus SQNR at its output (accumulated errors
    cancel out). Nodes whose output cannot be compared (graph outputs: the last classifier layer) come first."""
    from qprep.evaluate.layers import layer_errors

    dq_outputs = {o for n in quantized.graph.node if n.op_type == "DequantizeLinear" for o in n.output}
    in_quantized = {n.name: n for n in quantized.graph.node}
    originals = {n.name: n for n in float_model.graph.node}
    touched = [n for n in float_model.graph.node if n.name not in excluded and (
        n.name not in in_quantized  # replaced by an integer op (QOperator, dynamic MatMulInteger)
        or set(in_quantized[n.name].input) & dq_outputs)]
    rows = {r["node"]: r["sqnr_db"] for r in layer_errors(float_model, quantized, samples, threads)}
    producer = {o: n.name for n in float_model.graph.node for o in n.output}
    ceiling = 80.0  # dB: graph inputs and weights count as (nearly) exact

    def local_loss(node) -> float:
        before = min([rows.get(producer[i], ceiling) for i in originals[node.name].input if i in producer]
                     or [ceiling])
        return float("inf") if node.name not in rows else min(before, ceiling) - min(rows[node.name], ceiling)

    return [n.name for n in sorted(touched, key=lambda n: -local_loss(n))]
