"""Whether a change to a build's integers is kept: the model's output SQNR against the float model on the
calibration samples, before and after. GPTQ's rounding (weight_rounding.py) and bias correction
(corrected_biases.py) both estimate what should help; only a measured rise at the outputs keeps them.
"""

from __future__ import annotations

import time

import numpy as np
import onnx

from qprep.measure.metrics import aligned, sqnr_db
from qprep.model.io import content_key
from qprep.model.runtime import run_model


class OutputCheck:
    """Output SQNR (dB) of quantized models against `model` on `samples`; the float outputs are computed once,
    for every check of every build, and a model's SQNR once per content: the build GPTQ's check measured (either
    rounding) is the one bias correction measures first, one run of the model over the samples saved. Each
    check also keeps the share of its error that is an offset per channel (`bias_share`) and how long the runs
    took (`float_seconds`, `check_seconds`): what refinements.py estimates a refinement's gain and cost from."""

    def __init__(self, model: onnx.ModelProto, samples: list[dict], threads: int):
        self.model, self.samples, self.threads = model, samples, threads
        self._float_outputs: list | None = None  # the float model's outputs on the calibration samples
        self._measured: dict[bytes, tuple[float | None, float]] = {}  # model content digest → (SQNR, bias share)
        self.float_seconds: float | None = None  # the float model's run over the samples
        self.check_seconds: float | None = None  # the first checked model's (a build's) run over the samples

    def float_outputs(self) -> list[dict]:
        if self._float_outputs is None:
            started = time.perf_counter()
            self._float_outputs = run_model(self.model, self.samples, self.threads, optimize=True)
            self.float_seconds = time.perf_counter() - started
        return self._float_outputs

    def sqnr(self, *models: onnx.ModelProto) -> list[float | None]:
        return [self._figures(model)[0] for model in models]

    def bias_share(self, model: onnx.ModelProto) -> float:
        """Of `model`'s output error on the samples, the share that is a constant offset per channel."""
        return self._figures(model)[1]

    def outputs_of(self, model: onnx.ModelProto) -> list[dict]:
        """`model`'s outputs on the samples (the first run timed: `check_seconds`)."""
        started = time.perf_counter()
        outputs = run_model(model, self.samples, self.threads, optimize=True)
        if self.check_seconds is None:
            self.check_seconds = time.perf_counter() - started
        return outputs

    def _figures(self, model: onnx.ModelProto) -> tuple[float | None, float]:
        expected = self.float_outputs()
        key = content_key(model)
        if key is not None and key in self._measured:
            return self._measured[key]
        actual = self.outputs_of(model)
        figures = (output_sqnr(expected, actual), bias_share(expected, actual))
        if key is not None:
            self._measured[key] = figures
        return figures


def output_sqnr(expected: list[dict], actual: list[dict]) -> float | None:
    """SQNR (dB) of all float outputs together, over the samples; an output whose shape depends on the input
    is compared over its common prefix (measure.metrics.aligned). None when no pair could be compared."""
    names = [name for name in expected[0] if np.asarray(expected[0][name]).dtype.kind == "f"] if expected else []
    pairs = [p for name in names
             for p in aligned([e[name] for e in expected], [a[name] for a in actual])[0] if p is not None]
    return sqnr_db([p[0] for p in pairs], [p[1] for p in pairs])


def bias_share(expected: list[dict], actual: list[dict]) -> float:
    """Of the float outputs' error power over the samples, the share that is a constant offset per channel: per
    output, the channel axis (of all axes) whose mean error per channel over the samples and the other axes
    holds the most power. Outputs whose shape varies between samples are left out. 0 without error."""
    names = [name for name in expected[0] if np.asarray(expected[0][name]).dtype.kind == "f"] if expected else []
    total = offset = 0.0
    for name in names:
        shape = np.shape(expected[0][name])
        pairs = [(e[name], a[name]) for e, a in zip(expected, actual)]
        if any(np.shape(e) != shape or np.shape(a) != shape for e, a in pairs) or not shape:
            continue
        sums = [np.zeros(size) for size in shape]
        power = 0.0
        for e, a in pairs:
            error = np.asarray(a, np.float64) - np.asarray(e, np.float64)
            error = np.where(np.isfinite(error), error, 0.0)
            power += float(np.square(error).sum())
            for axis in range(len(shape)):
                sums[axis] += error.sum(axis=tuple(i for i in range(len(shape)) if i != axis))
        count = len(pairs) * int(np.prod(shape))
        per_channel = [count / size for size in shape]  # values averaged into each channel's mean
        total += power
        offset += max(float(np.square(s / n).sum() * n) for s, n in zip(sums, per_channel))
    return offset / total if total > 0 else 0.0


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


def rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 2)
