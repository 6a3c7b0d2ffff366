"""Activation ranges that minimise each tensor's int8 error (rounding inside the range, clipping outside) on
the calibration data, instead of its min/max.

Why: a min/max range is set by the few largest values of the calibration set, so every other value is
rounded on a coarser grid than it needs; shrinking the range trades a little clipping for finer rounding. The
best trade is found per tensor from a histogram of its calibration values (one run of the float model), by
trying shrunk low/high ends and scoring each by the expected squared error. With 8-bit grids clipping pays
only for rare outliers, so gains are small (BENCHMARKS.md: "Least-squared-error activation ranges").
A smaller per-tensor error does not always mean better outputs, so the fallback measures the choice at the
model's outputs before keeping it (quantize/ort/search.py).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import onnx

from qprep.model.runtime import intermediate_values

BINS = 2048  # histogram bins over [min, max]: 8× finer than the 255 int8 steps, so bin error is negligible
SHRINK = np.linspace(0.25, 1.0, 16)  # tried fractions of each end of the min/max range


def mse_ranges(model: onnx.ModelProto, ranges: dict[str, tuple[float, float]], samples: list[dict],
               threads: int = 2, levels: int = 256) -> dict[str, tuple[float, float]]:
    """{tensor: (low, high)} minimising the expected squared quantization error of each tensor in `ranges`
    (its min/max ranges), on a `levels`-step asymmetric grid that contains zero (as ONNX Runtime builds it).
    Tensors the model does not compute or that are not float keep their range."""
    histograms = {name: np.zeros(BINS) for name, (low, high) in ranges.items()
                  if high > low and np.isfinite(low) and np.isfinite(high)}  # ±inf: a float tensor, no grid
    with ThreadPoolExecutor(max(1, threads)) as pool:  # numpy's loops release the GIL: 1.7x on 2 cores
        for values in intermediate_values(model, list(histograms), samples, threads):
            floats = [name for name, value in values.items() if value.dtype.kind == "f"]
            for name, counts in zip(floats, pool.map(lambda n: histogram(values[n], *ranges[n]), floats)):
                histograms[name] += counts
    chosen = dict(ranges)
    for name, counts in histograms.items():
        if counts.sum():
            chosen[name] = best_range(counts, *ranges[name], levels)
    return chosen


def histogram(value: np.ndarray, low: float, high: float) -> np.ndarray:
    """np.histogram(value, BINS, (low, high))'s counts: values outside the range (a moving-average calibrator's
    ranges leave some out) and NaN not counted. Not np.histogram itself: its exact-edge corrections made it about
    twice as slow, a large part of a big model's mse ranges; here a value within float32 rounding of an edge may
    fall in the next bin, 1/8 of an int8 step from where it belongs. Computed in float32 (a float16 tensor too).
    Offered on its own because it stands in for np.histogram: its counts are checked against numpy's."""
    values = value.ravel().astype(np.float32, copy=False)
    scale = np.float32(BINS / (high - low)) if high > low else np.float32(np.inf)
    if not np.isfinite(scale):  # a range narrower than float32 can scale
        return np.histogram(values, bins=BINS, range=(low, high))[0]
    if not (values.min() >= low and values.max() <= high):  # some outside, or NaN: left out (2 fast passes else)
        values = values[(values >= low) & (values <= high)]
    bins = ((values - np.float32(low)) * scale).astype(np.intp)
    return np.bincount(np.clip(bins, 0, BINS - 1, out=bins), minlength=BINS)


def best_range(counts: np.ndarray, low: float, high: float, levels: int) -> tuple[float, float]:
    edges = np.linspace(low, high, BINS + 1)
    centers, weights = (edges[:-1] + edges[1:]) / 2, counts / counts.sum()
    best, best_error = (low, high), quantization_error(centers, weights, low, high, levels)
    for a in SHRINK if low < 0 else (1.0,):
        for b in SHRINK if high > 0 else (1.0,):
            error = quantization_error(centers, weights, low * a, high * b, levels)
            if error < best_error:
                best, best_error = (float(low * a), float(high * b)), error
    return best


def quantization_error(values: np.ndarray, weights: np.ndarray, low: float, high: float, levels: int) -> float:
    low, high = min(low, 0.0), max(high, 0.0)
    scale = (high - low) / (levels - 1)
    if scale <= 0:
        return float("inf")
    zero = np.round(-low / scale)
    restored = (np.clip(np.round(values / scale) + zero, 0, levels - 1) - zero) * scale
    return float(weights @ (restored - values) ** 2)
