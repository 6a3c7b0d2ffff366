"""within_rounding on a mask's -inf: the same answer as before, without numpy's RuntimeWarning on the terminal."""

import warnings

import numpy as np

from qprep.measure.constants import within_rounding


def test_infinities_on_both_sides_warn_nothing_and_compare_as_before():
    mask = np.array([0.0, -np.inf, 1.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a RuntimeWarning would raise here
        assert within_rounding(mask, mask) is False  # inf - inf is NaN: unequal, as it always was
        assert within_rounding(np.array([1.0, 2.0]), np.array([1.0, 2.0])) is True
