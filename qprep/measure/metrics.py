"""Accuracy metrics of a result against its reference, per output, over evaluation samples.

Each output is rated by the metrics that mean something for its kind (kinds.py chooses the kind): cosine for
scores, embeddings and maps; absolute error and decisions at a threshold for probabilities (a one-element
cosine is always 1) and for two-class scores, on class 1's probability (POSITIVE_CLASS: the other is its
complement, and the cosine of the pair stays near 1 while one class's probability moves); relative error for
state outputs; absolute and relative error for regression heads and one-element outputs; agreement for
integers; detections matched by class and IoU where NMS/TopK chose the rows. `judged_by` names the metrics that
judge the output (the first one is its main figure); `score` is one smooth number per output, 1 when exact,
that the fallback search climbs. A cosine threshold also holds the
output's mean_sqnr_db (SQNR_SLACK_DB): cosine cannot see an error along the signal.

A figure computed on no comparable pair is None ("not measured"), never inf or a perfect 1. Outputs whose
shape depends on the input are compared sample by sample over their common prefix; a sample whose rank
changed is counted as not comparable.

Similarities (cosine, SQNR, agreement) are "higher is better"; errors (max_abs, mse, rel_error) "lower is
better"; `higher_is_better` is what the gate and `compare` use to read a threshold as a minimum or a maximum.
"""

from __future__ import annotations

import math

import numpy as np

from qprep.graph.verify import cosine, same_nonfinite
from qprep.measure import ctc
from qprep.measure.rows import compare_rows

# The one list of per-output metrics the evaluation reports (name → higher is better): the gate and the
# fallback target accept these names, `compare` shows them.
OUTPUT_METRICS = {"cosine_mean": True, "cosine_min": True, "sqnr_db": True, "mean_sqnr_db": True,
                  "max_abs": False, "mse": False, "mean_abs_error": False, "rel_error": False, "rel_error_max": False,
                  "top1_agreement": True, "top5_agreement": True, "step_agreement": True, "element_agreement": True,
                  "text_agreement": True, "char_error_rate": False,
                  "decision_agreement": True, "set_agreement": True, "match_rate": True, "detections_found": True,
                  "detections_extra": False, "mean_iou": True,
                  "score_abs_error": False, "top1_accuracy": True}
# Run-level numbers `compare` shows beside them (batch summaries: agreement, speedup).
RUN_METRICS = {"reference_top1_accuracy": True, "agreement": True, "speedup": True, "result_ms": False,
               "nodes": False}

# kind → the metrics that judge it, main one first
JUDGED_BY = {"classification": ("cosine_mean", "top1_agreement"), "sequence": ("cosine_mean", "step_agreement"),
             "ctc": ("cosine_mean", "text_agreement", "char_error_rate"),
             "tensor": ("cosine_mean",), "state": ("rel_error", "rel_error_max"),
             "probability": ("decision_agreement", "mean_abs_error"),
             "binary": ("decision_agreement", "mean_abs_error"), "scalar": ("rel_error", "mean_abs_error"),
             "regression": ("rel_error", "mean_abs_error"), "integer": ("element_agreement",),
             "boxes": ("match_rate", "detections_found", "detections_extra", "mean_iou", "score_abs_error"),
             "ranked": ("rel_error",), "ranked_ids": ("set_agreement",)}
KINDS = tuple(JUDGED_BY)
POSITIVE_CLASS = 1  # of a two-class output [..., 2] (`binary`): the decision is "class 1" (no/yes, as trained)


def main_agreement(metrics: dict) -> str | None:
    """The agreement figure an output reports ("decision", "top1", "text", "step", "element"; None for plain
    tensors): the one reports and summaries show beside its cosine. A two-class output's decision comes
    before the top-1 it also shows."""
    return next((prefix for prefix in ("decision", "top1", "text", "step", "element")
                 if f"{prefix}_agreement" in metrics), None)


