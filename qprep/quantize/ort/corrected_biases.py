"""Bias correction (quantize/bias_correction.py) on ORT's static QDQ builds, measured per float set and settings.

Why per build: the shifts compensate the drift of the layers upstream, which another float set or other settings
change, so each build measures its own (the fallback searches without them and tries them on few float sets:
ort/search.py). Why judged: the shifts are an estimate from the calibration samples; they are kept only if the
calibration output error goes down by bias_correction.MIN_GAIN_DB (output_check.py), and of their waves only the
prefix that measures best. Measured at all only where its predicted cost is worth its expected gain
(refinements.py); within the fallback, its own time budget decides instead (quantize/budget.py).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import onnx

from qprep.quantize import bias_correction
from qprep.quantize.budget import Budget
from qprep.quantize.ort import refinements
from qprep.quantize.ort.output_check import OutputCheck, better, db_text, rounded

log = logging.getLogger("qprep")


class CorrectedBiases:
    """The corrections of one model's builds, each measured once per build key (float set, settings)."""

    def __init__(self, model: onnx.ModelProto, samples: list[dict], threads: int, check: OutputCheck,
                 note: Callable[[str], None], calibration_seconds: Callable[[], float | None] = lambda: None):
        """`calibration_seconds`: what the calibration took (None: not measured, the rule is not applied)."""
        self.model, self.samples, self.threads, self.check, self.note = model, samples, threads, check, note
        self.calibration_seconds = calibration_seconds
        self._float_means = bias_correction.FloatMeans(model, samples, threads)
        self._measured: dict = {}  # (float set, settings) → {shifts, layers, …, kept}

    def __call__(self, quantized: onnx.ModelProto, key: tuple, budget: Budget | None = None
                 ) -> tuple[onnx.ModelProto, dict]:
        """(`quantized` with the shifts kept for `key`, the record of what bias correction did: the stage's
        `bias_correction`). With the fallback's `budget`, the waves and the checks of shorter prefixes stop
        when the next would not end in time."""
        layers = bias_correction.find_layers(quantized, self.model)
        if key not in self._measured:
            self._measured[key] = self._measure(quantized, layers, budget)
        result = self._measured[key]
        record = {"applied": result["kept"], **{k: v for k, v in result.items() if k != "shifts"}}
        return (bias_correction.apply(quantized, layers, result["shifts"]) if result["shifts"] else quantized), record

    def _measure(self, quantized: onnx.ModelProto, layers: list, budget: Budget | None) -> dict:
        started = time.perf_counter()
        self.note(f"bias correction: {len(layers)} layers in {len(bias_correction.waves(layers))} waves over "
                  f"{len(self.samples)} calibration samples")
        before_db, = self.check.sqnr(quantized)
        if budget is not None:  # what the correction keeps for its own check (bias_correction.corrections)
            budget.record("bias check", time.perf_counter() - started)
        decision = self._decision(quantized, layers) if budget is None and before_db is not None else None
        if decision is not None and not decision["runs"]:
            return {"shifts": {}, "kept": False, "budget": decision, "reason": refinements.skipped_reason(decision),
                    "seconds": round(time.perf_counter() - started, 1)}
        if before_db is None:  # nothing to judge the correction by: not worth its time
            shifts, after_db, chosen, by_waves = {}, None, {}, {}
        else:
            shifts = bias_correction.corrections(quantized, self._float_means, layers, self.samples, self.threads,
                                                 budget=budget)
            chosen, after_db, by_waves = self._best_prefix(quantized, layers, shifts, budget)
        kept, why = better(before_db, after_db, "no correction", bias_correction.MIN_GAIN_DB)
        shorter = by_waves and len(chosen) < len(shifts)
        result = {"shifts": chosen if kept else {}, "layers": len(shifts), "kept": kept,
                  **({"of_layers": len(layers)} if len(shifts) < len(layers) else {}),
                  **({"layers_kept": len(chosen)} if kept and shorter else {}),
                  "calibration_sqnr_db": {"before": rounded(before_db), "after": rounded(after_db)},
                  **({"sqnr_db_by_waves": by_waves} if len(by_waves) > 1 else {}),
                  **({"reason": why} if not kept else {}), **({"budget": decision} if decision else {}),
                  "seconds": round(time.perf_counter() - started, 1)}
        self.note(f"bias correction: calibration SQNR {db_text(before_db)} → {db_text(after_db)} dB, "
                  f"{'kept' if kept else why} ({result['seconds']:.0f} s)")
        return result

    def _decision(self, quantized: onnx.ModelProto, layers: list) -> dict | None:
        """Is the correction worth its predicted time on this build (refinements.py)? None when the calibration
        was not timed."""
        calibration_s = self.calibration_seconds()
        if calibration_s is None or not layers:
            return None
        predicted = refinements.bias_seconds(layers, self.check.float_seconds or 0.0,
                                             self.check.check_seconds or 0.0)
        gain = refinements.expected_gain_db(self.check.bias_share(quantized), refinements.BIAS_SHARE)
        return refinements.decide("bias correction", predicted, gain, calibration_s)

    def _best_prefix(self, quantized: onnx.ModelProto, layers: list, shifts: dict, budget: Budget | None
                     ) -> tuple[dict, float | None, dict[int, float | None]]:
        """The corrections of the first 1, 2, 4, … waves or of all (bias_correction.prefixes) whose calibration
        SQNR is highest → (their shifts, that SQNR, SQNR by wave count). All are measured first; a shorter
        prefix only as far as the budget allows one more check."""
        candidates = bias_correction.prefixes(layers, shifts)
        if not candidates:
            return {}, None, {}
        count, chosen = candidates[-1]
        started = time.perf_counter()
        best_db, = self.check.sqnr(bias_correction.apply(quantized, layers, chosen))
        by_waves = {count: rounded(best_db)}
        for count, subset in candidates[:-1]:
            if budget is not None:
                budget.record("bias check", time.perf_counter() - started)
                if not budget.allows(f"bias correction of the first {count} waves", budget.predict("bias check")):
                    break
            started = time.perf_counter()
            db, = self.check.sqnr(bias_correction.apply(quantized, layers, subset))
            by_waves[count] = rounded(db)
            if db is not None and (best_db is None or db > best_db):
                best_db, chosen = db, subset
        return chosen, best_db, by_waves
