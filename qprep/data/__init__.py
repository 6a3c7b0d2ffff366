"""Calibration and evaluation samples: folders of .npy/.npz arrays or images, checked against the model.

`load_samples` is the one entry point; every sample is a dict input-name → array, validated for names,
rank, static dims, dtype and finiteness before any stage runs.
"""

from qprep.data.samples import SampleSet, load_samples, random_samples

__all__ = ["SampleSet", "load_samples", "random_samples"]