def higher_is_better(metric: str) -> bool:
    name = metric.rsplit(".", 1)[-1]
    return {**OUTPUT_METRICS, **RUN_METRICS}.get(name, name.endswith("_agreement"))


EMBEDDING_PRODUCERS = {"Tanh", "LpNormalization"}  # what ends an embedding, never class scores


def output_task(name: str, shape: tuple, producer_op: str | None, integer: bool = False) -> str:
    """What a score output looks like: class scores [N, C], per-step scores [N, T, C] (a Softmax/LogSoftmax
    over the last axis), or anything else (compared numerically only). Integer outputs are never scores, nor is
    an embedding [N, C] squashed by a Tanh or normalized to unit length (BERT's pooler_output: its argmax means
    nothing, and a top-1 agreement of 69% was printed for it)."""
    if integer or producer_op in EMBEDDING_PRODUCERS:
        return "tensor"
    if len(shape) == 2 and shape[-1] >= 2:
        return "classification"
    if len(shape) == 3 and shape[-1] >= 2 and producer_op in ("Softmax", "LogSoftmax"):
        return "sequence"
    return "tensor"


def is_integer(values: list) -> bool:
    """Integer or boolean outputs (ids, labels, masks, counts)."""
    return bool(values) and all(np.asarray(v).dtype.kind in "iub" for v in values)


def compare_output(reference: list[np.ndarray], result: list[np.ndarray], kind: str, threshold: float = 0.5) -> dict:
    """The metrics of `kind` over the samples, plus `samples` (pairs compared), `judged_by`, `score` and
    `per_sample` ({metric, values}: one figure per sample, None where not comparable; the evaluation turns it
    into the worst samples). Non-finite values (-inf masks) must sit at the same places with the same values:
    there they compare as equal; a sample whose result has NaN/Inf elsewhere is a total miss."""
    if kind in ("boxes", "ranked", "ranked_ids"):
        metrics = compare_rows(reference, result, kind)
        if kind == "ranked":
            metrics["score"] = cosine_equivalent(metrics["rel_error"])
    else:
        pairs, changed = aligned(reference, result)
        shown = {}
        if kind == "binary":
            shown = scores_shown([p for p in pairs if positive_class(p) is not None])
            pairs = [positive_class(p) for p in pairs]
        usable = [p for p in pairs if p is not None]
        if not usable:
            metrics = _not_measured(kind, len(pairs))
        elif kind in ("probability", "binary", "scalar", "regression"):
            metrics = {**_values_metrics(usable, kind, threshold), **shown}
        elif kind == "integer":
            metrics = _integer_metrics(usable)
        else:
            metrics = _cosine_metrics(usable, kind)
        per_sample = iter(metrics.pop("per_sample_values", []))
        metrics["per_sample"]["values"] = [None if p is None else next(per_sample, None) for p in pairs]
        for key in ("texts", "flips"):  # ctc's decoded texts, changed top-1s: aligned with the samples the same way
            if key in metrics["per_sample"]:
                values = iter(metrics["per_sample"][key])
                metrics["per_sample"][key] = [None if p is None else next(values, None) for p in pairs]
        if changed:
            metrics["shape_changed"] = changed
        if len(usable) < len(pairs):
            metrics["not_comparable"] = len(pairs) - len(usable)
    metrics["kind"] = kind
    metrics["judged_by"] = [m for m in JUDGED_BY[kind] if m in metrics]
    return metrics


def aligned(reference: list, result: list) -> tuple[list[tuple[np.ndarray, np.ndarray] | None], int]:
    """Per sample (reference, result) as float64 arrays of one shape: as they are, or cut to their common
    prefix along every axis when the shape depends on the input (a TTS length, a detection count); None when
    the ranks differ. Also how many samples were cut."""
    pairs, changed = [], 0
    for a, b in zip(reference, result):
        a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
        if a.shape != b.shape:
            if a.ndim != b.ndim:
                pairs.append(None)
                continue
            common = tuple(slice(0, min(x, y)) for x, y in zip(a.shape, b.shape))
            a, b = a[common], b[common]
            changed += 1
        pairs.append((a, b))
    return pairs, changed


