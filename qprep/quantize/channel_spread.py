"""Channel spread: activation tensors whose channels cannot share one int8 scale.

Why: a per-tensor activation range gives every channel of a tensor the same step. Where BatchNorm was folded
into a convolution, each output channel is scaled by its own γ/σ, and in the depthwise blocks of mobile CNNs one
channel's range can be tens of times the median one's: the median channel then spans a handful of the 256 int8
levels. Models like PP-PicoDet and PP-OCRv3 rec lose most of their accuracy all int8 and get it back with 16-bit
activations, and most of it with 16 bits (or float) on the few tensors whose median channel spans the fewest
levels; float there is faster than 16-bit QDQ, which ONNX Runtime's CPU runs in float (BENCHMARKS.md: "channel
spread"). So the spread is measured once from the float model (one run over a few samples, no quantized
trial) and ranks the tensors to keep out of int8 before any node is made float.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import onnx

from qprep.model.runtime import intermediate_values
from qprep.quantize import search
from qprep.quantize.budget import Budget

LEVELS = 255  # steps of an 8-bit grid
# the tensors whose median channel spans fewer int8 levels than each of these, in turn, are tried out of int8
THRESHOLDS = (4, 8, 16, 32, 64)
SAMPLES = 4  # calibration samples the channel ranges are measured on


def channel_axis(rank: int) -> int:
    """The axis whose slices a consumer treats apart: channels of NCHW convolution activations, the feature
    (last) axis of [batch, sequence, features] and [batch, features] tensors."""
    return 1 if rank >= 4 else rank - 1


def last_axis_peaks(model: onnx.ModelProto, names: list[str], samples: list[dict], threads: int = 2,
                    outputs: list[str] = ()) -> tuple[dict[str, np.ndarray], list[dict]]:
    """({tensor: the largest |value| of each last-axis channel over `samples`}, per sample {output: value} of
    `outputs`) from one ORT run: a rewrite's channel measurement and its verification reference."""
    peaks: dict[str, np.ndarray] = {}
    reference = []
    for values in intermediate_values(model, list(names) + list(outputs), samples, threads):
        reference.append({name: values[name] for name in outputs if name in values})
        for name in names:
            value = np.asarray(values[name], dtype=np.float64)
            peaks[name] = np.maximum(peaks.get(name, 0.0), np.abs(value.reshape(-1, value.shape[-1])).max(axis=0))
    return peaks, reference


def median_channel_levels(model: onnx.ModelProto, tensors: list[str], samples: list[dict],
                          threads: int = 2) -> dict[str, float]:
    """tensor → the int8 levels its median channel spans under one per-tensor scale: 255 × the median channel's
    range / the tensor's range, the range stretched to include 0 as ONNX Runtime's calibrator makes it. Channels
    that never change (a ReLU's dead channels) are left out of the median: the grid holds a constant exactly
    enough. Tensors that are not float, have fewer than 2 live channels or are constant are left out."""
    low: dict[str, np.ndarray] = {}
    high: dict[str, np.ndarray] = {}
    for values in intermediate_values(model, tensors, samples, threads):
        for name, value in values.items():
            if value.dtype.kind != "f" or value.ndim < 2:
                continue
            axis = channel_axis(value.ndim)
            if value.shape[axis] < 2:
                continue
            others = tuple(i for i in range(value.ndim) if i != axis)
            lo, hi = value.min(axis=others), value.max(axis=others)
            if name in low and low[name].shape != lo.shape:  # channels changed between samples: not a channel axis
                low[name] = high[name] = np.zeros(0)
                continue
            low[name] = np.minimum(low[name], lo) if name in low else lo
            high[name] = np.maximum(high[name], hi) if name in high else hi
    levels = {}
    for name in low:
        spans = high[name] - low[name]
        live = spans[spans > 0]
        if live.size < 2:
            continue
        whole = max(float(high[name].max()), 0.0) - min(float(low[name].min()), 0.0)
        if np.isfinite(whole):
            levels[name] = LEVELS * float(np.median(live)) / whole
    return levels


