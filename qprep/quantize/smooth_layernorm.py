"""LayerNorm smoothing: the large channels of a LayerNorm's output moved into the weights of the MatMuls it feeds.

Why: a LayerNorm's γ makes a few feature channels of its output many times larger than the rest (all-MiniLM-L6-v2:
the largest channel of an attention block's LayerNorm output is 10–20× the median channel's, channels 62, 99 and
223 in every layer). A per-tensor int8 scale (RKNN's only one for activations) fits those channels and the median
channel spans a few dozen of the 256 levels. Weights are quantized per output channel, and a row of a MatMul's
weight multiplies one input channel: dividing channel c of the LayerNorm's output by s_c (its γ and β by s_c) and
multiplying row c of each weight by s_c computes the same products with an activation int8 fits better
(SmoothQuant, Xiao et al. 2023; α sets how much of the spread goes to the weights). Exact in float32, verified
on samples (BENCHMARKS.md: "LayerNorm smoothing, α 0.75").

Pattern: a LayerNormalization over the last axis whose output feeds at least one MatMul by a 2-D constant weight
(its first input). Check: on calibration samples its largest output channel's |value| is RATIO × the median
channel's, and every constant it changes is read by that node alone. Replacement: γ/s and β/s, W·s on each
such MatMul's rows, and the other readers (a post-LN transformer's residual Add) read the output times s again
through one added Mul.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from qprep.model.info import Links, node_index, unique_name
from qprep.quantize import rewrites
from qprep.quantize.channel_spread import last_axis_peaks
from qprep.schema import Key

log = logging.getLogger("qprep")

# the backends' option (ort, rknn): on by default, as the rewrite is exact and measured before it is kept
OPTION = Key("bool", default=True, doc="move the large channels of LayerNorm outputs into the following MatMuls' "
             "weights, so one int8 activation scale fits the rest (SmoothQuant; quantize/smooth_layernorm.py)")

ALPHA = 0.75  # the share of a channel's spread moved into the weights (BENCHMARKS.md: "LayerNorm smoothing, α 0.75")
SAMPLES = 16  # calibration samples the channel peaks are measured on
RATIO = 4.0  # smoothed when the largest channel is this many times the median one (two int8 bits lost)


@dataclass
class Smoothed:
    model: onnx.ModelProto
    record: dict = field(default_factory=dict)  # for the report; empty when nothing was smoothed


@dataclass(eq=False)
class _Site:
    layernorm: onnx.NodeProto
    matmuls: list[onnx.NodeProto]
    others: list[onnx.NodeProto]  # readers of the output that are not smoothed MatMuls


def smooth(model: onnx.ModelProto, samples: list[dict], threads: int = 2, alpha: float = ALPHA) -> Smoothed:
    """`model` with its spread LayerNorm outputs smoothed into the following MatMuls, verified on `samples`; the
    model itself when none is spread or the rewrite changed the outputs. One ORT run measures the channels and
    gives the reference outputs; the model is copied only when a LayerNorm is spread."""
    sites = _sites(model) if samples else []
    if not sites:
        return Smoothed(model)
    names = [site.layernorm.output[0] for site in sites]
    peaks, reference = last_axis_peaks(model, names, samples, threads, [o.name for o in model.graph.output])
    spread = {name for name, peak in peaks.items() if np.median(peak) > 0 and peak.max() >= RATIO * np.median(peak)}
    if not spread:
        return Smoothed(model)
    result = onnx.ModelProto()
    result.CopyFrom(model)
    constants = {t.name: t for t in result.graph.initializer}
    taken = {n.name for n in result.graph.node} | {t for n in result.graph.node for t in n.output} | set(constants)
    smoothed = []
    for site in (site for site in _sites(result) if site.layernorm.output[0] in spread):
        peak = peaks[site.layernorm.output[0]]
        scale = _scales(peak, [numpy_helper.to_array(constants[m.input[1]]) for m in site.matmuls], alpha)
        restoring = _rewrite(result, constants, site, scale, taken)
        smoothed.append({"layernorm": site.layernorm.name, "matmuls": len(site.matmuls), "restoring_mul": restoring,
                         "spread_before": round(float(peak.max() / np.median(peak)), 1),
                         "spread_after": round(float((peak / scale).max() / np.median(peak / scale)), 1),
                         "largest_scale": round(float(scale.max()), 2)})
    if rewrites.exact("smoothing LayerNorm outputs", model, reference, result, samples, threads):
        return Smoothed(model)
    log.info("quantize: %d LayerNorm outputs smoothed into their MatMuls' weights", len(smoothed))
    return Smoothed(result, {"alpha": alpha, "layernorms": smoothed, "verified_on": len(samples)})


def smooth_job(job, backend: str):
    """A backend's step: (the QuantizeJob with its model smoothed when `backend`'s settings turn it on
    (rewrites.py), the record for the stage's details: {} when nothing was smoothed)."""
    if not rewrites.runs("smoothed_layernorms", backend, job.options) or not job.samples:
        return job, {}
    smoothed = smooth(job.model, job.samples[:SAMPLES], job.threads)
    return job.but(model=smoothed.model), smoothed.record


