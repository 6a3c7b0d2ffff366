"""MSE activation ranges: a rare outlier no longer sets the int8 grid of everything else."""

import numpy as np
from onnx import helper

from graphs import make_model
from qprep.quantize.ranges import BINS, best_range, mse_ranges, quantization_error


def _relu_model():
    return make_model([helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Neg", ["r"], ["y"])],
                      [("x", [1, 4096])], [("y", [1, 4096])], infer_shapes=False)


def test_a_rare_outlier_is_clipped_and_the_error_goes_down():
    """Ten million values spread over [0, 1] and one at 20 (as a large activation over many samples): clipping
    that one value costs less than rounding ten million on a grid twenty times coarser."""
    counts = np.zeros(BINS)
    counts[: BINS // 20] = 1e7 / (BINS // 20)
    counts[-1] = 1
    low, high = best_range(counts, 0.0, 20.0, 256)
    assert low == 0.0 and high <= 10.0
    centers = (np.arange(BINS) + 0.5) * 20.0 / BINS
    weights = counts / counts.sum()
    shrunk, full = (quantization_error(centers, weights, *ends, 256) for ends in [(low, high), (0.0, 20.0)])
    assert shrunk < 0.5 * full


def test_evenly_spread_values_keep_their_full_range():
    counts = np.ones(BINS)
    assert best_range(counts, -1.0, 1.0, 256) == (-1.0, 1.0)


def test_ranges_come_from_the_model_run_and_untouched_tensors_keep_theirs():
    samples = [{"x": np.linspace(-1, 1, 4096, dtype=np.float32)[None]} for _ in range(2)]
    ranges = {"r": (0.0, 1.0), "y": (-1.0, 0.0), "empty": (0.0, 0.0), "missing": (-1.0, 2.0)}
    chosen = mse_ranges(_relu_model(), ranges, samples)
    assert chosen["r"] == (0.0, 1.0) and chosen["y"] == (-1.0, 0.0)  # spread evenly: nothing to clip
    assert chosen["empty"] == (0.0, 0.0) and chosen["missing"] == (-1.0, 2.0)


def test_the_histogram_counts_as_numpy_does_but_for_values_at_a_bin_edge():
    """Its own binning (faster than np.histogram): every value counted once, at most a few in a neighbouring bin
    (float32 rounding at an edge), and the range's ends in the end bins."""
    from qprep.quantize.ranges import histogram

    values = np.random.default_rng(0).standard_normal((1, 64, 24, 160)).astype(np.float32)
    low, high = float(values.min()), float(values.max())
    counts, expected = histogram(values, low, high), np.histogram(values, bins=BINS, range=(low, high))[0]
    assert counts.sum() == values.size and np.abs(counts - expected).sum() <= values.size * 1e-3
    assert counts[0] >= 1 and counts[-1] >= 1
    # values outside the range (a moving-average calibrator's), NaN and ±inf are left out, as np.histogram does
    extra = np.array([np.nan, np.inf, -np.inf, 1e30, -1e30, 2 * high, low - 1.0], np.float32)
    assert np.array_equal(histogram(np.concatenate([values.ravel(), extra]), low, high), counts)
    # a float16 tensor is binned in float32 (numpy 1.x would compute its bins in float16)
    half = values.astype(np.float16)
    reference = np.histogram(half.astype(np.float32), bins=BINS, range=(low, high))[0]
    assert np.abs(histogram(half, low, high) - reference).sum() <= values.size * 1e-3
