"""Verification samples at other dynamic dims: a rewrite of a dynamic model must hold for every batch size and
sequence length, not only the calibration samples' one.

Why: calibration samples usually share one shape (MiniLM's are all [1, 128]). A shape rewrite that was only
right for that shape (a dim taken for another that happens to be equal there) would pass verification on them
and break the user's next input. So the optimize stage also verifies on one variant of the first sample in
which every named dynamic dim has another size: a batch of 1 is repeated to 2, a longer dim is cut to about 3/4
of its length, kept a multiple of the same power of two (up to 32) so strided CNNs still divide it.
Inputs sharing a dim name change together (ONNX: one name, one size). Unnamed dynamic dims are left alone
(nothing says which other dims must match them).
"""

from __future__ import annotations

import numpy as np
import onnx

from qprep.model.info import graph_inputs


def named_dynamic_dims(model: onnx.ModelProto) -> dict[str, list[tuple[str, int]]]:
    """{dim name: [(input name, axis), ...]} for the graph inputs' symbolic dims (inference's unk__ excluded)."""
    dims: dict[str, list[tuple[str, int]]] = {}
    for spec in graph_inputs(model):
        for axis, dim in enumerate(spec.shape or []):
            if isinstance(dim, str) and dim != "?" and not dim.startswith("unk__"):
                dims.setdefault(dim, []).append((spec.name, axis))
    return dims


def other_size(n: int) -> int:
    """Another size for a dim of size n: 1 → 2; else about 3/4 of n, a multiple of n's power-of-two factor
    (at most 32); doubled when that would not change it."""
    if n <= 1:
        return 2
    step = min(32, n & -n)
    smaller = (n - n // 4) // step * step
    return smaller if 0 < smaller < n else 2 * n


def resized(array: np.ndarray, axis: int, size: int) -> np.ndarray:
    """The array cut to `size` along `axis`, or repeated along it until it is that long."""
    if size <= array.shape[axis]:
        return np.take(array, np.arange(size), axis=axis)
    repeats = -(-size // array.shape[axis])
    return np.take(np.concatenate([array] * repeats, axis=axis), np.arange(size), axis=axis)


def dynamic_variant(model: onnx.ModelProto, sample: dict) -> tuple[dict | None, dict]:
    """(the sample with every named dynamic dim at another size, {dim name: (old, new)}); None when the model
    has no named dynamic dim or the sample's inputs disagree on a dim's size."""
    dims = named_dynamic_dims(model)
    variant, sizes = dict(sample), {}
    for name, places in dims.items():
        current = {sample[input_name].shape[axis] for input_name, axis in places if input_name in sample}
        if len(current) != 1:
            return None, {}
        (n,) = current
        sizes[name] = (n, other_size(n))
        for input_name, axis in places:
            if input_name in variant:
                variant[input_name] = resized(variant[input_name], axis, sizes[name][1])
    return (variant, sizes) if sizes else (None, {})
