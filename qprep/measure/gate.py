"""The accuracy gate: report metric names → thresholds; a miss makes the run exit 1 (after the report).

`cosine_mean: 0.99` applies to every output that is judged by cosine (the worst one decides); an output of
another kind (metrics.JUDGED_BY) is held to its own main metric instead, at the threshold that cosine stands
for: a relative error of √(2 (1 − 0.99)) = 0.141 for state and one-element outputs and sorted TopK/NMS values
(the error that gives that cosine at equal norms), 0.99 of decisions, elements, boxes or ids for
probabilities, integers, matched boxes and id sets. An agreement of decisions (a label, a probability's decision,
ids: one observation per sample) is held instead to the gate's `top1_agreement` when one is set (the same
question asked of the same samples), else to the agreement a good INT8 result meets on that many samples
(`agreement_target`, never above the cosine threshold): at 0.99, 80 samples would allow no flip, and one near-tie
flip that the probabilities' own top-1 shows too failed the label alone. `cosine_min` likewise (a state's worst sample:
`rel_error_max`). On the outputs cosine judges, `cosine_mean` also holds `mean_sqnr_db` (the SQNR weighted
per sample, as the cosine is) to what the threshold stands for less 3 dB (metrics.SQNR_SLACK_DB; 13.98 dB for
0.99): cosine cannot see an error along the signal, a scale or the shift of an output far from zero. Any other
metric applies to the outputs that report it; `<output>.<metric>` to one output. Similarities are minimums,
errors maximums. A figure that could not be measured fails a gate; the floor (the gate used when none is
configured, to catch a collapse) skips it and says so. `metric` and `metric_drop` read the user's own metric
(user_metric.py), whose entry sits beside the outputs': `metric` a minimum, or a maximum for a metric whose lower
is better; `metric_drop` (how much worse than FP32) a maximum.

An agreement is a rate over samples: on 48 samples one flip moves it 2.1%, so a 97% threshold inside the
figure's 95% interval is marked `undecided` (the sample count cannot tell it from the threshold), and with
`undecided_passes` (the fallback's few samples kept apart) such a figure passes: only one clearly below fails.
The user's metric gets the same mark from its own interval (user_metric.spread).
"""

from __future__ import annotations

import math

from qprep.measure.metrics import higher_is_better, rel_error_for_cosine, sqnr_for_cosine
from qprep.measure.user_metric import ENTRY, KEYS

COSINE = ("cosine_mean", "cosine_min")
DECISIONS = ("decision_agreement", "element_agreement", "set_agreement")  # a cosine key may stand for them
GOOD_FLIPS = 0.02  # a good INT8 classifier's top-1 flips against FP32 (BENCHMARKS.md: 97.7-99.2% held out)
ODDS = 0.95  # the share of such results a sample-count-aware target lets pass


def check_gate(gate: dict[str, float], outputs: dict[str, dict], floor: bool = False,
               undecided_passes: bool = False) -> dict:
    checks = []
    for key, threshold in gate.items():
        output, _, metric = key.rpartition(".")
        if metric in KEYS and not output:
            checks.append(_user_check(key, threshold, outputs.get(ENTRY), floor))
            continue
        names = [output] if output else [name for name in outputs if name != ENTRY]
        direct, replaced = [], []
        for name in names:
            m = outputs.get(name)
            held = None if m is None else held_to(metric, threshold, m, gate)
            if held is None:
                continue
            (direct if held[0] == metric else replaced).append((name, *held))
        if not direct and not replaced:
            if not floor:
                checks.append({"metric": key, "threshold": threshold, "value": None, "passed": False,
                               "reason": f"no output reports '{metric}'"})
            continue
        if direct:
            checks.append(_check(key, threshold, [outputs[name][metric] for name, *_ in direct],
                                 [name for name, *_ in direct], floor))
            if metric == "cosine_mean" and not any(k.endswith("mean_sqnr_db") for k in gate):  # not set already
                checks.append(_along_signal(key, threshold, {name: outputs[name] for name, *_ in direct}, floor))
        for name, used, limit in replaced:
            check = _check(f"{name}.{used}", limit, [outputs[name][used]], [name], floor)
            why = _decided_as(used, limit, threshold, gate, outputs[name].get(used.replace("_agreement", "_count")))
            checks.append({**check, "stands_for": f"{metric} {threshold}{why}"})
    checks = [_undecided(c, outputs, undecided_passes) for c in checks if c is not None]
    return {"passed": all(c["passed"] for c in checks), "checks": checks, **({"source": "floor"} if floor else {})}


def held_to(metric: str, threshold: float, output: dict, gate: dict | None = None) -> tuple[str, float] | None:
    """(metric, threshold) an output is held to for a gate key: a cosine key on an output not judged by cosine
    becomes its main metric (see the module doc); None when the key does not apply to the output."""
    judged = output.get("judged_by") or []
    if metric in COSINE and judged and "cosine_mean" not in judged:
        used = "rel_error_max" if metric == "cosine_min" and "rel_error_max" in judged else judged[0]
        if used.startswith("rel_error"):
            return used, rel_error_for_cosine(threshold)
        if metric == "cosine_mean" and used in DECISIONS:
            return used, decisions_target(threshold, output.get(used.replace("_agreement", "_count")), gate or {})
        return used, threshold
    return (metric, threshold) if metric in output else None


