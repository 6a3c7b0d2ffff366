"""The ONNX Runtime adapter: calibration, ORT's static (or dynamic) quantizer, then qprep's GPTQ weight rounding,
bias correction and exact Q/DQ simplification on what ORT produced.

Calibration runs once per model: `OrtQuantizer.build(float_set, settings)` re-quantizes with another float set
or other settings in about a second, which is what the accuracy-driven fallback (search.py) needs. Everything
the builds may vary is one immutable `OrtSettings`, which is also the cache key: the quantizer is never
reconfigured from outside.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

import onnx
import onnx.version_converter
from onnx import numpy_helper

from qprep.errors import QprepError
from qprep.third_party import (calibrate_all_but, input_renaming_by_readers, ort_quantization, shapes_inferred_already,
                                weight_quantization_memo)
from qprep.evaluate.metrics import aligned, sqnr_db
from qprep.model.info import Links, default_opset, graph_inputs, unique_name
from qprep.quantize.ort import int32_bias, uint8_weights
from qprep.quantize.ort.saturation import this_cpu, u8s8_saturates
from qprep.model.io import compacted, is_large, save_model
from qprep.model.ort_optimized import with_runtime_types
from qprep.model.prepare import drop_initializer_value_info
from qprep.model.runtime import ort_session, run_model, session_outputs, short_ort_message
from qprep.qdq import remove_redundant
from qprep.quantize import bias_correction, channel_spread, gptq, nonfinite
from qprep.quantize import ranges as activation_ranges

ORT = ort_quantization()
log = logging.getLogger("qprep")

# Per-channel DequantizeLinear (its `axis`) needs opset 13; ORT's quantizer would emit it anyway.
MIN_OPSET = 13
MAX_UNQUANTIZABLE = 16  # nodes ORT's quantizer fails on that are kept float before the failure is an error
_TYPES = {"uint8": "QUInt8", "int8": "QInt8"}
_METHODS = {"minmax": "MinMax", "entropy": "Entropy", "percentile": "Percentile", "distribution": "Distribution"}

# extra_options ORT's quantize_static hands to the calibrator (its own names → the calibrator's)
_CALIBRATOR_OPTIONS = {"CalibTensorRangeSymmetric": "symmetric", "CalibMovingAverage": "moving_average",
                       "CalibMovingAverageConstant": "averaging_constant",
                       "CalibMaxIntermediateOutputs": "max_intermediate_outputs", "CalibPercentile": "percentile"}


@dataclass(frozen=True)
class OrtSettings:
    """What one build may vary beyond the float set; the rest of the options are fixed per run. The fallback
    tries other values per trial (mse ranges, bias correction on or off, op types left float), so a build is
    asked for with its settings and cached under them."""

    calibrate_method: str  # how activation ranges are chosen (ORT's calibrators, or qprep's "mse")
    bias_correction: bool  # correct the integer biases (static QDQ only)
    float_op_types: frozenset[str] = field(default_factory=frozenset)  # op types not quantized at all
    # activations whose channels spread too far for one int8 scale (channel_spread.py): their producer and
    # consumers left float, or (option spread_tensors: int16) the tensors quantized to 16 bits
    spread_tensors: frozenset[str] = field(default_factory=frozenset)


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
    re-rounded integers of every layer are computed on the first build and reused by later builds.
    After a build, `rounding`, `bias` and `simplified` say what it did (for the stage's record)."""

    def __init__(self, model: onnx.ModelProto, samples: list[dict], options: dict, work_dir: Path, threads: int = 2,
                 progress=None, extremes: nonfinite.Extremes | None = None, many_builds: bool = False):
        self.extremes = extremes or nonfinite.Extremes()  # tensors kept float for their values: never calibrated
        self.upgraded_from = None
        if default_opset(model) < MIN_OPSET:
            self.upgraded_from, model = default_opset(model), _upgraded(model)
            # the converter writes attributes as constants (an opset-10 Clip's max=+inf): never calibrated
            self.extremes.tensors.update({name: stats for name, stats in nonfinite.extreme_constants(model).items()
                                          if name not in self.extremes.tensors})
        self.options, self.weights = weight_range(options)  # weight_type and reduce_range "auto" resolved here
        model = with_runtime_types(model, threads)  # com.microsoft ops: ORT's quantizer needs the types behind them
        drop_initializer_value_info(model)  # in place: entries that only repeat what the initializers declare
        if self.dynamic:
            model = shared_gemm_weights_transposed(model)
        self.model, self.samples, self.work_dir, self.threads = model, samples, work_dir, threads
        self.progress = progress
        self.op_type_of = {n.name: n.op_type for n in model.graph.node}
        self.node_names = frozenset(self.op_type_of)
        self.settings = OrtSettings(  # as configured: what builds use unless the fallback measured better
            calibrate_method=options["calibrate_method"],
            bias_correction=bool(options["bias_correction"]) and options["format"] == "qdq" and not self.dynamic)
        self._ranges: dict = {}  # range method → ORT TensorsData
        self._moments: dict | None = None
        self._integers: dict = {}  # (node, scale bytes) → re-rounded integers
        self.rounding: dict = {"method": options["weight_rounding"]}
        self._float_outputs: list | None = None  # the float model's outputs on the calibration samples
        self.bias: dict = {"applied": False}  # what bias correction did on the last build
        self._bias: dict = {}  # (float set, settings) → {shifts, layers, …, kept}
        self._float_means = bias_correction.FloatMeans(model, samples, threads)
        self._last: tuple | None = None  # (((float set, settings), simplified), model) of the last build
        self._simplify_verified = False  # the exact Q/DQ rules were checked against ORT on a build of this model
        self.simplified: dict = {}  # exact Q/DQ rewrites on the last build (qdq/remove_redundant.py), by kind
        self.budget = None  # the fallback's Budget (quantize/budget.py): bias correction stops between waves
        self.unquantizable: dict[str, str] = {}  # node ORT's quantizer fails on → its message; kept float
        self._said = _OncePerMessage(fitted_biases=options["format"] == "qdq")  # ORT repeats its warnings per build
        # with `many_builds` (the fallback), what every build would compute again is kept: the shape-inferred model
        # (one more copy of the weights) and each weight's quantization; a single build keeps nothing
        self._reuse = many_builds
        self._inferred: onnx.ModelProto | None = None  # the model with ORT's shape inference, copied per build
        self._weight_memo: dict = {}  # weight slices ORT's quantizer quantized already (third_party)

    @property
    def dynamic(self) -> bool:
        return self.options["activations"] == "dynamic"

    @property
    def op_types(self) -> list[str]:
        """The op types ORT quantizes here (configured, or by default every one it can; a build leaves its
        settings' float_op_types out)."""
        if self.options["op_types"]:
            return list(self.options["op_types"])
        if self.dynamic:  # ConvInteger is slower than float Conv on x86; Gather/Attention are not worth it
            return ["MatMul", "Gemm"]
        return sorted(set(ORT.QDQRegistry) | set(ORT.QLinearOpsRegistry))

    def calibrated(self, method: str) -> bool:
        """Whether ranges by `method` are known (a build with them is then seconds, not a calibration)."""
        return self.dynamic or method in self._ranges

    def calibrate(self, method: str):
        """Activation ranges from the calibration samples (computed once per method; none when dynamic)."""
        if self.dynamic:
            return None
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

    def _ort_ranges(self, method: str):
        """ONNX Runtime's calibrator (run once per method) on the model as it is. The tensors that hold ±inf,
        NaN or values beyond float16 (nonfinite.py) stay float: they are kept out of what it collects and their
        ranges dropped.

        Not a copy with the extreme constants clipped, as before session 33: an extreme constant is not always
        a mask's fill. oww_melspectrogram clamps its power spectrum with Clip(x, 1e-10, +inf) before a Log;
        clipped to 65504, that ceiling capped the calibrated log range at ln 65504 = 11.09 where the model
        reaches 24, every quantized value saturated there and each output came out 20–30 dB low (cosine still
        0.9905, SQNR 8.7 dB)."""
        if method in self._ranges:
            return self._ranges[method]
        extra = self.options["extra_options"]
        calibrator_options = {key: extra[name] for name, key in _CALIBRATOR_OPTIONS.items() if name in extra}
        inputs = [spec.name for spec in graph_inputs(self.model)]
        with tempfile.TemporaryDirectory(dir=self.work_dir, prefix="ort-calibrate-") as tmp:
            source = Path(tmp) / "float.onnx"
            save_model(self.model, source)
            calibrator = ORT.create_calibrator(
                source, self.op_types, augmented_model_path=str(Path(tmp) / "augmented.onnx"),
                calibrate_method=getattr(ORT.CalibrationMethod, _METHODS[method]), extra_options=calibrator_options,
                use_external_data_format=is_large(self.model))  # the augmented model outgrows 2 GB with it
            if calibrate_all_but(calibrator, set(self.extremes.tensors)):
                with warnings.catch_warnings():  # minmax over ±inf and NaN tensors ("All-NaN axis"): dropped below
                    warnings.simplefilter("ignore", RuntimeWarning)
                    calibrator.collect_data(_Reader(self.samples, inputs))
                    ranges = calibrator.compute_data()
                kept = {name: ranges[name] for name in ranges if name not in self.extremes.tensors}
            else:  # every tensor it would calibrate holds extreme values: they stay float
                kept = {}
            self._ranges[method] = ORT.TensorsData(getattr(ORT.CalibrationMethod, _METHODS[method]), kept)
            del calibrator
        return self._ranges[method]

    def build(self, excluded: set[str], settings: OrtSettings | None = None, simplify: bool = True) -> onnx.ModelProto:
        """The quantized model with `excluded` nodes (and their edges) left float, built with `settings` (the
        configured ones by default). The fallback asks for the same build several times in a row (ranking base,
        candidates, search base): the last build is kept. `simplify=False` leaves out the exact Q/DQ rules
        (remove_redundant): they change no value, only which kernels ORT runs, so the fallback's ranking trials,
        which compare builds made alike, do without them (a third of each build's time)."""
        if settings is None:
            settings = self.settings
        if settings.bias_correction and not self.settings.bias_correction:
            raise ValueError("bias correction was not configured, or the format is not static QDQ")
        key = (self.build_key(excluded, settings), settings)
        if self._last is not None and self._last[0] == (key, simplify):
            return self._last[1]
        try:
            quantized = self._quantize_around_failures(self.calibrate(settings.calibrate_method), key[0], settings)
        except QprepError:
            raise
        except Exception as exc:  # ORT raises bare exceptions with the op/tensor in the text
            raise QprepError(f"ONNX Runtime quantization failed: {str(exc).splitlines()[0][:300]} "
                             "(try format: qdq, per_channel: false, or exclude the node named in the message)") from None
        nonfinite.check_scales(quantized)  # a mask that still reached a Q/DQ would collapse every output
        if self.options["weight_rounding"] == "gptq" and self.options["format"] == "qdq" and not self.dynamic:
            quantized = self._round_weights(quantized)
        elif self.options["weight_rounding"] == "gptq":
            self.rounding.update(kept=False, reason="GPTQ re-rounds DequantizeLinear weights: static QDQ only")
        if settings.bias_correction:
            quantized = self._correct_biases(quantized, key)
        else:
            self.bias = {"applied": False}
        if simplify and self.options["format"] == "qdq" and not self.dynamic:  # exact rules, verified once
            quantized, self.simplified = remove_redundant.simplify(quantized, self.samples[:8], self.threads,
                                                                   verify=not self._simplify_verified)
            self._simplify_verified = True
        self._last = ((key, simplify), quantized)
        return quantized

    def build_key(self, excluded: set[str], settings: OrtSettings) -> frozenset[str]:
        """The part of `excluded` a build with `settings` depends on: the nodes it would quantize. A node of an
        op type it leaves float, or next to a spread tensor, is float whether excluded or not (ORT's quantizer
        reads nodes_to_exclude only for nodes it would quantize), so two float sets that differ only there are
        the same build; the fallback's candidates often name only such nodes (PP-OCRv4 rec: 45 of 96)."""
        types = set(self.op_types) - settings.float_op_types
        spread = self.spread_nodes(settings)
        return frozenset(name for name in excluded & self.node_names
                         if self.op_type_of[name] in types and name not in spread)

    def _quantize_around_failures(self, ranges, excluded: frozenset[str], settings: OrtSettings) -> onnx.ModelProto:
        """ORT's quantizer, with the nodes it fails on kept float. Why: it raises bare errors on constructs it
        does not expect (a Gemm bias of shape [1, N] with per-channel weights: "The truth value of an array with
        more than one element is ambiguous") and the rest of the model quantizes fine without them. The failing
        node is found by bisection over the nodes it would quantize (nodes_to_exclude), recorded in
        `unquantizable` with ORT's message and left out of every later build too."""
        while True:
            skip = sorted(excluded | set(self.unquantizable))
            try:
                return self._runnable(ranges, skip, settings, check=self._last is None)
            except QprepError:
                raise
            except Exception as exc:  # ORT raises bare exceptions
                if len(self.unquantizable) >= MAX_UNQUANTIZABLE:
                    raise
                culprit = self._failing_node(ranges, skip, settings)
                if culprit is None:
                    raise
                reason = f"{type(exc).__name__}: {short_ort_message(str(exc).splitlines()[0]) if str(exc) else ''}"
                self.unquantizable[culprit] = reason
                log.warning("ort: ONNX Runtime's quantizer fails on node %s (%s): kept float", culprit, reason)

    def _failing_node(self, ranges, skip: list[str], settings: OrtSettings) -> str | None:
        """The first node (graph order) whose quantization makes ORT's quantizer fail: with only the first k
        candidates quantized it fails for k >= that node's place, so a bisection over k finds it. None when the
        quantizer fails even with every candidate excluded (not a node's doing)."""
        types = set(self.op_types) - settings.float_op_types
        candidates = [n.name for n in self.model.graph.node if n.op_type in types and n.name not in skip]

        def fails(quantized: int) -> bool:
            try:
                self._runnable(ranges, skip + candidates[quantized:], settings, check=True)
                return False
            except Exception:  # noqa: BLE001 - any failure counts
                return True

        if not candidates or fails(0):
            return None
        low, high = 0, len(candidates)  # fails(low) is False; fails(high) is the failure being contained
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (low, middle) if fails(middle) else (middle, high)
        return candidates[high - 1]

    def _runnable(self, ranges, excluded: list[str], settings: OrtSettings, check: bool) -> onnx.ModelProto:
        """`_quantize`, and with `check` the result run on one calibration sample: ORT's quantizer also writes
        models ONNX Runtime cannot run (uint8 weights on a Gemm with a [1, N] bias: a per-axis DequantizeLinear
        of that bias, "scale must be 1D tensor with size 1"). ORT's own exception is let through, so such a node
        is found and kept float like the quantizer's failures. Checked on the first build only: later ones leave
        out what it found."""
        quantized = self._quantize(ranges, excluded, settings)
        if check and self.samples:  # as written (a fused kernel would skip the node); ORT's error line not printed
            session_outputs(ort_session(quantized, self.threads, log_severity=4), self.samples[:1])
        return quantized

    def _quantize(self, ranges, excluded: list[str], settings: OrtSettings) -> onnx.ModelProto:
        if self._reuse:  # shape inference once, a copy per build (ORT's quantizer changes the model it is given)
            self._inferred = self._inferred or self._shape_inferred()
            model = _copied(self._inferred)
        else:
            model = ORT.save_and_reload_model_with_shape_infer(self.model)
        common = dict(per_channel=self.options["per_channel"], reduce_range=self.options["reduce_range"],
                      weight_qType=getattr(ORT.QuantType, _TYPES[self.options["weight_type"]]),
                      activation_qType=getattr(ORT.QuantType, _TYPES[self.options["activation_type"]]),
                      tensors_range=ranges, nodes_to_quantize=[], nodes_to_exclude=excluded,
                      op_types_to_quantize=[t for t in self.op_types if t not in settings.float_op_types],
                      extra_options=dict(self.options["extra_options"]))
        if self.options["weight_type"] == "uint8":
            common["extra_options"] = uint8_weights.quantizer_options(common["extra_options"])
        sixteen_bit = settings.spread_tensors if self.options["spread_tensors"] == "int16" else frozenset()
        if sixteen_bit:
            common["extra_options"] = _with_16_bit(common["extra_options"], sixteen_bit,
                                                   self.options["activation_type"])
        else:
            common["nodes_to_exclude"] = sorted(set(excluded) | self.spread_nodes(settings))
        if self.dynamic:  # as quantize_dynamic: uint8 activations, only MatMuls with a constant weight
            # ORT writes each Gemm as a MatMul named <gemm>_MatMul before it reads nodes_to_exclude: a float Gemm
            # is excluded under that name too (it was quantized all the same)
            gemms = {f"{n}_MatMul" for n in common["nodes_to_exclude"] if self.op_type_of.get(n) == "Gemm"}
            common["nodes_to_exclude"] = sorted({*common["nodes_to_exclude"], *gemms})
            extra = {"MatMulConstBOnly": True, **common.pop("extra_options")}
            common.update(activation_qType=ORT.QuantType.QUInt8, tensors_range=None, extra_options=extra)
            with shapes_inferred_already() if self._reuse else contextlib.nullcontext():
                quantizer = ORT.ONNXQuantizer(model, mode=ORT.QuantizationMode.IntegerOps, static=False, **common)
        elif self.options["format"] == "qdq":
            quantizer = ORT.QDQQuantizer(model, **common)
        else:
            quantizer = ORT.ONNXQuantizer(model, mode=ORT.QuantizationMode.QLinearOps, static=True, **common)
        root = logging.getLogger()
        root.addFilter(self._said)
        try:
            with (weight_quantization_memo(self._weight_memo) if self._reuse else contextlib.nullcontext(),
                  input_renaming_by_readers()):
                quantizer.quantize_model()
        finally:
            root.removeFilter(self._said)
        quantizer.model.topological_sort()  # what ORT's save_model_to_file does: new Q/DQ nodes are appended
        if sixteen_bit:
            _eight_bit_in_default_domain(quantizer.model.model)
        if self.options["weight_type"] == "uint8":
            uint8_weights.equal_zero_points(quantizer.model.model)
        if not self.dynamic:  # ORT clips a bias its weight scale makes too fine (it fixes that for int8 weights only)
            self.weights["bias_channels_rescaled"] = int32_bias.fit_biases(quantizer.model.model, self.model)
        return compacted(quantizer.model.model)  # without the float weights ORT removed

    def _shape_inferred(self) -> onnx.ModelProto:
        """The model after ORT's shape inference, kept for the fallback's builds; for dynamic builds with the
        Gemms replaced by MatMuls first, as ORT's dynamic quantizer does before inferring shapes again (it is
        then told not to: third_party.shapes_inferred_already)."""
        if not self.dynamic:
            return ORT.save_and_reload_model_with_shape_infer(self.model)
        model = _copied(self.model)
        ORT.ONNXModel(model).replace_gemm_with_matmul()
        return ORT.save_and_reload_model_with_shape_infer(model)

    def spread_nodes(self, settings: OrtSettings) -> set[str]:
        """The nodes left float for `settings.spread_tensors` (option spread_tensors: float): each tensor's
        producer and consumers, so it is neither rounded to int8 nor wrapped in Q/DQ (ONNX Runtime's CPU runs a
        16-bit tensor's neighbours in float anyway, and slower: PP-OCRv3 rec on one thread, 44 tensors 16-bit 33 ms,
        their edges float 11.5 ms, all float 16 ms)."""
        if self.options["spread_tensors"] != "float" or not settings.spread_tensors:
            return set()
        return channel_spread.nodes_around(self.model, settings.spread_tensors)

    def _round_weights(self, quantized: onnx.ModelProto) -> onnx.ModelProto:
        """GPTQ integers; on the first build the result is compared with nearest rounding on the calibration
        samples and kept only if the output error went down (then every later build uses it too)."""
        if self.rounding.get("kept") is False:
            return quantized
        layers = gptq.find_layers(quantized, self.model)
        if self._moments is None:
            self._moments = gptq.input_moments(quantized, layers, self.samples, self.threads)
        rounded, changed = gptq.apply(quantized, layers, self._moments, cache=self._integers)
        if "kept" not in self.rounding:
            nearest_db, rounded_db = self._calibration_sqnr(quantized, rounded)
            kept, why = better(nearest_db, rounded_db, "nearest rounding kept")
            self.rounding.update(layers=changed, **gptq.left_nearest(layers, self._moments),
                                 calibration_sqnr_db={"nearest": nearest_db, "gptq": rounded_db},
                                 kept=kept, **({"reason": why} if not kept else {}))
            log.info("ort: GPTQ weight rounding on %d layers: calibration SQNR %s → %s dB (%s)", changed,
                     db_text(nearest_db), db_text(rounded_db), "kept" if kept else why)
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
        """Bias shifts (bias_correction.py) measured for this float set and these settings: they compensate the
        drift of the layers upstream, which another float set changes, so each build measures its own (~4 s on
        PP-OCRv4 rec, and a check on every calibration sample: the fallback searches without them). Kept only if
        the calibration output error goes down."""
        layers = bias_correction.find_layers(quantized, self.model)
        if key not in self._bias:
            started = time.perf_counter()
            self._note(f"bias correction: {len(layers)} layers in {len(bias_correction.waves(layers))} waves over "
                       f"{len(self.samples)} calibration samples")
            before_db, = self._calibration_sqnr(quantized)
            if self.budget is not None:  # what the correction keeps for its own check (bias_correction.corrections)
                self.budget.record("bias check", time.perf_counter() - started)
            if before_db is None:  # nothing to judge the correction by: not worth its time
                shifts, after_db, chosen, by_waves = {}, None, {}, {}
            else:
                shifts = bias_correction.corrections(quantized, self._float_means, layers, self.samples, self.threads,
                                                     budget=self.budget)
                chosen, after_db, by_waves = self._best_prefix(quantized, layers, shifts)
            kept, why = better(before_db, after_db, "no correction", bias_correction.MIN_GAIN_DB)
            shorter = by_waves and len(chosen) < len(shifts)
            self._bias[key] = {"shifts": chosen if kept else {}, "layers": len(shifts), "kept": kept,
                               **({"of_layers": len(layers)} if len(shifts) < len(layers) else {}),
                               **({"layers_kept": len(chosen)} if kept and shorter else {}),
                               "calibration_sqnr_db": {"before": _rounded(before_db), "after": _rounded(after_db)},
                               **({"sqnr_db_by_waves": by_waves} if len(by_waves) > 1 else {}),
                               **({"reason": why} if not kept else {}),
                               "seconds": round(time.perf_counter() - started, 1)}
            self._note(f"bias correction: calibration SQNR {db_text(before_db)} → {db_text(after_db)} dB, "
                       f"{'kept' if kept else why} ({self._bias[key]['seconds']:.0f} s)")
        result = self._bias[key]
        self.bias = {"applied": result["kept"], **{k: v for k, v in result.items() if k != "shifts"}}
        return bias_correction.apply(quantized, layers, result["shifts"]) if result["shifts"] else quantized


    def _best_prefix(self, quantized: onnx.ModelProto, layers: list, shifts: dict
                     ) -> tuple[dict, float | None, dict[int, float | None]]:
        """The corrections of the first 1, 2, 4, … waves or of all (bias_correction.prefixes) whose calibration
        SQNR is highest → (their shifts, that SQNR, SQNR by wave count). All are measured first; a shorter
        prefix only as far as the budget allows one more check."""
        candidates = bias_correction.prefixes(layers, shifts)
        if not candidates:
            return {}, None, {}
        count, chosen = candidates[-1]
        started = time.perf_counter()
        best_db, = self._calibration_sqnr(bias_correction.apply(quantized, layers, chosen))
        by_waves = {count: _rounded(best_db)}
        for count, subset in candidates[:-1]:
            if self.budget is not None:
                self.budget.record("bias check", time.perf_counter() - started)
                if not self.budget.allows(f"bias correction of the first {count} waves",
                                          self.budget.predict("bias check")):
                    break
            started = time.perf_counter()
            db, = self._calibration_sqnr(bias_correction.apply(quantized, layers, subset))
            by_waves[count] = _rounded(db)
            if db is not None and (best_db is None or db > best_db):
                best_db, chosen = db, subset
        return chosen, best_db, by_waves


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


