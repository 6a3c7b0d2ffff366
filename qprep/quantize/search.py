"""Accuracy-driven fallback: keep the fewest nodes float until an accuracy target holds.

Why measured, not by op type: on EfficientNet-Lite0 excluding the 16 depthwise convolutions made the model
*worse*, and restoring the most harmful nodes together is not the sum of restoring each one. So:

1. rank: quantize everything once (the base), then restore one candidate at a time and measure the outputs
   on a subset of the evaluation samples; a candidate's damage is how much its restoring helps. A candidate is
   a node, or a group of nodes that only together keep something float (ORT: an activation edge).
2. promote: add nodes in ranked order (`block` at a time, for backends where one build takes minutes),
   re-quantize and re-evaluate on all evaluation samples; a block that does not improve the outputs is dropped
   again. Then rank the rest again on top of the new float set (harm interacts) and promote again. Stop when
   the target holds, at `max_float_nodes`, when nothing helps any more, or when the time budget is spent.

The best float set found is always returned (the target met with the fewest float nodes, else the best score);
the backend builds its final model from it. Backends plug in with `evaluate(float_nodes, samples) → per-output
metrics` (FP32 reference outputs and calibration statistics computed once by the caller) and, where one trial
per node is too slow (RKNN), `rank(float_nodes) → [{node, gain}]` from the backend's own per-layer analysis.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Callable

from qprep.evaluate.gate import check_gate
from qprep.schema import Key, section

log = logging.getLogger("qprep")

OPTIONS = section(
    "accuracy-driven fallback: nodes kept float, most harmful first, until `target` holds",
    nullable=True,
    target=Key("mapping", item=Key("float"), required=True,
               doc="metric → threshold in the evaluation gate's form, e.g. {cosine_mean: 0.99, top1_agreement: 0.97}"),
    max_float_nodes=Key("int", default=32, minimum=1, doc="at most this many nodes made float by the fallback"),
    time_budget_s=Key("float", default=600.0, minimum=1, doc="stop searching after this many seconds"),
    rank_samples=Key("int", default=32, minimum=1, doc="evaluation samples used to rank nodes (all are used to accept)"),
    max_candidates=Key("int", default=96, minimum=1,
                       doc="rank at most this many nodes by trials (those whose outputs lose the most accuracy first)"),
    block=Key("int", default=1, minimum=1, doc="nodes promoted per trial (RKNN: one build takes minutes)"),
)


MIN_GAIN = 0.01  # a promoted block must remove at least this share of the remaining error (1 - score)
MIN_COST = 0.01  # candidates below 1% of the model's compute are ranked by gain alone
FAST_SHARE = 0.25  # of the budget, left to a backend's faster builds (RKNN mmse: ~7 s trials vs ~3 min)


@dataclass
class Trial:
    phase: str  # base | rank | promote
    float_nodes: tuple[str, ...]  # candidates made float by the search (beside the base float set)
    added: tuple[str, ...]  # what this trial added to the float set it started from
    nodes: int  # graph nodes those candidates make float
    score: float
    metrics: dict
    passed: bool
    seconds: float
    accepted: bool = False

    def record(self) -> dict:
        return {"phase": self.phase, "float_nodes": self.nodes, "added": list(self.added),
                "score": self.score, "metrics": self.metrics, "passed": self.passed, "accepted": self.accepted,
                "seconds": round(self.seconds, 2)}


@dataclass
class Outcome:
    float_nodes: list[str]
    passed: bool
    record: dict


def score_of(outputs: dict, target: dict) -> float:
    """The smooth number the search climbs: the worst output's cosine_mean (agreement is too coarse to rank
    single nodes on a few samples); the target itself is checked with the gate."""
    named = {key.rpartition(".")[0] for key in target} - {""}
    values = [m["cosine_mean"] for name, m in outputs.items() if (not named or name in named) and "cosine_mean" in m]
    return float("-inf") if not values or any(math.isnan(v) for v in values) else min(values)


def search(evaluate: Callable[[set[str], list[dict]], dict], candidates: list[str], base_float: set[str],
           samples: list[dict], options: dict, describe: Callable[[str], str] = str, progress=None,
           rank: Callable[[tuple[str, ...]], list[dict]] | None = None, started: float | None = None,
           groups: dict[str, tuple[str, ...]] | None = None, cost: dict[str, float] | None = None,
           faster: Callable[[set[str]], bool] | None = None) -> Outcome:
    """`started`: when the backend's own fallback work began (perf_counter), so the budget covers it too.
    `groups`: candidates that stand for several nodes (ORT: an activation edge is float only when its producer
    and every consumer are); other candidates are node names. `cost`: each candidate's share of the model's
    compute; given, candidates are promoted by gain per cost, so the target is met with the cheapest float set
    (on EfficientNet-Lite0 the most harmful edges are the high-resolution early layers, the slowest in float).
    `faster(float_nodes)`: asked once, when the next trial would end in the last FAST_SHARE of the budget, to
    build from then on in a faster, approximate way starting from the build of `float_nodes` (the accepted set);
    True if it does (else the slow trials go on to the end of the budget)."""
    started = time.perf_counter() if started is None else started
    groups = groups or {}

    def nodes(candidates) -> set[str]:
        return {n for c in candidates for n in groups.get(c, (c,))} - base_float

    target, budget = options["target"], options["time_budget_s"]
    rank_samples = samples[: options["rank_samples"]]
    trials: list[Trial] = []

    def elapsed() -> float:
        return time.perf_counter() - started

    def trial(phase: str, start: tuple[str, ...], added: tuple[str, ...], on: list[dict]) -> Trial:
        t0 = time.perf_counter()
        made_float = nodes(start + added)
        outputs = evaluate(base_float | made_float, on)
        gate = check_gate(target, outputs) if on is samples else {"passed": False}
        metrics = {c["metric"]: c["value"] for c in gate.get("checks", [])}
        result = Trial(phase, start + added, added, len(made_float), score_of(outputs, target), metrics,
                       gate["passed"], time.perf_counter() - t0)
        trials.append(result)
        return result

    def say(message: str) -> None:
        log.info("fallback: %s", message)
        if progress is not None:
            progress.note(f"fallback: {message}")

    base = trial("base", (), (), samples)
    base.accepted = True
    say(f"base (all quantized): score {base.score:.5f}, target {'met' if base.passed else 'missed'} "
        f"({_metrics_text(base.metrics)})")
    best, current, stop = base, base, "target met" if base.passed else ""
    ranking: list[dict] = []
    remaining = list(candidates if rank is not None else candidates[: options["max_candidates"]])
    chosen: tuple[str, ...] = ()
    gains: dict[str, float] = {}  # promoted node → its gain in the round that promoted it
    fast_from: int | None = None  # index of the first trial built the faster way
    round_index = 0
    while not stop:
        round_index += 1
        if rank is not None:
            ranked = [row for row in rank(chosen) if row["node"] in remaining]
        else:
            ranked = _rank(trial, chosen, remaining, rank_samples, elapsed, budget, say, round_index)
        if round_index == 1:
            ranking = ranked
        if cost:
            ranked = sorted(ranked, key=lambda row: -row["gain"] / max(cost.get(row["node"], 0.0), MIN_COST))
        helpful = [row["node"] for row in ranked if row["gain"] > 0]
        say(f"round {round_index}: {len(helpful)} of {len(ranked)} candidates help when kept float; promoting in "
            f"blocks of {options['block']}")
        promoted, capped = 0, False
        for start in range(0, len(helpful), options["block"]):
            last = next((t.seconds for t in reversed(trials[fast_from or 0:]) if t.phase == "promote"), 0.0)
            if elapsed() + last > budget * (1 - FAST_SHARE) and faster is not None and fast_from is None:
                if faster(base_float | nodes(chosen)):
                    fast_from, last = len(trials), 0.0
                    say("the last quarter of the budget: the trials left build the faster way")
                else:
                    faster = None
            if elapsed() + last > budget:  # a trial that would end past the budget is not started
                stop = "time budget spent"
                break
            block = tuple(helpful[start:start + options["block"]])
            if len(nodes(chosen + block)) > options["max_float_nodes"]:
                capped = True  # a smaller candidate further down may still fit
                continue
            t = trial("promote", chosen, block, samples)
            # a float node must pay for itself: at least 1% of the error left (noise-level gains are refused)
            if t.passed or t.score - current.score >= MIN_GAIN * (1.0 - current.score):
                t.accepted, chosen, current, promoted = True, chosen + block, t, promoted + len(block)
                gains.update({row["node"]: row["gain"] for row in ranked if row["node"] in block})
                best = t if _better(t, best) else best
            say(f"{'+' if t.accepted else '-'} {', '.join(block)}: score {t.score:.5f} "
                f"({_metrics_text(t.metrics)}){' target met' if t.passed else ''}")
            if t.passed:
                stop = "target met"
                break
        remaining = [n for n in remaining if n not in chosen]
        if not stop and capped:  # the cap is (nearly) full: another round would only rank
            stop = f"max_float_nodes ({options['max_float_nodes']}) reached"
        elif not stop and (not promoted or not remaining):
            stop = "no candidate left that helps"
        elif not stop and elapsed() > budget:
            stop = "time budget spent"
    made_float, seen = [], set(base_float)
    for candidate in best.float_nodes:  # each node once, with the candidate (and its gain) that made it float
        for node in groups.get(candidate, (candidate,)):
            if node not in seen:
                seen.add(node)
                made_float.append({"node": node, "what": describe(node), "gain": gains.get(candidate),
                                   **({"via": f"{candidate} ({describe(candidate)})"} if candidate in groups else {})})
    record = {
        "target": target, "passed": best.passed, "stopped": stop, "seconds": round(elapsed(), 1),
        "float_nodes": made_float,
        "base": {"score": base.score, "metrics": base.metrics},
        "best": {"score": best.score, "metrics": best.metrics},
        "ranking": [{**row, "what": describe(row["node"])} for row in ranking[:50]], "ranked": len(ranking),
        "candidates": len(candidates), "rounds": round_index,
        "trials": [t.record() for t in trials if t.phase != "rank"],
        "rank_trials": sum(t.phase == "rank" for t in trials), "ranked_by": "trials" if rank is None else "analysis",
        **({"faster_from_trial": sum(t.phase != "rank" for t in trials[:fast_from])} if fast_from is not None else {}),
    }
    if not best.passed:
        record["why"] = _why(best, ranking, stop)
    return Outcome(sorted(base_float | nodes(best.float_nodes)), best.passed, record)


def remembered(evaluate: Callable[[set[str], list[dict]], dict], setting: Callable[[], object]):
    """`evaluate` remembered per (backend setting, float set, number of samples): the range trial, the op-type
    phase and the search's base all ask for the same build on the same samples. Samples are always a prefix of
    the evaluation samples, so their number names them."""
    results: dict = {}

    def evaluate_once(float_nodes: set[str], samples: list[dict]) -> dict:
        key = (setting(), frozenset(float_nodes), len(samples))
        if key not in results:
            results[key] = evaluate(float_nodes, samples)
        return results[key]

    return evaluate_once


def choose_setting(setting: str, configured: str, alternatives: list[str], use: Callable[[str], None],
                   evaluate: Callable[[set[str], list[dict]], dict], base_float: set[str], samples: list[dict],
                   target: dict, progress=None, min_gain: float = MIN_GAIN) -> dict:
    """A backend setting (e.g. how activation ranges are chosen) measured at the outputs before any node is
    made float: the configured value first and, if the target is missed, each alternative. An alternative is
    kept if it meets the target, or if it removes at least `min_gain` of the configured value's error
    (1 - score) and scores best; a backend whose alternative makes every later trial slower asks for more."""
    outputs = evaluate(base_float, samples)
    scores, passed = {configured: score_of(outputs, target)}, check_gate(target, outputs)["passed"]
    chosen = configured
    for alternative in [] if passed else alternatives:
        if progress is not None:
            progress.note(f"fallback: trying {setting}: {alternative}")
        use(alternative)
        outputs = evaluate(base_float, samples)
        scores[alternative] = score = score_of(outputs, target)
        if check_gate(target, outputs)["passed"]:
            chosen = alternative
            break
        if score - scores[configured] >= min_gain * (1.0 - scores[configured]) and score > scores[chosen]:
            chosen = alternative
    use(chosen)
    message = f"{setting}: {chosen} kept ({', '.join(f'{k} {v:.5f}' for k, v in scores.items())})"
    log.info("fallback: %s", message)
    if progress is not None and len(scores) > 1:
        progress.note(f"fallback: {message}")
    return {"setting": setting, "configured": configured, "chosen": chosen, "scores": scores}


def _rank(trial, chosen: tuple[str, ...], pool: list[str], rank_samples: list[dict], elapsed, budget: float, say,
          round_index: int) -> list[dict]:
    """Each node's gain when it alone joins the float set. Re-ranked every round on top of the nodes already
    float, because harm interacts: an edge between two quantized nodes is only float when both are."""
    base = trial("rank", chosen, (), rank_samples)
    say(f"round {round_index}: ranking {len(pool)} candidates on {len(rank_samples)} samples")
    rows = []
    for index, node in enumerate(pool):
        if elapsed() > budget * (0.5 if round_index == 1 else 0.9):  # leave time to promote
            say(f"ranking stopped after {index} nodes (time budget)")
            break
        t = trial("rank", chosen, (node,), rank_samples)
        rows.append({"node": node, "gain": t.score - base.score})
    return sorted(rows, key=lambda row: -row["gain"])


def _better(a: Trial, b: Trial) -> bool:
    if a.passed != b.passed:
        return a.passed
    if a.passed:
        return (a.nodes, -a.score) < (b.nodes, -b.score)
    return a.score > b.score


def _metrics_text(metrics: dict) -> str:
    return ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items())


def _why(best: Trial, ranking: list[dict], stop: str) -> str:
    missed = ", ".join(f"{k} {v:.4f}" for k, v in best.metrics.items() if isinstance(v, float))
    helpful = sum(r["gain"] > 0 for r in ranking)
    reason = (f"target not met ({stop}); best: {missed} with {best.nodes} float nodes; "
              f"{helpful} of {len(ranking)} candidates ranked first helped when kept float")
    if stop.startswith("no candidate"):
        return (reason + ": the remaining error is spread over many layers (see the per-layer table; try more "
                "calibration data or another backend mode)")
    return reason + ": raise time_budget_s / max_float_nodes to search further"