def decisions_target(threshold: float, samples: int | None, gate: dict) -> float:
    """The agreement a cosine threshold holds an output of decisions to (the module doc): the gate's own
    `top1_agreement`, else agreement_target on the samples counted, at most the cosine threshold."""
    if isinstance(gate.get("top1_agreement"), (int, float)):
        return gate["top1_agreement"]
    return min(threshold, agreement_target(samples)[0]) if samples else threshold


def agreement_target(samples: int) -> tuple[float, int]:
    """(target, flips it allows): the agreement a good INT8 result (GOOD_FLIPS of its samples flip) meets with
    ODDS on `samples`, rounded down to a percent. Why: a fixed 0.97 needs 32 of 32 (one flip is 3.1%), a miss
    that says nothing about the result; the target rises with the sample count (0.97 from about 500)."""
    flips, odds = 0, (1 - GOOD_FLIPS) ** samples
    while odds < ODDS or flips == 0:  # at least one flip: a single one never misses the default
        flips += 1
        odds += math.comb(samples, flips) * GOOD_FLIPS ** flips * (1 - GOOD_FLIPS) ** (samples - flips)
    return math.floor(100 * (samples - flips) / samples) / 100, flips


def _decided_as(used: str, limit: float, threshold: float, gate: dict, samples: int | None) -> str:
    """Why a decisions' agreement is held to another figure than the cosine threshold (empty when it is not)."""
    if used not in DECISIONS or limit == threshold:
        return ""
    if isinstance(gate.get("top1_agreement"), (int, float)) and limit == gate["top1_agreement"]:
        return ", as decisions: the gate's top1_agreement"
    return f", as decisions: the agreement a good INT8 result meets on {samples} samples"


def _user_check(key: str, threshold: float, figures: dict | None, floor: bool) -> dict | None:
    """The user's metric against its threshold: no output is the worst one, the check names the function and
    both figures instead."""
    if figures is None:
        return None if floor else {"metric": key, "threshold": threshold, "value": None, "passed": False,
                                   "reason": "not measured (no evaluation.metric figures)"}
    minimum = key == "metric" and figures["direction"] == "higher"
    value = figures[key]
    return {"metric": key, "threshold": threshold, "value": value, "kind": "minimum" if minimum else "maximum",
            "passed": bool(value >= threshold if minimum else value <= threshold),
            "stands_for": f"{figures['function']}: FP32 {figures['reference_metric']:.4g}, result "
                          f"{figures['metric']:.4g} on {figures['samples']} samples"}


def _along_signal(key: str, threshold: float, outputs: dict[str, dict], floor: bool) -> dict | None:
    """The mean_sqnr_db row a cosine_mean threshold brings (metrics.sqnr_for_cosine): one row, the worst
    output; none for a threshold of 1 or where no output has the figure (no sample with a signal)."""
    limit = sqnr_for_cosine(threshold)
    measured = {name: m["mean_sqnr_db"] for name, m in outputs.items() if m.get("mean_sqnr_db") is not None}
    if limit is None or not measured:
        return None
    output = key.rpartition(".")[0]
    check = _check(f"{output}.mean_sqnr_db" if output else "mean_sqnr_db", limit, list(measured.values()),
                   list(measured), floor)
    return check and {**check, "stands_for": f"{key} {threshold}: an error along the signal, which cosine "
                                             "does not see"}


def _check(key: str, threshold: float, values: list, names: list[str], floor: bool) -> dict | None:
    minimum = higher_is_better(key)
    measured = [(v, n) for v, n in zip(values, names) if v is not None]
    if not measured:
        if floor:
            return None  # the floor catches collapses; an output with no comparable sample is noted elsewhere
        return {"metric": key, "threshold": threshold, "value": None, "passed": False,
                "kind": "minimum" if minimum else "maximum", "reason": "not measured (no comparable sample)"}
    value, worst = (min if minimum else max)(measured, key=lambda pair: pair[0])
    if any(isinstance(v, float) and math.isnan(v) for v, _ in measured):  # min/max would skip a NaN; the gate must not
        value = float("nan")
    passed = bool(value >= threshold if minimum else value <= threshold)
    check = {"metric": key, "threshold": threshold, "value": value, "passed": passed,
             "kind": "minimum" if minimum else "maximum", "worst_output": worst}
    if len(measured) < len(values):
        check["reason"] = f"not measured on {len(values) - len(measured)} output(s)"
        check["passed"] = passed and floor
    return check


def _undecided(check: dict, outputs: dict, passes: bool) -> dict:
    """An agreement check whose threshold lies inside the worst output's 95% interval, or a check of the user's
    metric inside its own (user_metric.intervals): marked, and passed when `passes` (see the module doc)."""
    output, _, metric = check["metric"].rpartition(".")
    if metric in KEYS and not output:
        m = outputs.get(ENTRY) or {}
        count = m.get("samples", "?")
    elif metric.endswith("_agreement"):
        m = outputs.get(check.get("worst_output"), {})
        count = m.get(metric.replace("_agreement", "_count"), "?")
    else:
        return check
    interval = m.get(f"{metric}_ci95")
    if not interval or None in interval or check["value"] is None:
        return check
    low, high = interval
    inside = low <= check["threshold"] < high if check.get("kind") == "maximum" else low < check["threshold"] <= high
    if inside:
        shown = f"{low:.4g}–{high:.4g}" if m is outputs.get(ENTRY) else f"{100 * low:.1f}–{100 * high:.1f}%"
        check = {**check, "undecided": f"{count} samples: 95% interval {shown} holds the threshold"}
        if passes and not check["passed"] and "reason" not in check:
            check["passed"] = True
    return check
