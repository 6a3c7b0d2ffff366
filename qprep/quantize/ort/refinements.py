"""Whether an optional refinement of an ORT build (GPTQ weight rounding, bias correction) is worth its time:
its cost predicted and its gain estimated before it runs, from what the build has measured already, and one
rule.

Why: a refinement is judged by a check after it ran, so one that gains nothing has cost its full time: a
segmentation U-Net spent 13 s on a GPTQ rounding its check dropped and 10 s on a bias correction worth 0.11 dB,
where the calibration (what ONNX Runtime's quantize_static itself spends) took 3 s (BENCHMARKS.md: "What a run
costs against quantize_static alone").

The rule: a refinement may cost one calibration (so a refinement that gains nothing keeps the stage near 2x
quantize_static), plus PER_DB calibrations for each dB of calibration SQNR it is expected to gain. Both sides are
in seconds measured on this run, so a slower machine moves both alike.

Gains, from runs the refinements' own checks make anyway (output_check.py) plus one float run on a few samples:
- GPTQ lowers the error the weights' rounding adds: the output SQNR of the float model with only its weights
  rounded (`weights_only`) against the nearest build's says how much of the build's error that is; GPTQ removed
  about GPTQ_SHARE of it where it helped most (EfficientNet-Lite0: 74% of the error, 17.2 → 22.3 dB).
- Bias correction removes a drift of channel means: the share of the build's output error that is a constant
  offset per channel (`output_check.bias_share`) bounds it (DETR-like: 54%, 26.3 → 37.6 dB; a super-resolution
  net: 0.3%, +0.03 dB, which its check then refused).
Costs: runs of the models over the calibration samples (as long as the checks' measured runs of the float
model and of the build), GPTQ's input moments H = Σ x xᵀ as long as they took on the first sample, times the
samples, and its solve at the rate a probe of the moments' own kernel runs here. Both estimates are coarse (each record holds what was predicted and, when
it ran, what it took): the rule separates the refinements worth many calibrations from those worth none, and a
refinement predicted within one calibration (or FREE_S) runs without its gain being estimated.
"""

from __future__ import annotations

import logging
import math
import time

import numpy as np
import onnx
from onnx import numpy_helper

from qprep.model.runtime import intermediate_values, run_model
from qprep.quantize import bias_correction, gptq
from qprep.quantize.ort.output_check import output_sqnr

log = logging.getLogger("qprep")

PER_DB = 10.0  # calibrations a refinement may cost per dB it is expected to gain (module doc)
GPTQ_SHARE = 0.7  # of the error the weights' rounding adds, the share GPTQ is expected to remove
BIAS_SHARE = 0.8  # of the output error's offset per channel, the share bias correction is expected to remove
# a bias-correction wave costs about this share of a float run (its part's session and run; EfficientNet-Lite0's 50
# waves took 8.5 s where its float run took 1 s)
WAVE_RUNS = 0.15
# a refinement predicted to take less runs whatever it gains: its estimate would cost about as much, and a rule on
# milliseconds would follow the machine's hiccups
FREE_S = 0.25
# GPTQ's solve (numpy's float64 inverse and Cholesky, a loop over columns) against the probe's float32 kernel, per
# multiply-add: a layer of 1024 inputs and 256 outputs solved in 4.4x the time the probe's rate gives
SOLVE_SLOWER = 4.0
ESTIMATE_SAMPLES = 8  # samples the weights-only run estimates GPTQ's gain on
FETCH_RUNS = 2.0  # a model run as written with its layers' tensors fetched, in plain (optimized) float runs


def allowed_seconds(calibration_s: float, gain_db: float) -> float:
    """What a refinement expected to gain `gain_db` may cost (module doc: the rule), never less than FREE_S."""
    return max(FREE_S, calibration_s * (1.0 + PER_DB * max(0.0, gain_db)))


def expected_gain_db(share: float, removed: float) -> float:
    """The SQNR rise when `removed` of an error part that is `share` of the output error goes away."""
    left = 1.0 - removed * min(1.0, max(0.0, share))
    return max(0.0, -10.0 * math.log10(max(left, 1e-6)))


def noise_share(total_db: float | None, part_db: float | None) -> float:
    """The share of the error power at `total_db` SQNR that an error part alone at `part_db` SQNR makes up."""
    if total_db is None or part_db is None:
        return 0.0
    if math.isinf(part_db):
        return 0.0
    return min(1.0, 10.0 ** ((total_db - part_db) / 10.0)) if not math.isinf(total_db) else 0.0


def weights_only(quantized: onnx.ModelProto, float_model: onnx.ModelProto, layers: list[gptq.Layer]
                 ) -> onnx.ModelProto:
    """A copy of the float model whose weights GPTQ would re-round are the build's nearest-rounded ones,
    dequantized: the error the weights' rounding alone adds."""
    model = onnx.ModelProto()
    model.CopyFrom(float_model)
    inits = {t.name: t for t in model.graph.initializer}
    integers = {t.name: t for t in quantized.graph.initializer}
    nodes = {n.name: n for n in model.graph.node}
    for layer in layers:
        weight = nodes[layer.node].input[1]
        if weight not in inits or layer.quantized not in integers:
            continue
        values = numpy_helper.to_array(integers[layer.quantized]).astype(np.float64)
        shape = [1] * values.ndim
        shape[layer.axis] = -1
        scale = layer.scale.reshape(shape) if layer.scale.size > 1 else layer.scale
        zero = layer.zero_point.reshape(shape) if layer.zero_point.size > 1 else layer.zero_point
        dtype = numpy_helper.to_array(inits[weight]).dtype
        inits[weight].CopyFrom(numpy_helper.from_array(((values - zero) * scale).astype(dtype), weight))
    return model


