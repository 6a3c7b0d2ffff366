"""Data that loads, runs and still measures the wrong thing: each case found here is a warning in the report.

Why: these mistakes end in `status: ok` next to a figure that means nothing — calibration and evaluation
preprocessed differently (the evaluation then scores another input distribution than the one calibrated),
images fed as raw 0..255 pixels to a model that expects normalized input, or evaluation samples that are
the calibration samples (the figure flatters the result). None of them is an error: each can be intended.

A wrong mean/std the user wrote cannot be told from a right one by the config, but a model whose input goes
through a Conv into a BatchNormalization records its training: the BatchNormalization's running mean and
variance are that Conv's output statistics on the training data. The samples' own statistics there, many times
off (`SCALE_OFF`), mean the samples are not preprocessed as in training (raw 0..255 pixels for a model trained on
[-1, 1]: about 127×). A model whose exporter folded that BatchNormalization into the Conv keeps no such record.
"""

from __future__ import annotations

import hashlib

import numpy as np
import onnx
from onnx import helper, numpy_helper

from qprep.data.samples import SampleSet
from qprep.model.info import constant_names
from qprep.model.runtime import run_model

# Ops that normalize an input when one operand is a constant: a model starting with them takes raw pixels.
NORMALIZING_OPS = {"Sub", "Add", "Mul", "Div", "BatchNormalization"}
PREPROCESS_KEYS = ("mean", "std", "channel_order", "layout", "resize")
SCALE_OFF = 10.0  # the first BatchNormalization sees values this many times (or 1/this) its training spread
SCALE_SAMPLES = 8  # samples run through the first Conv to measure it


def data_warnings(model: onnx.ModelProto, calibration: SampleSet | None, evaluation: SampleSet | None,
                  heldout: SampleSet | None = None) -> list[str]:
    """Every pitfall found in the run's sample sets, as report warnings (worded for the user)."""
    warnings = []
    for role, samples in (("calibration", calibration), ("evaluation", evaluation)):
        if samples is not None and (message := raw_pixels(model, samples, role)):
            warnings.append(message)
        elif samples is not None and (role == "calibration" or calibration is None
                                      or samples.preprocess != calibration.preprocess):
            warnings += filter(None, [trained_scale(model, samples, role)])
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


def trained_scale(model: onnx.ModelProto, samples: SampleSet, role: str) -> str | None:
    """Samples whose spread at the model's first BatchNormalization is SCALE_OFF times off its running variance
    (the module doc); None when it is not, or when the model has no Conv → BatchNormalization on an input."""
    found = first_batchnorm(model)
    if found is None or not samples.samples or found[0] not in samples.samples[0]:
        return None
    name, probe, bn, (mean, variance, epsilon) = found
    squares, count = np.zeros(mean.size), 0
    for sample in samples.samples[:SCALE_SAMPLES]:  # one at a time: a big image's Conv output is large
        try:
            value = run_model(probe, [{name: sample[name]}], threads=1)[0][probe.graph.output[0].name]
        except Exception:  # noqa: BLE001 - ORT's own types; a check that cannot run warns of nothing
            return None
        if value.ndim < 2 or value.shape[1] != mean.size:
            return None
        channels = np.moveaxis(value, 1, 0).reshape(mean.size, -1).astype(np.float64)
        squares += np.sum(((channels - mean[:, None]) / np.sqrt(variance[:, None] + epsilon)) ** 2, axis=1)
        count += channels.shape[1]
    spread = float(np.median(np.sqrt(squares / max(count, 1))))
    if not np.isfinite(spread) or 1 / SCALE_OFF <= spread <= SCALE_OFF:
        return None
    times = f"{spread:.0f}× the spread" if spread > 1 else f"1/{1 / spread:.0f} of the spread"
    return (f"{role}: at the model's first BatchNormalization ('{bn}', after the Conv reading '{name}') the samples "
            f"have {times} of the training data (its running variance): they are likely not preprocessed as in "
            "training (raw 0..255 pixels for a model trained on [-1, 1] or [0, 1]?); set "
            f"{role}.preprocess.mean/std to the training's (arrays: prepare them so)")


def first_batchnorm(model: onnx.ModelProto) -> tuple[str, onnx.ModelProto, str, tuple] | None:
    """(input name, a model of the Conv reading it, the BatchNormalization's name, its (mean, variance,
    epsilon)) for the first float graph input a Conv with constant weights reads into a BatchNormalization with
    constant statistics; None when there is none."""
    graph = model.graph
    arrays = {t.name: t for t in graph.initializer} | constant_tensors(graph)
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    for value in graph.input:
        if value.type.tensor_type.elem_type != onnx.TensorProto.FLOAT or value.name in arrays:
            continue
        for conv in consumers.get(value.name, []):
            after = consumers.get(conv.output[0], [])
            if (conv.op_type != "Conv" or conv.input[0] != value.name or len(after) != 1
                    or after[0].op_type != "BatchNormalization" or not all(i in arrays for i in conv.input[1:] if i)
                    or not all(i in arrays for i in after[0].input[3:5])):
                continue
            bn = after[0]
            try:  # weights in external data the load did not read: no record to compare with
                mean, variance = (numpy_helper.to_array(arrays[i]).astype(np.float64) for i in bn.input[3:5])
                weights = [arrays[i] for i in conv.input[1:] if i]
                [numpy_helper.to_array(w) for w in weights]
            except (OSError, ValueError):
                return None
            epsilon = next((a.f for a in bn.attribute if a.name == "epsilon"), 1e-5)
            out = helper.make_tensor_value_info(conv.output[0], onnx.TensorProto.FLOAT, None)
            probe = helper.make_model(helper.make_graph([conv], "first_conv", [value], [out], weights),
                                      opset_imports=[o for o in model.opset_import if o.domain in ("", "ai.onnx")],
                                      ir_version=model.ir_version)
            return value.name, probe, bn.name or bn.output[0], (mean, variance, epsilon)
    return None


def constant_tensors(graph: onnx.GraphProto) -> dict[str, onnx.TensorProto]:
    """Constant nodes' tensors named by their output (a Paddle export holds its weights so)."""
    found = {}
    for node in graph.node:
        value = next((a.t for a in node.attribute if a.name == "value"), None) if node.op_type == "Constant" else None
        if value is not None:
            tensor = onnx.TensorProto()
            tensor.CopyFrom(value)
            tensor.name = node.output[0]
            found[tensor.name] = tensor
    return found


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