def positive_class(pair: tuple[np.ndarray, np.ndarray] | None) -> tuple[np.ndarray, np.ndarray] | None:
    """Class 1's probability on each side of a two-class output; None (not comparable) when a side is not
    [..., 2]."""
    if pair is None or any(side.ndim == 0 or side.shape[-1] != 2 for side in pair):
        return None
    return pair[0][..., POSITIVE_CLASS], pair[1][..., POSITIVE_CLASS]


def scores_shown(pairs: list) -> dict:
    """A two-class output's cosine and top-1 agreement read as class scores: shown beside the figures that
    judge it (gates and scripts that name them keep working), judging nothing."""
    if not pairs:
        return {}
    scores = _cosine_metrics(pairs, "classification")
    return {key: value for key, value in scores.items() if key.startswith(("cosine_", "top1_"))}


def _not_measured(kind: str, count: int) -> dict:
    return {"samples": 0, **{metric: None for metric in JUDGED_BY[kind]}, "score": None,
            "not_measured": f"none of the {count} samples could be compared (the result's rank differs"
                            + (", or its last axis is not 2)" if kind == "binary" else ")"),
            "per_sample": {"metric": JUDGED_BY[kind][0], "values": []}}


def _finite_pairs(pairs: list) -> tuple[list, list, list[bool]]:
    """References and results with matching non-finite entries zeroed, and which samples break (NaN/Inf in
    the result where the reference has none). All-finite pairs (the usual case) are passed on as they are."""
    ref, res, broken = [], [], []
    for a, b in pairs:
        if np.isfinite(a).all() and np.isfinite(b).all():
            ref.append(a), res.append(b), broken.append(False)
            continue
        broken.append(not same_nonfinite(a, b))
        ref.append(np.where(np.isfinite(a), a, 0.0))
        res.append(np.where(np.isfinite(a) & np.isfinite(b), b, 0.0))
    return ref, res, broken


def _errors(ref: list, res: list, broken: list[bool], per_sample: bool = False) -> dict:
    """SQNR, max abs and mean squared error over all samples, from one difference per sample. With
    `per_sample` (outputs cosine judges) also `mean_sqnr_db`, the SQNR of the mean over samples of each one's
    error energy over its signal energy: weighted per sample as cosine_mean is (one loud sample does not decide
    it); samples that break (NaN/Inf: cosine 0 already) or have no signal but some error are left out, None when
    none is left."""
    noise = signal = max_abs = 0.0
    ratios = []
    for a, b, bad in zip(ref, res, broken):
        if a.size:
            diff = a - b
            sample_noise = float(np.dot(diff.ravel(), diff.ravel()))
            sample_signal = float(np.dot(a.ravel(), a.ravel()))
            noise, signal = noise + sample_noise, signal + sample_signal
            max_abs = max(max_abs, float(np.max(np.abs(diff))))
            if not bad and (sample_signal > 0 or sample_noise == 0):
                ratios.append(sample_noise / sample_signal if sample_noise else 0.0)
    count = sum(a.size for a in ref)
    more = {"mean_sqnr_db": sqnr_of(1.0, float(np.mean(ratios))) if ratios else None} if per_sample else {}
    return {"sqnr_db": float("-inf") if any(broken) else (sqnr_of(signal, noise) if count else None), **more,
            "max_abs": float("inf") if any(broken) else max_abs,
            "mse": float("inf") if any(broken) else noise / max(count, 1),
            **({"nonfinite_samples": sum(broken)} if any(broken) else {})}


