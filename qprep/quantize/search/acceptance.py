"""Whether a float set meets the target: chosen on some samples, accepted on others.

The evaluation samples are split (`split_samples`, `accept_share` interleaved) into the ones every choice of the
search is made on (ranking, promotion, the backends' settings) and the ones kept apart; a float set meets the
target only when it holds on both, with one standard error to spare where the samples carry it (`judge`).
Why: chosen and judged on the same samples, a float set meets the target by less than its own noise and falls
short on the next samples (BENCHMARKS.md: "the search's acceptance split"). `score_of` is the smooth number the
search climbs between two verdicts of the gate.
"""

from __future__ import annotations

import math
import statistics
from typing import Callable

from qprep.measure.gate import check_gate

MIN_SPLIT = 8  # samples on each side of the selection/acceptance split, or no split
MIN_GAIN = 0.01  # a promoted block must remove at least this share of the remaining error (1 - score)


def split_samples(samples: list[dict], share: float) -> tuple[list[dict], list[dict]]:
    """(selection, acceptance): `share` (at most half) of the samples kept apart, spread evenly over the list
    (folders sorted by class or source split alike). No split when either side would hold fewer than
    MIN_SPLIT samples: a target judged on 5 samples says nothing."""
    count = int(round(len(samples) * min(share, 0.5)))
    if count < MIN_SPLIT or len(samples) - count < MIN_SPLIT:
        return list(samples), []
    apart = {int((k + 0.5) * len(samples) / count) for k in range(count)}
    return ([s for i, s in enumerate(samples) if i not in apart], [s for i, s in enumerate(samples) if i in apart])


def judge(target: dict, outputs: dict, float_nodes: set[str], evaluate: Callable[[set[str], list[dict]], dict],
          acceptance: list[dict]) -> dict:
    """The gate on the samples the search chooses on (`outputs`) and, when it holds there and samples were kept
    apart, on those (the same build, run on them): {"passed", "checks", "margin": {metric: standard error},
    "unseen": {"passed", "metrics", "samples", "standard_error"}}.

    The search stops at the first float set that meets the target, so a figure that meets it by less than its
    own noise is the usual case, and it falls short on the next samples. Each figure therefore passes with
    one standard error to spare where the samples can carry it:
    - an agreement on the samples chosen on (one flip of 96 is 1%: a 97% target met by two flips there fell
      short on held-out samples). On the few kept apart it passes unless its 95% interval lies below the
      threshold: with 32 samples one flip is 3%.
    - a cosine_mean on the samples kept apart (met there by less than its standard error, it fell short on
      held-out samples).
    The cases measured: BENCHMARKS.md, "a margin on the samples kept apart" and "agreements judged with their
    sample count"."""
    gate = check_gate(target, outputs)
    if gate["passed"]:
        lowered, margin = _agreements_less_one_standard_error(outputs)
        if margin and not check_gate(target, lowered)["passed"]:
            gate = {**gate, "passed": False, "margin": margin}
    if gate["passed"] and acceptance:
        measured = evaluate(float_nodes, acceptance)
        lowered, errors = _cosines_less_one_standard_error(measured)
        unseen = check_gate(target, lowered, undecided_passes=True)
        gate = {**gate, "passed": unseen["passed"],
                "unseen": {"passed": unseen["passed"], "metrics": gate_metrics(check_gate(target, measured)),
                           "samples": len(acceptance), **({"standard_error": errors} if errors else {})}}
    return gate


def _cosines_less_one_standard_error(outputs: dict) -> tuple[dict, dict[str, float]]:
    """`outputs` with each cosine_mean lowered by the standard error of its per-sample cosines → (outputs,
    {output: standard error})."""
    lowered, errors = {}, {}
    for name, metrics in outputs.items():
        per_sample = metrics.get("per_sample") or {}
        values = [v for v in per_sample.get("values", []) if v is not None]
        if "cosine_mean" in metrics and per_sample.get("metric") == "cosine" and len(values) > 1:
            errors[name] = statistics.stdev(values) / math.sqrt(len(values))
            metrics = {**metrics, "cosine_mean": metrics["cosine_mean"] - errors[name]}
        lowered[name] = metrics
    return lowered, errors


def _agreements_less_one_standard_error(outputs: dict) -> tuple[dict, dict[str, float]]:
    """`outputs` with each agreement lowered by the standard error of its per-sample shares (metrics._agreement's
    `_se`) → (outputs, {"output.metric": standard error})."""
    lowered, errors = {}, {}
    for name, metrics in outputs.items():
        for key in [k for k, v in metrics.items() if k.endswith("_agreement") and v is not None]:
            if metrics.get(f"{key}_se"):
                errors[f"{name}.{key}"] = metrics[f"{key}_se"]
                metrics = {**metrics, key: metrics[key] - metrics[f"{key}_se"]}
        lowered[name] = metrics
    return lowered, errors


def allowed_disagreement(threshold: float, samples: int) -> float:
    """The largest disagreement share d that an agreement meets `threshold` with, one standard error to spare
    on `samples` samples (judge: 1 − d − √(d(1 − d)/n) ≥ threshold, the binomial standard error): 97% on 96
    samples allows 1.7% (one flip passes, two do not), 100% allows none."""
    room, n = max(0.0, 1.0 - threshold), max(1, samples)
    if room == 0.0:
        return 0.0
    # the smaller root of (room − d)² = d(1 − d)/n
    a, b = 1.0 + 1.0 / n, 2.0 * room + 1.0 / n
    return (b - math.sqrt(max(0.0, b * b - 4.0 * a * room * room))) / (2.0 * a)


def gate_metrics(gate: dict) -> dict:
    return {c["metric"]: c["value"] for c in gate.get("checks", [])}


def score_of(outputs: dict, target: dict) -> float:
    """The smooth number the search climbs: the worst output's `score` (measure/metrics.py: its cosine_mean
    where cosine judges it, the cosine its relative error stands for, 1 − absolute error for probabilities;
    agreement is too coarse to rank single nodes on a few samples); the target itself is checked with the gate.
    Outputs that could not be measured are left out; metrics without a score are read by their cosine_mean."""
    named = {key.rpartition(".")[0] for key in target} - {""}
    scores = {name: m.get("score", m.get("cosine_mean")) for name, m in outputs.items()}
    values = [v for name, v in scores.items() if (not named or name in named) and v is not None]
    return float("-inf") if not values or any(math.isnan(v) for v in values) else min(values)
