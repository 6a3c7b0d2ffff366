"""The ONNX Runtime adapter: calibrate once, then build per float set and settings.

A build is ONNX Runtime's own static (or dynamic) quantizer (raw_build.py), with the nodes it fails on kept
float (failures.py), then qprep's GPTQ weight rounding (weight_rounding.py), bias correction
(corrected_biases.py) and exact Q/DQ simplification (qdq/remove_redundant.py) on what ORT produced, all on the
model as ORT's quantizer needs it (prepare.py, weight_type.py). Calibration (calibration.py) runs once per model:
`OrtQuantizer.build(float_set, settings)` re-quantizes with another float set or other settings in a fraction
of the first build's time, which is what the accuracy-driven fallback (search.py) needs. Everything the builds
may vary is one immutable `OrtSettings` (settings.py), which is also the cache key: the quantizer is never
reconfigured from outside. `OrtQuantizer` owns these parts and the order they run in.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import onnx

from qprep.errors import QprepError
from qprep.graph.names import require_unique
from qprep.qdq import remove_redundant
from qprep.quantize import channel_spread, nonfinite
from qprep.quantize.budget import Budget
from qprep.quantize.ort.calibration import Calibration
from qprep.quantize.ort.corrected_biases import CorrectedBiases
from qprep.quantize.ort.failures import Unquantizable, whole_model
from qprep.quantize.ort.output_check import OutputCheck
from qprep.quantize.ort.prepare import at_min_opset, for_ort, ort_names_apart
from qprep.quantize.ort.raw_build import RawBuild
from qprep.quantize.ort.settings import OrtSettings
from qprep.quantize.ort.weight_rounding import WeightRounding
from qprep.quantize.ort.weight_type import weight_range
from qprep.third_party import ort_quantization

ORT = ort_quantization()
log = logging.getLogger("qprep")


class OrtQuantizer:
    """Calibrate once, quantize as often as needed: activation ranges, the GPTQ input moments and the
    re-rounded integers of every layer are computed on the first build and reused by later builds.
    After a build, `rounding`, `bias` and `simplified` say what it did (for the stage's record)."""

    def __init__(self, model: onnx.ModelProto, samples: list[dict], options: dict, work_dir: Path, threads: int = 2,
                 progress=None, extremes: nonfinite.Extremes | None = None, many_builds: bool = False):
        """With `many_builds` (the fallback), what every build would compute again is kept (raw_build.py); a
        single build keeps nothing."""
        # tensors kept float for their values (never calibrated), with those an opset upgrade adds
        model, self.upgraded_from, self.extremes = at_min_opset(model, extremes or nonfinite.Extremes())
        if self.upgraded_from is not None:
            require_unique(model, "onnx's opset conversion for ORT's quantizer")
        self.options, self.weights = weight_range(options)  # weight_type and reduce_range "auto" resolved here
        model = for_ort(model, threads, self.dynamic)
        model, self.renamed = ort_names_apart(model)  # {old: new} for the stage's record
        if self.renamed:
            require_unique(model, "qprep's renaming of values apart from ORT's names")
            self.extremes = dataclasses.replace(self.extremes, tensors={
                self.renamed.get(name, name): stats for name, stats in self.extremes.tensors.items()})
        self.model, self.samples, self.work_dir, self.threads = model, samples, work_dir, threads
        self.progress = progress
        self.op_type_of = {n.name: n.op_type for n in model.graph.node}
        self.node_names = frozenset(self.op_type_of)
        self.settings = OrtSettings(  # as configured: what builds use unless the fallback measured better
            calibrate_method=options.calibrate_method,
            bias_correction=bool(options.bias_correction) and options.format == "qdq" and not self.dynamic)
        self.calibration = Calibration(model, samples, self.options.extra_options, self.op_types, self.extremes,
                                       work_dir, threads)
        check = OutputCheck(model, samples, threads)  # GPTQ and bias correction share the float outputs
        # GPTQ and bias correction run where their predicted cost is worth their expected gain, weighed in
        # calibrations (refinements.py)
        timed = lambda: self.calibration.seconds  # noqa: E731
        self.weight_rounding = WeightRounding(model, samples, threads, check, options.weight_rounding, timed)
        self.corrected_biases = CorrectedBiases(model, samples, threads, check, self._note, timed)
        self.bias: dict = {"applied": False}  # what bias correction did on the last build
        raw = RawBuild(model, self.options, self.op_types, self.spread_nodes, self.weights, reuse=many_builds)
        self.failures = Unquantizable(model, samples, threads, raw, self.quantized_types)
        self._last: tuple | None = None  # (((float set, settings), simplified), model) of the last build
        self._simplify_verified = False  # the exact Q/DQ rules were checked against ORT on a build of this model
        self.simplified: dict = {}  # exact Q/DQ rewrites on the last build (qdq/remove_redundant.py), by kind

    @property
    def dynamic(self) -> bool:
        return self.options.activations == "dynamic"

    @property
    def op_types(self) -> list[str]:
        """The op types ORT quantizes here (configured, or by default every one it can; a build leaves its
        settings' float_op_types out)."""
        if self.options.op_types:
            return list(self.options.op_types)
        if self.dynamic:  # ConvInteger is slower than float Conv on x86; Gather/Attention are not worth it
            return ["MatMul", "Gemm"]
        return sorted(set(ORT.QDQRegistry) | set(ORT.QLinearOpsRegistry))

    def quantized_types(self, settings: OrtSettings) -> set[str]:
        """The op types a build with `settings` quantizes."""
        return set(self.op_types) - settings.float_op_types

    @property
    def rounding(self) -> dict:
        """What GPTQ weight rounding did (weight_rounding.py)."""
        return self.weight_rounding.record

    @property
    def unquantizable(self) -> dict[str, str]:
        """Node ORT's quantizer fails on → its message; kept float (failures.py)."""
        return self.failures.found

    def calibrated(self, method: str) -> bool:
        """Whether ranges by `method` are known (a build with them is then seconds, not a calibration)."""
        return self.dynamic or self.calibration.known(method)

    def calibrate(self, method: str):
        """Activation ranges from the calibration samples (computed once per method; none when dynamic)."""
        return None if self.dynamic else self.calibration.ranges(method)

    def build(self, excluded: set[str], settings: OrtSettings | None = None, simplify: bool = True,
              budget: Budget | None = None) -> onnx.ModelProto:
        """The quantized model with `excluded` nodes (and their edges) left float, built with `settings` (the
        configured ones by default). The fallback asks for the same build several times in a row (ranking base,
        candidates, search base): the last build is kept. `simplify=False` leaves out the exact Q/DQ rules
        (remove_redundant): they change no value, only which kernels ORT runs, so the fallback's ranking trials,
        which compare builds made alike, do without them (a third of each build's time). `budget`, the
        fallback's (quantize/budget.py): bias correction stops between its waves and checks in time."""
        if settings is None:
            settings = self.settings
        if settings.bias_correction and not self.settings.bias_correction:
            raise ValueError("bias correction was not configured, or the format is not static QDQ")
        key = (self.build_key(excluded, settings), settings)
        if self._last is not None and self._last[0] == (key, simplify):
            return self._last[1]
        try:
            quantized = self.failures.around(self.calibrate(settings.calibrate_method), key[0], settings,
                                             check=self._last is None)
        except QprepError:
            raise
        except Exception as exc:  # ORT raises bare exceptions with the op/tensor in the text
            failure = whole_model(exc)  # the model, not a node: qprep's bug (exit 3), not the user's
            if failure is not None:
                raise failure from exc
            raise QprepError(f"ONNX Runtime quantization failed: {str(exc).splitlines()[0][:300]} "
                             "(try format: qdq, per_channel: false, or exclude the node named in the message)") from None
        nonfinite.check_scales(quantized)  # a mask that still reached a Q/DQ would collapse every output
        static_qdq = self.options.format == "qdq" and not self.dynamic
        quantized = self.weight_rounding(quantized, static_qdq)
        require_unique(quantized, "GPTQ weight rounding (quantize/ort/weight_rounding.py)")
        if settings.bias_correction:
            quantized, self.bias = self.corrected_biases(quantized, key, budget)
            require_unique(quantized, "bias correction (quantize/ort/corrected_biases.py)")
        else:
            self.bias = {"applied": False}
        if simplify and static_qdq:  # exact rules, verified once
            quantized, self.simplified = remove_redundant.simplify(quantized, self.samples[:8], self.threads,
                                                                   verify=not self._simplify_verified)
            self._simplify_verified = True
            require_unique(quantized, "the exact Q/DQ rules (qdq/remove_redundant.py)")
        self._last = ((key, simplify), quantized)
        return quantized

    def build_key(self, excluded: set[str], settings: OrtSettings) -> frozenset[str]:
        """The part of `excluded` a build with `settings` depends on: the nodes it would quantize. A node of an
        op type it leaves float, or next to a spread tensor, is float whether excluded or not (ORT's quantizer
        reads nodes_to_exclude only for nodes it would quantize), so two float sets that differ only there are
        the same build; the fallback's candidates often name only such nodes."""
        types = self.quantized_types(settings)
        spread = self.spread_nodes(settings)
        return frozenset(name for name in excluded & self.node_names
                         if self.op_type_of[name] in types and name not in spread)

    def spread_nodes(self, settings: OrtSettings) -> set[str]:
        """The nodes left float for `settings.spread_tensors` (option spread_tensors: float): each tensor's
        producer and consumers, so it is neither rounded to int8 nor wrapped in Q/DQ (ONNX Runtime's CPU runs a
        16-bit tensor's neighbours in float anyway, and slower than these edges in float: BENCHMARKS.md: "channel
        spread")."""
        if self.options.spread_tensors != "float" or not settings.spread_tensors:
            return set()
        return channel_spread.nodes_around(self.model, settings.spread_tensors)

    def _note(self, message: str) -> None:
        log.info("ort: %s", message)
        if self.progress is not None:
            self.progress.note(message)
