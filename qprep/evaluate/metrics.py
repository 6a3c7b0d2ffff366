"""Accuracy metrics of a result against its reference, per output, over evaluation samples.

Similarities (cosine, SQNR, agreement) are "higher is better"; errors (max_abs, mse) "lower is better";
`higher_is_better` is what the gate and `compare` use to read a threshold as a minimum or a maximum.
"""

from __future__ import annotations

import math

import numpy as np

from qprep.verify import cosine, same_nonfinite

# The one list of per-output metrics the evaluation reports (name → higher is better): the gate and the
# fallback target accept these names, `compare` shows them.
OUTPUT_METRICS = {"cosine_mean": True, "cosine_min": True, "sqnr_db": True, "max_abs": False, "mse": False,
                  "top1_agreement": True, "top5_agreement": True, "step_agreement": True, "element_agreement": True,
                  "top1_accuracy": True}
# Run-level numbers `compare` shows beside them (batch summaries: agreement, speedup).
RUN_METRICS = {"reference_top1_accuracy": True, "agreement": True, "speedup": True, "result_ms": False,
               "nodes": False}


def main_agreement(metrics: dict) -> str | None:
    """The agreement figure an output reports ("top1", "step" or "element"; None for plain tensors): the one
    reports and summaries show beside its cosine."""
    return next((prefix for prefix in ("top1", "step", "element") if f"{prefix}_agreement" in metrics), None)


def higher_is_better(metric: str) -> bool:
    name = metric.rsplit(".", 1)[-1]
    return {**OUTPUT_METRICS, **RUN_METRICS}.get(name, name.endswith("_agreement"))


def output_task(name: str, shape: tuple, producer_op: str | None, integer: bool = False) -> str:
    """What an output looks like: class scores [N, C], per-step scores [N, T, C] (a Softmax/LogSoftmax over
    the last axis), or anything else (compared numerically only). Integer outputs (ids, labels, counts) are
    never scores: an argmax over them means nothing."""
    if integer:
        return "tensor"
    if len(shape) == 2 and shape[-1] >= 2:
        return "classification"
    if len(shape) == 3 and shape[-1] >= 2 and producer_op in ("Softmax", "LogSoftmax"):
        return "sequence"
    return "tensor"


def is_integer(values: list) -> bool:
    """Integer or boolean outputs (ids, labels, masks, counts)."""
    return bool(values) and all(np.asarray(v).dtype.kind in "iub" for v in values)


def compare_output(reference: list[np.ndarray], result: list[np.ndarray], task: str) -> dict:
    """Metrics over the samples whose result has the reference's shape; outputs whose shape depends on the
    data (NMS boxes, NonZero) can differ per sample, which is counted (`shape_mismatch`), not compared.
    Non-finite values (-inf masks) must sit at the same places with the same values: there they compare as
    equal; a sample whose result has NaN/Inf elsewhere is a total miss (cosine 0, errors infinite).
    Integer outputs also report `element_agreement` (the share of equal elements), the one figure that means
    something for ids and labels."""
    integer = is_integer(reference)
    pairs = [(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)) for a, b in zip(reference, result)]
    matched = [(a, b) for a, b in pairs if a.shape == b.shape]
    mismatched = len(pairs) - len(matched)
    if not matched:
        return {"samples": len(pairs), "shape_mismatch": mismatched, "cosine_mean": 0.0, "cosine_min": 0.0,
                "sqnr_db": float("-inf"), "max_abs": float("inf"), "mse": float("inf"), "task": task,
                "per_sample_cosine": [0.0] * len(pairs)}
    broken = [not same_nonfinite(a, b) for a, b in matched]
    ref = [np.where(np.isfinite(a), a, 0.0) for a, _ in matched]
    res = [np.where(np.isfinite(a) & np.isfinite(b), b, 0.0) for a, b in matched]
    cosines = [0.0 if bad else cosine(a, b) for a, b, bad in zip(ref, res, broken)]
    noise = sum(float(np.sum((a - b) ** 2)) for a, b in zip(ref, res))
    count = sum(a.size for a in ref)
    metrics = {
        "samples": len(ref),
        **({"shape_mismatch": mismatched} if mismatched else {}),
        **({"nonfinite_samples": sum(broken)} if any(broken) else {}),
        "cosine_mean": float(np.mean(cosines)),
        "cosine_min": float(np.min(cosines)),
        "sqnr_db": float("-inf") if any(broken) else sqnr_db(ref, res),
        "max_abs": float("inf") if any(broken) else max(
            (float(np.max(np.abs(a - b))) for a, b in zip(ref, res) if a.size), default=0.0),
        "mse": float("inf") if any(broken) else noise / max(count, 1),
        "task": task,
    }
    scores = [(_ranked(a), _ranked(b)) for a, b in matched if a.size]  # argmax sees -inf masks, never NaN
    if task == "classification" and scores:
        metrics.update(_agreement("top1", _topk_hits(*zip(*scores), 1)))
        if scores[0][0].shape[-1] >= 10:
            metrics.update(_agreement("top5", _topk_hits(*zip(*scores), 5)))
    elif task == "sequence" and scores:
        hits = [(a.argmax(-1) == b.argmax(-1)).ravel() for a, b in scores]
        metrics.update(_agreement("step", np.concatenate(hits)))
    if integer:
        metrics.update(_agreement("element", np.concatenate([(a == b).ravel() for a, b in matched])))
    # per-sample cosines line up with the evaluation files; a mismatched sample counts as 0
    per_sample = iter(cosines)
    metrics["per_sample_cosine"] = [next(per_sample) if a.shape == b.shape else 0.0 for a, b in pairs]
    return metrics


def _ranked(values: np.ndarray) -> np.ndarray:
    """Scores for argmax/top-k: NaN ranks last."""
    return np.where(np.isnan(values), -np.inf, values)


def sqnr_db(reference: list[np.ndarray], result: list[np.ndarray]) -> float:
    """Signal-to-quantization-noise ratio in dB over arrays of matching shapes: Σ reference² / Σ error²."""
    noise = sum(float(np.sum((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2))
                for a, b in zip(reference, result))
    signal = sum(float(np.sum(np.asarray(a, np.float64) ** 2)) for a in reference)
    if noise == 0:
        return float("inf")
    if not math.isfinite(noise):  # NaN/Inf in the error: no signal outweighs it
        return float("-inf")
    return 10 * math.log10(max(signal, 1e-300) / noise)


def _topk_hits(ref: list[np.ndarray], res: list[np.ndarray], k: int) -> np.ndarray:
    """Per row: is the reference's top-1 class among the result's top-k?"""
    hits = []
    for a, b in zip(ref, res):
        a2, b2 = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
        top = np.argsort(-b2, axis=-1)[:, :k]
        hits.extend((top == a2.argmax(-1)[:, None]).any(-1))
    return np.asarray(hits)


def _agreement(prefix: str, hits: np.ndarray) -> dict:
    rate = float(hits.mean()) if hits.size else float("nan")
    low, high = wilson_interval(int(hits.sum()), int(hits.size))
    return {f"{prefix}_agreement": rate, f"{prefix}_agreement_ci95": [low, high], f"{prefix}_count": int(hits.size)}


def wilson_interval(successes: int, total: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval: honest at 100% agreement on few samples, unlike the normal approximation."""
    if total == 0:
        return float("nan"), float("nan")
    p = successes / total
    denom = 1 + z * z / total
    centre = (p + z * z / (2 * total)) / denom
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)