def _with_16_bit(extra_options: dict, wide: frozenset[str], activation_type: str) -> dict:
    """ORT's extra_options with `wide` activations quantized to 16 bits (TensorQuantOverrides; ORT writes their
    Q/DQ in the com.microsoft domain below opset 21). Overrides the config already gives a tensor are kept."""
    extra = dict(extra_options)
    if not wide:
        return extra
    wide_type = ORT.QuantType.QUInt16 if activation_type == "uint8" else ORT.QuantType.QInt16
    overrides = dict(extra.get("TensorQuantOverrides") or {})
    for name in sorted(wide):
        overrides.setdefault(name, [{"quant_type": wide_type}])
    extra["TensorQuantOverrides"] = overrides
    return extra


def shared_gemm_weights_transposed(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` with each Gemm(transB=1) whose weight another node also reads given one transposed copy of that
    weight (transB=0), shared by those Gemms; the model itself when no weight is shared (exact either way).

    Why: ORT's dynamic quantizer makes each Gemm a MatMul first, transposing its weight initializer in place and
    assuming nothing else reads it ("assume B is not used by any other node", onnx_model.py). A weight two Gemms
    share (ALBERT's shared layers, a tied head, two layers with equal weights that cleanup merged) was then
    transposed twice and the second Gemm computed with the wrong matrix: a ViT's output went to cosine 0.41."""
    links = Links(model)
    shared = [i for i, n in enumerate(model.graph.node) if n.op_type == "Gemm" and len(n.input) > 1
              and n.input[1] in links.initializers and not links.own_constant(n.input[1], n)
              and _attribute(n, "transB", 0) == 1]
    if not shared:
        return model
    model = _copied(model)
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


def _attribute(node: onnx.NodeProto, name: str, default):
    return next((onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)


def _copied(model: onnx.ModelProto) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    return copy


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
    return ORT.TensorsData(ORT.CalibrationMethod.MinMax, {name: (np.array(low, np.float32), np.array(high, np.float32))
                                                  for name, (low, high) in ranges.items()})


def output_sqnr(expected: list[dict], actual: list[dict]) -> float | None:
    """SQNR (dB) of all float outputs together, over the samples; an output whose shape depends on the input
    is compared over its common prefix (evaluate.metrics.aligned). None when no pair could be compared."""
    names = [name for name in expected[0] if np.asarray(expected[0][name]).dtype.kind == "f"] if expected else []
    pairs = [p for name in names
             for p in aligned([e[name] for e in expected], [a[name] for a in actual])[0] if p is not None]
    return sqnr_db([p[0] for p in pairs], [p[1] for p in pairs])


def better(before_db: float | None, after_db: float | None, default: str, margin_db: float = 0.0) -> tuple[bool, str]:
    """Is a change (GPTQ rounding, bias correction) kept: only on evidence that it lowers the output error,
    an SQNR rise over `margin_db`; (kept, why not)."""
    if before_db is None or after_db is None:
        return False, f"not measured (no calibration output could be compared with the float model's): {default}"
    if after_db > before_db + margin_db:
        return True, ""
    return False, f"not better{f' by {margin_db:g} dB' if margin_db else ''}: {default}"


def db_text(value: float | None) -> str:
    return "not measured" if value is None else f"{value:.2f}"


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def weight_range(options: dict) -> tuple[dict, dict]:
    """Resolve `weight_type: auto` and `reduce_range: auto` for this CPU, so that the model evaluated here (and run
    on any CPU) computes what its QDQ graph says → (options, the stage's `weights` record).

    Where this CPU's u8s8 kernels saturate (saturation.py) and activations are static, weights are symmetric
    uint8 (ORT's u8u8 kernels widen to 16 bits: exact, and 8 bits where reduce_range keeps 7). Measured on an AMD
    EPYC (AVX2, no VNNI), held-out samples, default pipeline: EfficientNet-Lite0 full-range int8 0.901 / 72.7%
    (evaluation samples), 7-bit 0.9955 / 94.5%, uint8 0.9983 / 99.2%. Dynamic activations (quantized per
    inference around their own zero point, which keeps the pair sums mostly in range) keep 8-bit int8: MiniLM
    0.977, 7-bit 0.848. Configured types and ranges are taken as they are."""
    weight_type, configured = options["weight_type"], options["reduce_range"]
    if weight_type == "uint8":
        return {**options, "reduce_range": False}, {"type": "uint8", "reduce_range": False,
                                                     "why": "configured; uint8 weights do not saturate"}
    if configured != "auto":
        return {**options, "weight_type": "int8"}, {"type": "int8", "reduce_range": configured, "why": "configured"}
    saturates = u8s8_saturates()
    why = this_cpu()
    if saturates and options["activations"] == "dynamic":
        why += "; dynamic activations keep 8-bit int8 weights (measured: MiniLM cosine 0.977 with them, 0.848 7-bit)"
        saturates = False
    if not saturates or weight_type == "int8":
        if saturates:
            log.info("ort: 7-bit weights (reduce_range): %s", why)
        return ({**options, "weight_type": "int8", "reduce_range": saturates},
                {"type": "int8", "reduce_range": saturates, "why": why})
    log.info("ort: symmetric uint8 weights: %s", why)
    return ({**options, "weight_type": "uint8", "reduce_range": False},
            {"type": "uint8", "reduce_range": False, "why": why + "; uint8 weights run on its exact u8u8 kernels"})
