"""GPTQ's weight integers (quantize/gptq.py) on the DequantizeLinear weights ORT's quantizer wrote, for every
build of one model.

Why here and cached: the input moments come from one run of a build over the calibration samples, and a layer's
re-rounded integers depend only on its weights and scales, so later builds (another float set, other settings)
reuse both. Kept only if the first build's output error goes down (output_check.py); then every build uses it.
Run at all only where its predicted cost is worth its expected gain (refinements.py).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import onnx

from qprep.quantize import gptq
from qprep.quantize.ort import refinements
from qprep.quantize.ort.output_check import OutputCheck, better, db_text

log = logging.getLogger("qprep")


class WeightRounding:
    """`record` says what the rounding did (the stage's `weight_rounding`): the method, and after the first
    build the layers changed, the calibration SQNR either way and whether it was kept."""

    def __init__(self, model: onnx.ModelProto, samples: list[dict], threads: int, check: OutputCheck, method: str,
                 calibration_seconds: Callable[[], float | None] = lambda: None):
        """`calibration_seconds`: what the calibration took (None: not measured, the rule is not applied)."""
        self.model, self.samples, self.threads, self.check = model, samples, threads, check
        self.calibration_seconds = calibration_seconds
        self.record: dict = {"method": method}
        self._moments: dict | None = None
        self._integers: dict = {}  # (node, scale bytes) → re-rounded integers

    def __call__(self, quantized: onnx.ModelProto, static_qdq: bool) -> onnx.ModelProto:
        """`quantized` with GPTQ integers (static QDQ builds only: it re-rounds DequantizeLinear weights)."""
        if self.record["method"] != "gptq":
            return quantized
        if not static_qdq:
            self.record.update(kept=False, reason="GPTQ re-rounds DequantizeLinear weights: static QDQ only")
            return quantized
        if self.record.get("kept") is False:
            return quantized
        layers = gptq.find_layers(quantized, self.model)
        if self._moments is None and "budget" not in self.record:
            decision = self._decision(quantized, layers)
            if decision is not None:
                self.record["budget"] = decision
                if not decision["runs"]:
                    self.record.update(kept=False, reason=refinements.skipped_reason(decision))
                    return quantized
        started = time.perf_counter()
        if self._moments is None:
            self._moments = gptq.input_moments(quantized, layers, self.samples, self.threads)
        rounded, changed = gptq.apply(quantized, layers, self._moments, cache=self._integers)
        if "kept" not in self.record:
            nearest_db, rounded_db = self.check.sqnr(quantized, rounded)
            kept, why = better(nearest_db, rounded_db, "nearest rounding kept")
            self.record.update(layers=changed, **gptq.left_nearest(layers, self._moments),
                               calibration_sqnr_db={"nearest": nearest_db, "gptq": rounded_db},
                               kept=kept, **({"reason": why} if not kept else {}),
                               seconds=round(time.perf_counter() - started, 1))
            log.info("ort: GPTQ weight rounding on %d layers: calibration SQNR %s → %s dB (%s)", changed,
                     db_text(nearest_db), db_text(rounded_db), "kept" if kept else why)
        return rounded if self.record["kept"] else quantized

    def _decision(self, quantized: onnx.ModelProto, layers: list[gptq.Layer]) -> dict | None:
        """Is GPTQ worth its predicted time on this build (refinements.py)? None when the calibration was not
        timed. The weights-only run that estimates the gain is made only when the cost exceeds what the rule
        allows anyway."""
        calibration_s = self.calibration_seconds()
        if calibration_s is None or not layers:
            return None
        nearest_db, = self.check.sqnr(quantized)  # the check GPTQ makes anyway (cached)
        per_sample = refinements.moments_seconds(quantized, layers, self.samples, self.threads)
        predicted = refinements.gptq_seconds(layers, len(self.samples), per_sample, self.check.float_seconds or 0.0,
                                             self.check.check_seconds or 0.0, refinements.moments_rate(self.threads))
        gain = 0.0
        if predicted > refinements.allowed_seconds(calibration_s, 0.0):
            weights_db = refinements.weights_only_sqnr(quantized, self.model, layers, self.samples,
                                                       self.check.float_outputs(), self.threads)
            gain = refinements.expected_gain_db(refinements.noise_share(nearest_db, weights_db),
                                                refinements.GPTQ_SHARE)
        return refinements.decide("GPTQ weight rounding", predicted, gain, calibration_s)
