"""Activation ranges from the calibration samples, computed once per method and reused by every build.

Why once: calibration runs the float model over every sample, a build with known ranges is seconds; the
fallback builds again and again with the same ranges (and tries "mse" ranges once). The methods are ONNX
Runtime's calibrators, and qprep's "mse" (quantize/ranges.py), refined from the min/max ranges with one more run
of the float model.
"""

from __future__ import annotations

import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import onnx

from qprep.model.info import graph_inputs
from qprep.model.io import is_large, save_model
from qprep.quantize import nonfinite
from qprep.quantize import ranges as activation_ranges
from qprep.third_party import calibrate_all_but, ort_quantization

ORT = ort_quantization()

METHODS = {"minmax": "MinMax", "entropy": "Entropy", "percentile": "Percentile", "distribution": "Distribution"}
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


class Calibration:
    """The ranges of `model`'s activations by method (ORT's TensorsData), each computed on first use. The
    tensors in `extremes` (±inf, NaN or values beyond float16: nonfinite.py) stay float: never calibrated."""

    def __init__(self, model: onnx.ModelProto, samples: list[dict], extra_options: dict, op_types: list[str],
                 extremes: nonfinite.Extremes, work_dir: Path, threads: int):
        self.model, self.samples, self.extra_options, self.op_types = model, samples, extra_options, op_types
        self.extremes, self.work_dir, self.threads = extremes, work_dir, threads
        self._ranges: dict = {}  # range method → ORT TensorsData
        # the first calibration's run over the samples: what ORT's quantize_static spends beside its build, the
        # unit a refinement's cost is weighed in (refinements.py)
        self.seconds: float | None = None

    def known(self, method: str) -> bool:
        return method in self._ranges

    def ranges(self, method: str):
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
        """ONNX Runtime's calibrator (run once per method) on the model as it is. The extreme tensors are kept
        out of what it collects and their ranges dropped.

        Not a copy with the extreme constants clipped: an extreme constant is not always a mask's fill. A model
        that clamps its power spectrum with Clip(x, 1e-10, +inf) before a Log (oww_melspectrogram) would see its
        calibrated log range capped at ln 65504 where the model reaches beyond it, and every value above saturated
        there (BENCHMARKS.md: "ORT calibration ran a different model")."""
        if method in self._ranges:
            return self._ranges[method]
        started = time.perf_counter()
        extra = self.extra_options
        calibrator_options = {key: extra[name] for name, key in _CALIBRATOR_OPTIONS.items() if name in extra}
        inputs = [spec.name for spec in graph_inputs(self.model)]
        with tempfile.TemporaryDirectory(dir=self.work_dir, prefix="ort-calibrate-") as tmp:
            source = Path(tmp) / "float.onnx"
            save_model(self.model, source)
            calibrator = ORT.create_calibrator(
                source, self.op_types, augmented_model_path=str(Path(tmp) / "augmented.onnx"),
                calibrate_method=getattr(ORT.CalibrationMethod, METHODS[method]), extra_options=calibrator_options,
                use_external_data_format=is_large(self.model))  # the augmented model outgrows 2 GB with it
            if calibrate_all_but(calibrator, set(self.extremes.tensors)):
                with warnings.catch_warnings():  # minmax over ±inf and NaN tensors ("All-NaN axis"): dropped below
                    warnings.simplefilter("ignore", RuntimeWarning)
                    calibrator.collect_data(_Reader(self.samples, inputs))
                    ranges = calibrator.compute_data()
                kept = {name: ranges[name] for name in ranges if name not in self.extremes.tensors}
            else:  # every tensor it would calibrate holds extreme values: they stay float
                kept = {}
            self._ranges[method] = ORT.TensorsData(getattr(ORT.CalibrationMethod, METHODS[method]), kept)
            del calibrator
        if self.seconds is None:
            self.seconds = time.perf_counter() - started
        return self._ranges[method]


def _tensors_data(ranges: dict[str, tuple[float, float]]):
    return ORT.TensorsData(ORT.CalibrationMethod.MinMax, {name: (np.array(low, np.float32), np.array(high, np.float32))
                                                  for name, (low, high) in ranges.items()})