def below(levels: dict[str, float], threshold: float) -> frozenset[str]:
    """The tensors whose median channel spans fewer than `threshold` levels."""
    return frozenset(name for name, value in levels.items() if value < threshold)


def nested_sets(levels: dict[str, float], thresholds=THRESHOLDS) -> dict[str, frozenset[str]]:
    """label → tensors, from none to those under the largest threshold (each set once), for a search that
    tries them in turn: {"none": ∅, "5 tensors under 4 levels": …, …}."""
    sets: dict[str, frozenset[str]] = {"none": frozenset()}
    for threshold in thresholds:
        chosen = below(levels, threshold)
        if chosen and chosen not in sets.values():
            sets[f"{len(chosen)} tensors under {threshold} levels"] = chosen
    return sets


def nodes_around(model: onnx.ModelProto, tensors: frozenset[str]) -> set[str]:
    """The producers and consumers of `tensors`: what must stay float (or float16) for them to stay float."""
    return {node.name for node in model.graph.node if tensors & (set(node.input) | set(node.output))}


def records(levels: dict[str, float], tensors: frozenset[str]) -> list[dict]:
    """[{tensor, levels}] worst first, for the report."""
    return [{"tensor": name, "levels": round(levels[name], 2)} for name in sorted(tensors, key=lambda n: levels[n])]


def choose(job, model: onnx.ModelProto, tensors: list[str], how: str, use: Callable[[frozenset[str]], None],
           evaluate: Callable[[set[str], list[dict]], dict], base_float: set[str], budget: Budget,
           nodes: Callable[[frozenset[str]], int]) -> tuple[dict, frozenset[str]]:
    """A fallback's spread phase, for any backend (`job`: its QuantizeJob), before its node search: unless the
    target already holds, the levels of `model`'s `tensors` are measured on the calibration samples and the sets
    under each of THRESHOLDS tried in turn with `use(tensors)` then `evaluate(base_float, evaluation samples)`
    (search.choose_setting: the first that meets the target is kept, else the best if it removes enough of the
    error) → (record, the tensors kept out of int8). `how` says how the backend keeps them (float, int16,
    float16); `nodes(tensors)` how many nodes that takes out of int8: sets over the fallback's max_float_nodes are
    not tried (they count against it, or a spread set could keep many times the cap float: BENCHMARKS.md: "spread
    sets count against max_float_nodes"),
    and `search.node_search(fallback, record)` gives the node search what is left of it."""
    target = job.fallback.target
    if (search.judge(target, evaluate(base_float, job.evaluation_samples), base_float, evaluate,
                     job.acceptance_samples)["passed"]
            or not budget.allows("channel spread measured", budget.predict("trial"))):
        return {}, frozenset()
    with budget.timed("spread"):
        levels = median_channel_levels(model, tensors, job.samples[:SAMPLES], job.threads)
    sets = nested_sets(levels)
    cap = job.fallback.max_float_nodes  # unset: the spread set does not count against the node search's cap
    over = [label for label in sets if cap is not None and nodes(sets[label]) > cap]
    sets = {label: tensors for label, tensors in sets.items() if label not in over}
    if len(sets) == 1:
        return ({"as": how, "measured": len(levels), "chosen": "none", "tensors": [], "nodes": 0,
                 **({"over_max_float_nodes": over} if over else {})}, frozenset())
    setting = f"spread tensors {how}"
    result = search.choose_setting(
        setting, "none", [label for label in sets if label != "none"], lambda label: use(sets[label]), evaluate,
        base_float, job.evaluation_samples, target, job.progress,
        affordable=lambda label: budget.allows(f"{setting}: {label}", budget.predict("trial")),
        acceptance=job.acceptance_samples)
    chosen = sets[result["chosen"]]
    return ({**result, "as": how, "measured": len(levels), "nodes": nodes(chosen),
             "tensors": records(levels, chosen), **({"over_max_float_nodes": over} if over else {})}, chosen)