def _cosine_metrics(pairs: list, kind: str) -> dict:
    """Scores, embeddings, maps and state: cosine per sample, SQNR, errors, agreement of the argmax where the
    output is class or per-step scores; state outputs also their relative error (which judges them)."""
    ref, res, broken = _finite_pairs(pairs)
    cosines = [0.0 if bad else cosine(a, b) for a, b, bad in zip(ref, res, broken)]
    metrics = {"samples": len(pairs), "cosine_mean": float(np.mean(cosines)), "cosine_min": float(np.min(cosines)),
               **_errors(ref, res, broken, per_sample=True)}
    along = metrics["mean_sqnr_db"]  # the score meets a cosine target exactly when the gate's two rows do
    metrics["score"] = min(metrics["cosine_mean"], 1.0 if along is None else cosine_for_sqnr(along))
    per_sample = {"metric": "cosine", "higher_is_better": True}
    values = cosines
    scores = [(_ranked(a), _ranked(b)) for a, b in pairs if a.size]  # argmax sees -inf masks, never NaN
    if kind == "classification" and scores:
        hits = [_topk_hits(a, b, 1) for a, b in scores]
        metrics.update(_agreement("top1", hits))
        if len(scores) == len(pairs):  # aligned with the samples (none empty)
            per_sample["flips"] = _flips([a for a, _ in scores], hits)
        if scores[0][0].shape[-1] >= 10:
            metrics.update(_agreement("top5", [_topk_hits(a, b, 5) for a, b in scores]))
    elif kind in ("sequence", "ctc") and scores:
        metrics.update(_agreement("step", [(a.argmax(-1) == b.argmax(-1)).ravel() for a, b in scores]))
        if kind == "ctc":  # ctc.py: the text each side reads
            texts = ctc.text_metrics(*zip(*scores))
            metrics.update(_agreement("text", texts["same"]), char_error_rate=texts["char_error_rate"])
            per_sample = {"metric": "character error rate", "higher_is_better": False, "texts": texts["texts"]}
            values = texts["per_sample_rates"]
    elif kind == "state":
        values = [math.inf if bad else relative_error(a, b) for a, b, bad in zip(ref, res, broken)]
        metrics.update(rel_error=float(np.mean(values)), rel_error_max=float(np.max(values)),
                       score=cosine_equivalent(float(np.mean(values))))
        per_sample = {"metric": "relative error", "higher_is_better": False}
    return {**metrics, "per_sample": per_sample, "per_sample_values": values}


def _values_metrics(pairs: list, kind: str, threshold: float) -> dict:
    """A probability (values in [0, 1]; a two-class output's class 1), a regression head or a one-element
    output: absolute error, and for probabilities the share of decisions (value ≥ threshold) that agree; the
    others' relative error is taken over all samples, where it means something (over a one-element output it
    would not)."""
    ref, res, broken = _finite_pairs(pairs)
    flat_ref, flat_res = np.concatenate([a.ravel() for a in ref]), np.concatenate([b.ravel() for b in res])
    errors = np.abs(flat_ref - flat_res)
    metrics = {"samples": len(pairs), "mean_abs_error": float("inf") if any(broken) else float(errors.mean()),
               **_errors(ref, res, broken)}
    per_sample = [math.inf if bad else float(np.max(np.abs(a - b), initial=0.0))
                  for a, b, bad in zip(ref, res, broken)]
    if kind in ("probability", "binary"):
        hits = [((a >= threshold) == (b >= threshold)).ravel() & (not bad) for a, b, bad in zip(ref, res, broken)]
        metrics.update(_agreement("decision", hits), decision_threshold=threshold,
                       score=1.0 - min(1.0, metrics["mean_abs_error"]),
                       **({"positive_class": POSITIVE_CLASS} if kind == "binary" else {}))
    else:
        metrics["rel_error"] = math.inf if any(broken) else relative_error(flat_ref, flat_res)
        metrics["score"] = cosine_equivalent(metrics["rel_error"])
    if kind == "regression":  # shown, not judging (as a state's): over a few values per sample it says little
        cosines = [0.0 if bad else cosine(a, b) for a, b, bad in zip(ref, res, broken)]
        metrics.update(cosine_mean=float(np.mean(cosines)), cosine_min=float(np.min(cosines)))
    return {**metrics, "per_sample": {"metric": "max abs error", "higher_is_better": False},
            "per_sample_values": per_sample}


