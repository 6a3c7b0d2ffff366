"""Whether a change to a build's integers is kept: the model's output SQNR against the float model on the
calibration samples, before and after. GPTQ's rounding (weight_rounding.py) and bias correction
(corrected_biases.py) both estimate what should help; only a measured rise at the outputs keeps them.
"""

from __future__ import annotations


import numpy as np
import onnx

from qprep.measure.metrics import aligned, sqnr_db
from qprep.model.io import content_key
from qprep.model.runtime import run_model


class OutputCheck:
    """Output SQNR (dB) of quantized models against `model` on `samples`; the float outputs are computed once,
    for every check of every build, and a model's SQNR once per content: the build GPTQ's check measured (either
    rounding) is the one bias correction measures first, one run of the model over the samples saved."""

    def __init__(self, model: onnx.ModelProto, samples: list[dict], threads: int):
        self.model, self.samples, self.threads = model, samples, threads
        self._float_outputs: list | None = None  # the float model's outputs on the calibration samples
        self._measured: dict[bytes, float | None] = {}  # model content digest → its SQNR

    def sqnr(self, *models: onnx.ModelProto) -> list[float | None]:
        if self._float_outputs is None:
            self._float_outputs = run_model(self.model, self.samples, self.threads, optimize=True)
        figures = []
        for model in models:
            key = content_key(model)
            if key is None or key not in self._measured:
                figure = output_sqnr(self._float_outputs, run_model(model, self.samples, self.threads, optimize=True))
                if key is None:
                    figures.append(figure)
                    continue
                self._measured[key] = figure
            figures.append(self._measured[key])
        return figures


def output_sqnr(expected: list[dict], actual: list[dict]) -> float | None:
    """SQNR (dB) of all float outputs together, over the samples; an output whose shape depends on the input
    is compared over its common prefix (measure.metrics.aligned). None when no pair could be compared."""
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


def rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 2)
