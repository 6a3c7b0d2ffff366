"""GPTQ's weight integers (quantize/gptq.py) on the DequantizeLinear weights ORT's quantizer wrote, for every
build of one model.

Why here and cached: the input moments come from one run of a build over the calibration samples, and a layer's
re-rounded integers depend only on its weights and scales, so later builds (another float set, other settings)
reuse both. Kept only if the first build's output error goes down (output_check.py); then every build uses it.
"""

from __future__ import annotations

import logging

import onnx

from qprep.quantize import gptq
from qprep.quantize.ort.output_check import OutputCheck, better, db_text

log = logging.getLogger("qprep")


class WeightRounding:
    """`record` says what the rounding did (the stage's `weight_rounding`): the method, and after the first
    build the layers changed, the calibration SQNR either way and whether it was kept."""

    def __init__(self, model: onnx.ModelProto, samples: list[dict], threads: int, check: OutputCheck, method: str):
        self.model, self.samples, self.threads, self.check = model, samples, threads, check
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
        if self._moments is None:
            self._moments = gptq.input_moments(quantized, layers, self.samples, self.threads)
        rounded, changed = gptq.apply(quantized, layers, self._moments, cache=self._integers)
        if "kept" not in self.record:
            nearest_db, rounded_db = self.check.sqnr(quantized, rounded)
            kept, why = better(nearest_db, rounded_db, "nearest rounding kept")
            self.record.update(layers=changed, **gptq.left_nearest(layers, self._moments),
                               calibration_sqnr_db={"nearest": nearest_db, "gptq": rounded_db},
                               kept=kept, **({"reason": why} if not kept else {}))
            log.info("ort: GPTQ weight rounding on %d layers: calibration SQNR %s → %s dB (%s)", changed,
                     db_text(nearest_db), db_text(rounded_db), "kept" if kept else why)
        return rounded if self.record["kept"] else quantized
