"""Data that loads, runs and still measures the wrong thing: each case found here is a warning in the report.

Why: these mistakes end in `status: ok` next to a figure that means nothing — calibration and evaluation
preprocessed differently (the evaluation then scores another input distribution than the one calibrated),
images fed as raw 0..255 pixels to a model that expects normalized input, or evaluation samples that are
the calibration samples (the figure flatters the result). None of them is an error: each can be intended.
"""

from __future__ import annotations

import hashlib

import numpy as np
import onnx

from qprep.data.samples import SampleSet
from qprep.model.info import constant_names

# Ops that normalize an input when one operand is a constant: a model starting with them takes raw pixels.
NORMALIZING_OPS = {"Sub", "Add", "Mul", "Div", "BatchNormalization"}
PREPROCESS_KEYS = ("mean", "std", "channel_order", "layout", "resize")


def data_warnings(model: onnx.ModelProto, calibration: SampleSet | None, evaluation: SampleSet | None,
                  heldout: SampleSet | None = None) -> list[str]:
    """Every pitfall found in the run's sample sets, as report warnings (worded for the user)."""
    warnings = []
    for role, samples in (("calibration", calibration), ("evaluation", evaluation)):
        if samples is not None and (message := raw_pixels(model, samples, role)):
            warnings.append(message)
    if calibration is not None and evaluation is not None:
        if message := preprocess_differs(calibration, evaluation):
            warnings.append(message)
    if calibration is not None:
        for role, samples in (("evaluation", evaluation), ("evaluation.heldout", heldout)):
            if samples is not None and (message := shared_samples(samples, role, calibration, "calibration")):
                warnings.append(message)
    return warnings


def preprocess_differs(calibration: SampleSet, evaluation: SampleSet) -> str | None:
    """Image preprocessing that differs between the sets (both read as images)."""
    a, b = calibration.preprocess, evaluation.preprocess
    if not a or not b:
        return None
    differing = [f"{key} {a.get(key)} vs {b.get(key)}" for key in PREPROCESS_KEYS if a.get(key) != b.get(key)]
    if not differing:
        return None
    return (f"calibration and evaluation preprocess images differently ({'; '.join(differing)}): the evaluation "
            "scores inputs the model was not calibrated on; give both sections the same preprocess")


def raw_pixels(model: onnx.ModelProto, samples: SampleSet, role: str) -> str | None:
    """Images fed as 0..255 floats (no mean/std) to a model whose input goes straight into computation."""
    preprocess = samples.preprocess
    if not preprocess or preprocess.get("mean") is not None or preprocess.get("std") is not None:
        return None
    if not preprocess.get("dtype", "float32").startswith("float") or normalizes_itself(model, preprocess["input"]):
        return None
    return (f"{role}: images go in as raw 0..255 pixels (no preprocess.mean/std) and the model's input "
            f"'{preprocess['input']}' feeds its computation directly; most models expect normalized input (e.g. "
            "mean [123.675, 116.28, 103.53], std [58.395, 57.12, 57.375] for ImageNet-trained ones): set "
            f"{role}.preprocess.mean/std, or mean: [0] and std: [1] if raw pixels are right")


def normalizes_itself(model: onnx.ModelProto, input_name: str) -> bool:
    """True when every consumer of the input is an elementwise op with a constant operand (x/255, x - mean)."""
    constants = constant_names(model.graph)
    consumers = [n for n in model.graph.node if input_name in n.input]
    return bool(consumers) and all(
        n.op_type in NORMALIZING_OPS and any(i in constants for i in n.input if i != input_name) for n in consumers)


def shared_samples(a: SampleSet, role: str, b: SampleSet, other: str) -> str | None:
    """Samples of `a` that are also in `b` (shared_count), worded for the report."""
    shared = shared_count(a, b)
    if not shared:
        return None
    share = "are" if shared == len(a) else f"share {shared} of {len(a)} samples with"
    return (f"{role} samples {share} the {other} samples: its figures are optimistic; use samples the run "
            "does not calibrate on")


def shared_count(a: SampleSet, b: SampleSet) -> int:
    """How many samples of `a` are also in `b`: the same file (whatever the preprocessing) or a copy of one."""
    files, digests = set(b.files), set(_digests(b))
    return sum(1 for file, digest in zip(a.files or [None] * len(a), _digests(a)) if file in files or digest in digests)


def _digests(samples: SampleSet) -> list[str]:
    digests = []
    for sample in samples.samples:
        digest = hashlib.sha256()
        for name in sorted(sample):
            array = np.ascontiguousarray(sample[name])
            digest.update(name.encode() + str(array.dtype).encode() + str(array.shape).encode() + array.tobytes())
        digests.append(digest.hexdigest())
    return digests