def _integer_metrics(pairs: list) -> dict:
    """Ids, labels, counts: the share of equal elements (a cosine over ids says little)."""
    hits = [(a == b).ravel() for a, b in pairs]
    metrics = {"samples": len(pairs), **_agreement("element", hits),
               "max_abs": max((float(np.max(np.abs(a - b))) for a, b in pairs if a.size), default=0.0)}
    metrics["score"] = metrics["element_agreement"]
    return {**metrics, "per_sample": {"metric": "element agreement", "higher_is_better": True},
            "per_sample_values": [float(h.mean()) if h.size else 1.0 for h in hits]}


def relative_error(reference: np.ndarray, result: np.ndarray) -> float:
    """‖result − reference‖ / ‖reference‖ (0 when both are zero, inf when only the reference is)."""
    noise = float(np.linalg.norm(np.asarray(result, np.float64) - np.asarray(reference, np.float64)))
    signal = float(np.linalg.norm(np.asarray(reference, np.float64)))
    if noise == 0:
        return 0.0
    return noise / signal if signal > 0 else math.inf


def cosine_equivalent(rel_error: float) -> float:
    """The cosine a relative error stands for when both vectors have the same norm: 1 − e²/2. How a cosine
    threshold and a relative error meet (a cosine of 0.99 allows a relative error of 0.141)."""
    return 1.0 - rel_error * rel_error / 2.0 if math.isfinite(rel_error) else -math.inf


def rel_error_for_cosine(cosine_threshold: float) -> float:
    """The inverse of cosine_equivalent: the largest relative error a cosine threshold allows."""
    return math.sqrt(2.0 * max(0.0, 1.0 - cosine_threshold))


# Cosine does not see an error along the signal: a scale, or a shift of an output that sits far from zero (a dB
# spectrogram read 0.99 at a low SQNR: BENCHMARKS.md: "ORT calibration ran a different model"). So a cosine threshold
# also holds a cosine-judged output's mean_sqnr_db (weighted per sample, as cosine_mean is) to the SQNR the threshold
# stands for, less this slack: twice the noise power, well beyond what the two differ by on outputs whose error is
# noise.
SQNR_SLACK_DB = 10 * math.log10(2.0)


def sqnr_for_cosine(cosine_threshold: float) -> float | None:
    """The least SQNR (dB) a cosine threshold accepts on a cosine-judged output (SQNR_SLACK_DB); None for a
    threshold of 1 (or more), which the cosine alone already holds to exactness."""
    rel_error = rel_error_for_cosine(cosine_threshold)
    return -20 * math.log10(rel_error) - SQNR_SLACK_DB if rel_error > 0 else None


def cosine_for_sqnr(sqnr: float) -> float:
    """The inverse of sqnr_for_cosine: the highest cosine threshold an SQNR meets (1 when exact)."""
    if sqnr == math.inf:
        return 1.0
    return max(-1.0, cosine_equivalent(10 ** (-(sqnr + SQNR_SLACK_DB) / 20))) if math.isfinite(sqnr) else -1.0


def _ranked(values: np.ndarray) -> np.ndarray:
    """Scores for argmax/top-k: NaN ranks last."""
    return np.where(np.isnan(values), -np.inf, values) if np.isnan(values).any() else values