def _sites(model: onnx.ModelProto) -> list[_Site]:
    links = Links(model)
    initializers, readers = links.initializers, links.readers
    sites = []
    for node in model.graph.node:
        if node.op_type != "LayerNormalization" or node.domain not in ("", "ai.onnx") or len(node.input) < 2:
            continue
        out = node.output[0]
        gamma = initializers.get(node.input[1])
        if (out in links.outputs or out in links.in_subgraphs or any(node.output[1:]) or gamma is None
                or len(gamma.dims) != 1 or not links.last_axis(node)
                or not all(links.own_constant(c, node) for c in node.input[1:] if c)):
            continue
        matmuls = [r for r in readers.get(out, [])
                   if r.op_type == "MatMul" and r.domain in ("", "ai.onnx") and r.input[0] == out
                   and r.input[1] != out and links.own_constant(r.input[1], r)
                   and list(initializers[r.input[1]].dims)[:1] == list(gamma.dims)
                   and len(initializers[r.input[1]].dims) == 2]
        if matmuls:
            sites.append(_Site(node, matmuls, [r for r in readers.get(out, []) if all(r is not m for m in matmuls)]))
    return sites


def _scales(peak: np.ndarray, weights: list[np.ndarray], alpha: float) -> np.ndarray:
    """s_c = max|x_c|^α / max|W_c,:|^(1-α), relative to the median channel's and never below 1: only the large
    channels shrink, so the median channel keeps its step and no weight row is shrunk into rounding."""
    rows = np.concatenate([np.abs(w) for w in weights], axis=1).max(axis=1)
    scale = peak ** alpha / np.maximum(rows, 1e-8) ** (1 - alpha)
    scale = scale / np.median(scale)
    return np.clip(np.where(np.isfinite(scale), scale, 1.0), 1.0, None).astype(np.float32)


def _rewrite(model: onnx.ModelProto, constants: dict, site: _Site, scale: np.ndarray, taken: set[str]) -> str | None:
    """Rewrites `site` in place; the name of the Mul that gives the other readers the unsmoothed values (None when
    the MatMuls are the only readers)."""
    layernorm = site.layernorm
    for name in dict.fromkeys(i for i in layernorm.input[1:] if i):  # γ and β may be one constant
        value = numpy_helper.to_array(constants[name])
        constants[name].CopyFrom(numpy_helper.from_array((value / scale).astype(value.dtype), name))
    for matmul in site.matmuls:
        name = matmul.input[1]
        weight = numpy_helper.to_array(constants[name])
        constants[name].CopyFrom(numpy_helper.from_array((weight * scale[:, None]).astype(weight.dtype), name))
    if not site.others:
        return None
    out = layernorm.output[0]
    dtype = numpy_helper.to_array(constants[layernorm.input[1]]).dtype
    scale_name, restored = unique_name(f"{out}/smoothing_scale", taken), unique_name(f"{out}/unsmoothed", taken)
    model.graph.initializer.append(numpy_helper.from_array(scale.astype(dtype), scale_name))
    for reader in site.others:
        for k, name in enumerate(reader.input):
            if name == out:
                reader.input[k] = restored
    mul = helper.make_node("Mul", [out, scale_name], [restored], name=unique_name(f"{layernorm.name}/unsmoothed", taken))
    model.graph.node.insert(node_index(model.graph, layernorm) + 1, mul)
    return mul.name


def restoring_muls(record: dict) -> set[str]:
    """The Mul nodes a smoothing added (see `smooth`'s record): a quantizer that quantizes Mul should keep them
    float, as a per-tensor int8 scale s would round the 1s of the even channels (ORT's static QDQ does so)."""
    return {entry["restoring_mul"] for entry in record.get("layernorms", []) if entry.get("restoring_mul")}