def weights_only_sqnr(quantized: onnx.ModelProto, float_model: onnx.ModelProto, layers: list[gptq.Layer],
                      samples: list[dict], float_outputs: list[dict], threads: int) -> float | None:
    """The output SQNR of `weights_only` on the first ESTIMATE_SAMPLES samples (a ratio: a few samples estimate
    it, at a fraction of a check's run); `float_outputs`: the float model's outputs on `samples`."""
    count = min(ESTIMATE_SAMPLES, len(samples))
    rounded = run_model(weights_only(quantized, float_model, layers), samples[:count], threads, optimize=True)
    return output_sqnr(float_outputs[:count], rounded)


def moments_rate(threads: int) -> float:
    """Multiply-adds per second of GPTQ's moment kernel here (x xᵀ on a [1, 256, 4096] block, best of 2: tens of
    milliseconds; a smaller block measures the call's overhead more than the kernel)."""
    session = gptq.gram_session(threads)
    x = np.random.default_rng(0).standard_normal((1, 256, 4096)).astype(np.float32)
    best = math.inf
    for _ in range(2):
        start = time.perf_counter()
        session.run(None, {"x": x})
        best = min(best, time.perf_counter() - start)
    return 256 * 256 * 4096 / max(best, 1e-6)


def moments_seconds(quantized: onnx.ModelProto, layers: list[gptq.Layer], samples: list[dict], threads: int
                    ) -> float:
    """Seconds GPTQ's input moments take per sample here: the rows gathered and x xᵀ of every layer it would
    re-round, timed on the first sample's layer inputs (each sample is the same work), shared by `threads` as
    gptq.input_moments shares its layers."""
    kept = [layer for layer in layers if not gptq.too_wide(layer)]
    if not kept or not samples:
        return 0.0
    first = next(iter(intermediate_values(quantized, sorted({layer.activation for layer in kept}), samples[:1],
                                          threads)), {})
    gram = gptq.gram_session(1)
    started = time.perf_counter()
    for layer in kept:
        if layer.activation in first:
            value = np.asarray(first[layer.activation], dtype=np.float32)
            gram.run(None, {"x": gptq.input_columns(value, layer, gptq.rows_per_sample(layer, len(samples)))})
    return (time.perf_counter() - started) / max(1, threads)


def solve_work(layers: list[gptq.Layer]) -> float:
    """Multiply-adds of GPTQ's solve (inverse and Cholesky of H, the column updates) over the layers it would
    re-round."""
    work = 0.0
    for layer in layers:
        if not gptq.too_wide(layer):
            d = gptq.inputs_per_output(layer)
            work += layer.groups * (2 * d ** 3 + layer.float_weight.shape[layer.axis] // layer.groups * d * d)
    return work


def gptq_seconds(layers: list[gptq.Layer], samples: int, per_sample_s: float, float_s: float, check_s: float,
                 rate: float) -> float:
    """GPTQ's predicted time: the QDQ model run as written for its layer inputs (FETCH_RUNS float runs), the
    moments (`per_sample_s`: moments_seconds) over the samples, the solve at SOLVE_SLOWER times the probed `rate`'s
    time, and one check of the rounded build (as long as the build's check)."""
    return FETCH_RUNS * float_s + samples * per_sample_s + SOLVE_SLOWER * solve_work(layers) / rate + check_s


def bias_seconds(layers: list[bias_correction.BiasLayer], float_s: float, check_s: float) -> float:
    """Bias correction's predicted time: the float model's channel means (FETCH_RUNS float runs), its
    waves and one check per prefix of waves (bias_correction.prefixes)."""
    count = len(bias_correction.waves(layers))
    checks = len({min(1 << k, count) for k in range(count.bit_length() + 1)} - {0})
    return (FETCH_RUNS + count * WAVE_RUNS) * float_s + checks * check_s


def decide(what: str, predicted_s: float, gain_db: float, calibration_s: float) -> dict:
    """The record of one decision (report.json's `budget` of the refinement): predicted seconds, the expected gain,
    what the rule allows, and whether it runs."""
    allowed = allowed_seconds(calibration_s, gain_db)
    runs = predicted_s <= allowed
    record = {"predicted_s": round(predicted_s, 2), "expected_gain_db": round(gain_db, 2),
              "allowed_s": round(allowed, 2), "calibration_s": round(calibration_s, 2), "runs": runs}
    if not runs:
        log.info("ort: %s skipped: predicted %.1f s for an expected +%.2f dB, more than the %.1f s allowed",
                 what, predicted_s, gain_db, allowed)
    return record


def skipped_reason(record: dict) -> str:
    """The report's one line for a refinement the rule skipped."""
    return (f"skipped: predicted {record['predicted_s']:.1f} s for an expected +{record['expected_gain_db']:.2f} dB, "
            f"more than the {record['allowed_s']:.1f} s allowed (one calibration, {PER_DB:g} more per dB)")