def sqnr_db(reference: list[np.ndarray], result: list[np.ndarray]) -> float | None:
    """Signal-to-quantization-noise ratio in dB over arrays of matching shapes: Σ reference² / Σ error²;
    None when there is nothing to compare (no arrays, or only empty ones): no evidence, not a perfect match."""
    if sum(np.asarray(a).size for a in reference) == 0:
        return None
    noise = sum(float(np.sum((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2))
                for a, b in zip(reference, result))
    signal = sum(float(np.sum(np.asarray(a, np.float64) ** 2)) for a in reference)
    return sqnr_of(signal, noise)


def sqnr_of(signal: float, noise: float) -> float:
    """Σ reference² and Σ error² → SQNR in dB (sqnr_db; also for sums accumulated one sample at a time)."""
    if noise == 0:
        return float("inf")
    if not math.isfinite(noise):  # NaN/Inf in the error: no signal outweighs it
        return float("-inf")
    return 10 * math.log10(max(signal, 1e-300) / noise)


def _topk_hits(a: np.ndarray, b: np.ndarray, k: int) -> np.ndarray:
    """Per row of one sample: is the reference's top-1 class among the result's top-k? Ties rank by index, as
    argmax does (an INT8 model's dequantized scores tie often; quicksort would break them at random)."""
    a2, b2 = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
    top = np.argsort(-b2, axis=-1, kind="stable")[:, :k]
    return (top == a2.argmax(-1)[:, None]).any(-1)


def _flips(reference: list[np.ndarray], hits: list[np.ndarray]) -> list[dict | None]:
    """Per sample, None where every row kept the reference's top-1, else how near a tie that row was in the
    reference: `float_gap` (its top two scores apart) and `closer_than` (the share of all rows whose top two are
    further apart). A changed top-1 at a near tie is noise any rounding can cause (BENCHMARKS.md: "changed top-1s
    at near ties"); one at a clear margin is damage."""
    gaps = [_top_gaps(a) for a in reference]
    every = np.sort(np.concatenate(gaps)) if gaps else np.zeros(0)
    flips = []
    for gap, hit in zip(gaps, hits):
        if hit.all():
            flips.append(None)
            continue
        row = int(np.argmin(np.where(hit, np.inf, gap)))
        flips.append({"float_gap": float(gap[row]),
                      "closer_than": float(1.0 - np.searchsorted(every, gap[row], side="right") / every.size)})
    return flips


def _top_gaps(scores: np.ndarray) -> np.ndarray:
    rows = scores.reshape(-1, scores.shape[-1])
    if rows.shape[-1] < 2:
        return np.full(rows.shape[0], np.inf)
    top = np.partition(rows, -2, axis=-1)[:, -2:]
    return top[:, 1] - top[:, 0]


def _agreement(prefix: str, hits: list[np.ndarray]) -> dict:
    """The agreement of one sample set from each sample's hits (its rows, steps, pixels or elements).

    The samples are the independent draws, not their steps: the 40 steps of one text line or the pixels of
    one image err together. So the figure is the mean over samples of each sample's share of hits, and its
    95% interval is the Wilson interval of that share with n = samples (each sample one observation; wider
    than counting steps, and honest at 100%). `_se` is the standard error of that mean (the search's margin,
    quantize/search.judge). None (not measured) when no sample has a hit to count."""
    shares = [float(h.mean()) for h in hits if h.size]
    rate = float(np.mean(shares)) if shares else None
    low, high = wilson_interval(sum(shares), len(shares))
    error = float(np.std(shares, ddof=1) / math.sqrt(len(shares))) if len(shares) > 1 else None
    return {f"{prefix}_agreement": rate, f"{prefix}_agreement_ci95": [low, high],
            f"{prefix}_agreement_se": error, f"{prefix}_count": len(shares)}


def wilson_interval(successes: float, total: int, z: float = 1.96) -> tuple[float | None, float | None]:
    """95% Wilson score interval: honest at 100% agreement on few samples, unlike the normal approximation;
    (None, None) with no samples. `successes` may be fractional (a sum of per-sample shares)."""
    if total == 0:
        return None, None
    p = successes / total
    denom = 1 + z * z / total
    centre = (p + z * z / (2 * total)) / denom
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)
