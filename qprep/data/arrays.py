"""Array samples: `.npy` (single-input models) and `.npz` keyed by input name (any model).

An .npz's arrays that are no model input (a label, boxes) are the sample's extras, read in the same pass and kept
on the SampleSet for the user's metric (measure/user_metric.py): one reader of the files. An extra that cannot
be read without pickle (a ragged object array) is kept as `Unreadable`: only a metric that needs it fails.
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from qprep.disk.reading import require_regular_file
from qprep.errors import DataError
from qprep.model.info import TensorSpec
from qprep.schema import closest


@dataclass(frozen=True)
class Unreadable:
    """An .npz array beside the inputs that could not be read (why: `reason`)."""

    reason: str


def read_array_sample(path: Path, inputs: list[TensorSpec]) -> tuple[dict[str, np.ndarray], dict]:
    """(input name → array, the .npz's other arrays: name → array or Unreadable)."""
    require_regular_file(path, "sample file", DataError, "store each sample as a regular .npy or .npz file")
    try:
        if path.suffix.lower() == ".npy":
            return _from_npy(path, inputs), {}
        return _from_npz(path, inputs)
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
        raise DataError(f"{path}: cannot read it as {path.suffix} ({str(exc).splitlines()[0][:200]})") from None


def _from_npy(path: Path, inputs: list[TensorSpec]) -> dict[str, np.ndarray]:
    """`inputs` is the one input this file feeds (a folder of .npy, or one column of a dataset.txt list)."""
    if len(inputs) != 1:
        names = ", ".join(s.name for s in inputs)
        raise DataError(f"{path.name}: .npy samples need a single-input model, this one has {len(inputs)} "
                        f"({names}); store each sample as .npz keyed by input name")
    array = np.load(path, allow_pickle=False)
    return {inputs[0].name: array}


def _from_npz(path: Path, inputs: list[TensorSpec]) -> tuple[dict[str, np.ndarray], dict]:
    with np.load(path, allow_pickle=False) as npz:
        keys = list(npz.keys())
        sample = {}
        for spec in inputs:
            if spec.name not in keys:
                guess = closest(spec.name, keys)
                hint = f"; found '{guess}' — rename it" if guess else f" (keys: {', '.join(keys) or 'none'})"
                raise DataError(f"{path.name}: no array named '{spec.name}' for the model's input{hint}")
            sample[spec.name] = npz[spec.name]  # as saved: a missing batch dim is refused (samples.check_sample)
        extras = {name: _extra(npz, name) for name in keys if name not in sample}
    return sample, extras


def _extra(npz, name: str):
    try:
        return npz[name]
    except (ValueError, OSError, zipfile.BadZipFile) as exc:  # an object array (ragged boxes) needs pickle
        return Unreadable(str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__)
