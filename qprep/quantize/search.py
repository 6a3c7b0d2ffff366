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

Chosen on some samples, accepted on others: the evaluation samples are split (`accept_share`, interleaved) into
the ones every choice is made on (ranking, promotion, the backends' settings) and the ones kept apart; a float
set meets the target only when it holds on both (`judge`). Chosen and judged on the same samples, PP-OCR cls met
cosine 0.9995 at 0.99969 and scored 0.9931 on samples it had not seen.

The best float set found is always returned (the target met with the fewest float nodes, else the best score);
the backend builds its final model from it. A backend plugs in as a `SearchBackend`: `evaluate(float_nodes,
samples) → per-output metrics` (FP32 reference outputs and calibration statistics computed once by the caller)
and, where one trial per node is too slow (RKNN), `rank(chosen) → [{node, gain}]` from its own per-layer
analysis; `Search(backend, Candidates(...), ...).run()` is the search.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

from qprep.evaluate.gate import check_gate
from qprep.quantize.budget import Budget
from qprep.schema import Key, section

log = logging.getLogger("qprep")

SEARCHED_NODES = 32  # the node search's cap when max_float_nodes is not configured

OPTIONS = section(
    "accuracy-driven fallback: nodes kept float, most harmful first, until `target` holds",
    nullable=True,
    target=Key("mapping", item=Key("float"), required=True,
               doc="metric → threshold in the evaluation gate's form, e.g. {cosine_mean: 0.99, top1_agreement: 0.97}"),
    max_float_nodes=Key("int", minimum=1,
                        doc="at most this many nodes made float by the fallback, the spread set's included (rknn: "
                            "float16 layers of the RKNN model, which fuses e.g. a MatMul and its bias Add into one); "
                            f"unset: {SEARCHED_NODES} nodes searched one by one, beside the spread set, which its own "
                            "thresholds bound (channel_spread.py)"),
    time_budget_s=Key("float", default=600.0, minimum=1,
                      doc="the fallback ends within this many seconds (best model kept): a step that would not "
                          "finish in time, predicted from the steps measured so far, is not started"),
    rank_samples=Key("int", default=32, minimum=1,
                     doc="evaluation samples used to rank nodes (all those the search chooses on judge promotions)"),
    accept_share=Key("float", default=0.25, minimum=0,
                     doc="share of the evaluation samples (at most 0.5) kept apart from every choice of the search: "
                         "a float set that meets the target on the others is accepted only if it meets it on these "
                         "too (an agreement within its 95% interval of the threshold counts); 0: choose and accept "
                         "on the same samples"),
    max_candidates=Key("int", default=96, minimum=1,
                       doc="rank at most this many nodes by trials (those whose outputs lose the most accuracy first)"),
    block=Key("int", default=1, minimum=1, doc="nodes promoted per trial (RKNN: one build takes minutes)"),
)


ENOUGH_GAIN = 2.0  # round 1 ranks until its gains add up to this many times what the target still needs
MIN_RANKED = 8  # … and at least this many candidates
MIN_SPLIT = 8  # samples on each side of the selection/acceptance split, or no split
MIN_GAIN = 0.01  # a promoted block must remove at least this share of the remaining error (1 - score)
MIN_COST = 0.01  # candidates below 1% of the model's compute are ranked by gain alone
FAST_SHARE = 0.25  # of the budget, left to a backend's faster builds (RKNN mmse: ~7 s trials vs ~3 min)


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
    - an agreement on the samples chosen on (one flip of 96 is 1%: EfficientNet-Lite0 on RKNN, 97% target,
      met 97.9% there, 2 flips, and 100% on the 32 kept apart, then 96.9% on 128 held-out). On the few kept
      apart it passes unless its 95% interval lies below the threshold: with 32 samples one flip is 3%.
    - a cosine_mean on the samples kept apart (all-MiniLM-L6-v2 on RKNN, cosine 0.99: 0.99004 on the 32 kept
      apart, 0.9896 on 128 held-out; with the margin the search went on to 0.99112 − 0.00068 there, 0.9907
      held-out, 15 float16 layers)."""
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
    unseen: dict | None = None  # the gate on the samples kept apart (judged only when the others pass)
    margin: dict | None = None  # {output.metric: standard error} when met only by less than it (judge)

    def record(self) -> dict:
        return {"phase": self.phase, "float_nodes": self.nodes, "added": list(self.added),
                "score": self.score, "metrics": self.metrics, "passed": self.passed, "accepted": self.accepted,
                "seconds": round(self.seconds, 2), **({"unseen": self.unseen} if self.unseen else {}),
                **({"margin": self.margin} if self.margin else {})}


@dataclass
class Outcome:
    float_nodes: list[str]
    passed: bool
    record: dict


def score_of(outputs: dict, target: dict) -> float:
    """The smooth number the search climbs: the worst output's `score` (evaluate/metrics.py: its cosine_mean
    where cosine judges it, the cosine its relative error stands for, 1 − absolute error for probabilities;
    agreement is too coarse to rank single nodes on a few samples); the target itself is checked with the gate.
    Outputs that could not be measured are left out; metrics without a score are read by their cosine_mean."""
    named = {key.rpartition(".")[0] for key in target} - {""}
    scores = {name: m.get("score", m.get("cosine_mean")) for name, m in outputs.items()}
    values = [v for name, v in scores.items() if (not named or name in named) and v is not None]
    return float("-inf") if not values or any(math.isnan(v) for v in values) else min(values)


class SearchBackend:
    """What the search asks a backend. `evaluate` is required; it times each build it makes in the search's
    budget (`Budget.record`, kind "trial" on all evaluation samples, "rank" on fewer), for the predictions. A backend whose builds take minutes ranks the
    candidates from its own per-layer analysis (`ranks_itself` and `rank`) instead of one trial per candidate;
    one that can build faster, approximately, says so in `faster`."""

    ranks_itself = False

    def evaluate(self, float_nodes: set[str], samples: list[dict]) -> dict:
        """Per-output metrics of the build with `float_nodes` float, on `samples` (a prefix of the evaluation
        samples, so their number names them)."""
        raise NotImplementedError

    def evaluate_candidate(self, start: set[str], float_nodes: set[str], samples: list[dict]) -> dict:
        """A ranking or promotion trial: `float_nodes` is `start` (the float set the round ranked on) with
        candidates added. A backend may derive its model from start's build instead of building (ORT:
        derived_builds.py); by default it builds."""
        return self.evaluate(float_nodes, samples)

    def rank(self, chosen: tuple[str, ...]) -> list[dict]:
        """[{node, gain}] for the candidates not in `chosen`, most harmful first (when `ranks_itself`)."""
        raise NotImplementedError

    def count(self, float_nodes: set[str]) -> int:
        """What `max_float_nodes` counts of a float set: its nodes (RKNN: the float16 layers they make)."""
        return len(float_nodes)

    def faster(self, float_nodes: set[str]) -> bool:
        """Asked once, when the next trial would end in the last FAST_SHARE of the budget: build the faster,
        approximate way from now on, starting from the build of `float_nodes` (the accepted set)? True if so."""
        return False


@dataclass
class Candidates:
    """What the search may make float. A name is a node, or stands for the nodes `groups` lists (ORT: an
    activation edge is float only when its producer and every consumer are). `cost`: each candidate's share of
    the model's compute; given, candidates are promoted by gain per cost, so the target is met with the
    cheapest float set (on EfficientNet-Lite0 the most harmful edges are the high-resolution early layers, the
    slowest in float). `ops`: node → op type, for the record."""

    names: list[str]
    groups: dict[str, tuple[str, ...]] = field(default_factory=dict)
    cost: dict[str, float] | None = None
    ops: dict[str, str] = field(default_factory=dict)
    group_kind: str = "edge"  # what a group is, for the record (RKNN: a LayerNorm chain)
    first: tuple[str, ...] = ()  # promoted before the ranked ones in round 1, if they help at all (RKNN: outputs)

    def nodes(self, names, base_float: set[str]) -> set[str]:
        return {n for c in names for n in self.groups.get(c, (c,))} - base_float

    def describe(self, name: str) -> str:
        if name in self.groups:
            return " + ".join(self.ops.get(n, "?") for n in self.groups[name]) + f" ({self.group_kind})"
        return self.ops.get(name, name)


class Search:
    """One search: rank the candidates, promote them most harmful first, re-rank each round, until the target
    holds, the float-node cap or the time budget is reached, or nothing helps. `budget`: the backend's, started
    when its own fallback work began, so it covers that work too; no trial starts that would end past it."""

    def __init__(self, backend: SearchBackend, candidates: Candidates, base_float: set[str], samples: list[dict],
                 options: dict, progress=None, budget: Budget | None = None, acceptance: list[dict] | None = None):
        self.backend, self.candidates, self.base_float = backend, candidates, set(base_float)
        if options.get("max_float_nodes") is None:  # unset, no spread phase before (channel_spread.search_options)
            options = {**options, "max_float_nodes": SEARCHED_NODES, "spread_counted": False}
        self.samples, self.options, self.progress = samples, options, progress
        self.acceptance = acceptance or []  # samples kept apart: a float set passes only if it holds on them too
        self.target = options["target"]
        self.budget = budget or Budget(options["time_budget_s"])
        self.trials: list[Trial] = []
        self.chosen: tuple[str, ...] = ()  # candidates accepted so far
        self.round_start: tuple[str, ...] | None = None  # the candidates float when this round ranked
        self.gains: dict[str, float] = {}  # promoted candidate → its gain in the round that promoted it
        self.fast_from: int | None = None  # index of the first trial built the faster way
        self.ask_faster = True
        self.ranking_cut = False  # the last ranking stopped for time, not for lack of candidates
        self.ranked_part = False  # the last ranking stopped once its gains were enough (ENOUGH_GAIN, MIN_GAIN)
        self.rank_all = False  # the next ranking goes through every candidate (a partial one promoted nothing)
        self.last_ranked: set[str] = set()  # the candidates the last ranking measured
        self.best = self.current = None

    def run(self) -> Outcome:
        base = self.trial("base", (), (), self.samples)
        base.accepted = True
        self.say(f"base (all quantized): score {base.score:.5f}, target {'met' if base.passed else 'missed'} "
                 f"({_metrics_text(base.metrics)})")
        self.best = self.current = base
        stop = "target met" if base.passed else ""
        names = self.candidates.names
        remaining = list(names if self.backend.ranks_itself else names[: self.options["max_candidates"]])
        ranking: list[dict] = []
        rounds = 0
        if not stop:  # a slow trial that would run into the last quarter: the faster way from the start
            self.faster_if_late(self.budget.predict("trial"))
        if not stop and not self.budget.allows("ranking", self.budget.predict("trial")):
            stop = "time budget spent"
        while not stop:
            rounds += 1
            ranked = self.ranked(remaining, rounds)
            ranking = ranking if rounds > 1 else ranked
            stop, promoted, capped = self.promote(ranked, rounds)
            remaining = [n for n in remaining if n not in self.chosen]
            if not stop and capped:  # the cap is (nearly) full: another round would only rank
                stop = self.cap_reached()
            elif not stop and not promoted and self.ranked_part and remaining:
                self.rank_all = True  # the next round ranks every candidate left, not only the first ones
                continue
            elif not stop and (not promoted or not remaining):
                stop = "time budget spent" if self.ranking_cut and not promoted else "no candidate left that helps"
            elif not stop and not self.budget.fits(self.budget.predict("trial")):
                stop = "time budget spent"
        float_nodes = sorted(self.base_float | self.candidates.nodes(self.best.float_nodes, self.base_float))
        return Outcome(float_nodes, self.best.passed, self.record(base, ranking, stop, rounds))

    def cap_reached(self) -> str:
        """The stop reason at the cap, with the cap as configured: the spread phase's nodes count against it
        (channel_spread.search_options gives this search only the rest)."""
        spread, cap = self.options.get("spread_nodes", 0), self.options["max_float_nodes"]
        if not self.options.get("spread_counted", True):
            return f"{cap} searched nodes reached (max_float_nodes unset)" + (
                f", beside the spread set's {spread}" if spread else "")
        return f"max_float_nodes ({cap + spread}) reached" + (f", {spread} of them the spread set's" if spread else "")

    def ranked(self, remaining: list[str], round_index: int) -> list[dict]:
        """This round's candidates, most harmful first (by gain per cost when costs are known)."""
        if self.backend.ranks_itself:
            ranked = [row for row in self.backend.rank(self.chosen) if row["node"] in remaining]
        else:
            ranked = self.rank_by_trials(remaining, round_index)
        cost = self.candidates.cost
        if cost:
            ranked = sorted(ranked, key=lambda row: -row["gain"] / max(cost.get(row["node"], 0.0), MIN_COST))
        if round_index == 1 and self.candidates.first:
            ranked = sorted(ranked, key=lambda row: row["node"] not in self.candidates.first)  # stable
        return ranked

    def rank_by_trials(self, pool: list[str], round_index: int) -> list[dict]:
        """Each candidate's gain when it alone joins the float set. Re-ranked every round on top of the
        candidates already float, because harm interacts: an edge between two quantized nodes is only float
        when both are."""
        rank_samples = self.samples[: self.options["rank_samples"]]
        if self.ranked_part:  # after a partial ranking, go on where it stopped (its unhelpful first nodes last)
            pool = ([n for n in pool if n not in self.last_ranked] + [n for n in pool if n in self.last_ranked])
        self.ranking_cut = self.ranked_part = False
        base = self.trial("rank", self.chosen, (), rank_samples)
        self.round_start = self.chosen
        self.say(f"round {round_index}: ranking {len(pool)} candidates on {len(rank_samples)} samples")
        full, self.rank_all = self.rank_all, False
        enough = self.enough_gain(self.current.score) if round_index == 1 and not full else None
        # a later round ranks until a candidate clearly helps: round 1 has ranked them all once, and what helps
        # now is mostly what the nodes made float since then unlocked (EfficientNet-Lite0, agreement missed:
        # round 2's two best of 79 were its 2nd and 3rd; ranking all took 21 of the search's 84 s)
        clear = MIN_GAIN * (1.0 - base.score) if round_index > 1 and not full else None
        rows = []
        for index, name in enumerate(pool):
            if enough is not None and index >= MIN_RANKED and sum(max(r["gain"], 0.0) for r in rows) >= enough:
                self.say(f"ranking stopped after {index} nodes: their gains add up to {ENOUGH_GAIN:g}× what the "
                         "target still needs (the rest are ranked in the next round if needed)")
                self.ranked_part = True
                break
            helping = sum(r["gain"] > 0 and r["gain"] >= clear for r in rows) if clear is not None else 0
            if helping and index >= MIN_RANKED:
                self.say(f"ranking stopped after {index} nodes: {helping} of them "
                         f"remove {MIN_GAIN:.0%} of the error left alone (the rest are ranked in the next round "
                         "if needed)")
                self.ranked_part = True
                break
            share = 0.5 if round_index == 1 else 0.9  # of the budget: leave time to promote
            if (self.elapsed() > self.budget.seconds * share
                    or not self.budget.fits(self.budget.predict("rank") + self.budget.predict("trial"))):
                self.say(f"ranking stopped after {index} nodes (time budget)")
                self.ranking_cut = True
                break
            t = self.trial("rank", self.chosen, (name,), rank_samples)
            rows.append({"node": name, "gain": t.score - base.score})
        self.last_ranked = {row["node"] for row in rows}
        return sorted(rows, key=lambda row: -row["gain"])

    def enough_gain(self, score: float) -> float | None:
        """The total gain after which round 1 stops ranking: ENOUGH_GAIN × what `score` (the search's, on all the
        samples it chooses on) still lacks of the target's cosine, when the target has one. Why: ranking costs one
        build per candidate (36 on MiniLM, 37 s); the candidates come in order of the accuracy lost across them
        (local error), and the first nine held every node the search then promoted. Not the ranking samples' own
        base: on PP-OCRv4 rec the first 32 samples scored 0.99296 where all 96 scored 0.98824, so the rule never
        applied and all 96 candidates were ranked (68 s); the node it then promoted was the second ranked. None
        (rank all) when the target has no cosine or the score meets it."""
        needed = [v for k, v in self.target.items() if k.rpartition(".")[2] in ("cosine_mean", "cosine_min")]
        if not needed or min(needed) <= score:
            return None
        return ENOUGH_GAIN * (min(needed) - score)

    def promote(self, ranked: list[dict], round_index: int) -> tuple[str, int, bool]:
        """Add the helpful candidates `block` at a time, each block kept only if it pays for itself →
        (why the search stops, or "", candidates promoted, whether the float-node cap refused one)."""
        block_size, cap = self.options["block"], self.options["max_float_nodes"]
        helpful = [row["node"] for row in ranked if row["gain"] > 0]
        self.say(f"round {round_index}: {len(helpful)} of {len(ranked)} candidates help when kept float; "
                 f"promoting in blocks of {block_size}")
        promoted, capped = 0, False
        for start in range(0, len(helpful), block_size):
            if self.out_of_time():
                return "time budget spent", promoted, capped
            block = tuple(helpful[start:start + block_size])
            if not self.candidates.nodes(block, self.base_float) - self.candidates.nodes(self.chosen, self.base_float):
                continue  # nodes of a group promoted earlier this round
            if self.backend.count(self.candidates.nodes(self.chosen + block, self.base_float)) > cap:
                capped = True  # a smaller candidate further down may still fit
                continue
            t = self.trial("promote", self.chosen, block, self.samples)
            # a float node must pay for itself: at least 1% of the error left (noise-level gains are refused)
            if t.passed or t.score - self.current.score >= MIN_GAIN * (1.0 - self.current.score):
                t.accepted, self.chosen, self.current = True, self.chosen + block, t
                promoted += len(block)
                self.gains.update({row["node"]: row["gain"] for row in ranked if row["node"] in block})
                self.best = t if _better(t, self.best) else self.best
            self.say(f"{'+' if t.accepted else '-'} {', '.join(block)}: score {t.score:.5f} "
                     f"({_metrics_text(t.metrics)}){' target met' if t.passed else ''}")
            if t.passed:
                return "target met", promoted, capped
        return "", promoted, capped

    def out_of_time(self) -> bool:
        """Would the next promotion trial (as long as the last one) end past the budget? (faster_if_late first)"""
        slow = [t for t in self.trials[self.fast_from or 0:] if t.phase == "promote"]
        last = slow[-1].seconds if slow else 0.0
        if self.faster_if_late(last):
            last = 0.0
        return not self.budget.fits(last)  # a trial that would end past the budget is not started

    def faster_if_late(self, trial_seconds: float) -> bool:
        """Asks the backend once to build the faster way from now on when a trial of `trial_seconds` would end in
        the last FAST_SHARE of the budget → whether it now does. The times measured so far then predict nothing:
        they are forgotten. Why at the start too: EfficientNet-Lite0 on RKNN chose mmse (169 s a build) after
        190 of its 300 s, and the search then stopped before its first trial."""
        if not self.ask_faster or self.fast_from is not None:
            return False
        if not self.budget.ends_in_last(FAST_SHARE, trial_seconds):
            return False
        self.ask_faster = False
        if not self.backend.faster(self.base_float | self.candidates.nodes(self.chosen, self.base_float)):
            return False
        self.fast_from = len(self.trials)
        self.budget.forget("trial", "rank")
        self.say("a slow trial would end in the last quarter of the budget: the trials from here build the faster way")
        return True

    def trial(self, phase: str, start: tuple[str, ...], added: tuple[str, ...], samples: list[dict]) -> Trial:
        t0 = time.perf_counter()
        made_float = self.candidates.nodes(start + added, self.base_float)
        evaluate = self.backend.evaluate
        if added and phase in ("rank", "promote") and self.round_start is not None:
            # from the build the round ranked on (promotions add to it too: one build per round, not per trial)
            reference = self.base_float | self.candidates.nodes(self.round_start, self.base_float)

            def evaluate(float_nodes: set[str], samples: list[dict]) -> dict:
                return self.backend.evaluate_candidate(reference, float_nodes, samples)

        outputs = evaluate(self.base_float | made_float, samples)
        gate = ({"passed": False} if samples is not self.samples else
                judge(self.target, outputs, self.base_float | made_float, evaluate, self.acceptance))
        result = Trial(phase, start + added, added, len(made_float), score_of(outputs, self.target),
                       gate_metrics(gate), gate["passed"], time.perf_counter() - t0, unseen=gate.get("unseen"),
                       margin=gate.get("margin"))
        if result.margin:
            self.say(f"target met on the {len(samples)} samples the search chooses on, but not with one standard "
                     f"error to spare (" + ", ".join(f"{k} {v:.4f}" for k, v in result.margin.items()) + ")")
        if result.unseen and not result.passed:
            errors = result.unseen.get("standard_error") or {}
            margin = f", less its standard error {max(errors.values()):.4f}" if errors else ""
            self.say(f"target met on the {len(samples)} samples the search chooses on, missed on the "
                     f"{len(self.acceptance)} kept apart ({_metrics_text(result.unseen['metrics'])}{margin})")
        self.trials.append(result)
        return result

    def elapsed(self) -> float:
        return self.budget.elapsed()

    def say(self, message: str) -> None:
        log.info("fallback: %s", message)
        if self.progress is not None:
            self.progress.note(f"fallback: {message}")

    def record(self, base: Trial, ranking: list[dict], stop: str, rounds: int) -> dict:
        """What the report shows: every node made float with the candidate (and gain) that made it, the
        trials, the ranking of the first round, and why the search stopped."""
        candidates, best, trials = self.candidates, self.best, self.trials
        made_float, seen = [], set(self.base_float)
        for candidate in best.float_nodes:  # each node once
            for node in candidates.groups.get(candidate, (candidate,)):
                if node not in seen:
                    seen.add(node)
                    via = f"{candidate} ({candidates.describe(candidate)})"
                    made_float.append({"node": node, "what": candidates.describe(node),
                                       "gain": self.gains.get(candidate),
                                       **({"via": via} if candidate in candidates.groups else {})})
        record = {
            "target": self.target, "passed": best.passed, "stopped": stop, "seconds": round(self.elapsed(), 1),
            "float_nodes": made_float,
            "base": {"score": base.score, "metrics": base.metrics},
            "best": {"score": best.score, "metrics": best.metrics, **({"unseen": best.unseen} if best.unseen else {})},
            "samples": {"chosen_on": len(self.samples), "kept_apart": len(self.acceptance)},
            "ranking": [{**row, "what": candidates.describe(row["node"])} for row in ranking[:50]],
            "ranked": len(ranking), "candidates": len(candidates.names), "rounds": rounds,
            "trials": [t.record() for t in trials if t.phase != "rank"],
            "rank_trials": sum(t.phase == "rank" for t in trials),
            "ranked_by": "analysis" if self.backend.ranks_itself else "trials",
        }
        if self.fast_from is not None:
            record["faster_from_trial"] = sum(t.phase != "rank" for t in trials[: self.fast_from])
        if not best.passed:
            record["why"] = _why(best, ranking, stop)
        return record


class Remembered:
    """`evaluate` remembered per (backend setting, float set, samples): the range trial, the op-type phase and
    the search's base all ask for the same build on the same samples. Samples are a prefix of the samples the
    search chooses on, or those kept apart: their first sample and number name them. A backend that reaches the
    same outputs another way (ORT: a model derived to equal the build) passes that way as `measure`, or `store`s
    what it measured: one memo, whichever way a result was made."""

    def __init__(self, evaluate: Callable[[set[str], list[dict]], dict], setting: Callable[[], object]):
        self.evaluate, self.setting, self.results = evaluate, setting, {}

    def _key(self, float_nodes: set[str], samples: list[dict]) -> tuple:
        return self.setting(), frozenset(float_nodes), id(samples[0]) if samples else None, len(samples)

    def __call__(self, float_nodes: set[str], samples: list[dict], measure: Callable[[], dict] | None = None) -> dict:
        key = self._key(float_nodes, samples)
        if key not in self.results:
            self.results[key] = measure() if measure is not None else self.evaluate(float_nodes, samples)
        return self.results[key]

    def store(self, float_nodes: set[str], samples: list[dict], outputs: dict) -> None:
        self.results[self._key(float_nodes, samples)] = outputs


def choose_setting(setting: str, configured: str, alternatives: list[str], use: Callable[[str], None],
                   evaluate: Callable[[set[str], list[dict]], dict], base_float: set[str], samples: list[dict],
                   target: dict, progress=None, min_gain: float = MIN_GAIN,
                   affordable: Callable[[str], bool] = lambda alternative: True,
                   acceptance: list[dict] | None = None) -> dict:
    """A backend setting (e.g. how activation ranges are chosen) measured at the outputs before any node is
    made float: the configured value first and, if the target is missed, each alternative. An alternative is
    kept if it meets the target, or if it removes at least `min_gain` of the configured value's error
    (1 - score) and scores best; a backend whose alternative makes every later trial slower asks for more.
    An alternative that is not `affordable` (its trial would not end within the time budget) is not tried, nor one
    `use` refuses (returns False: the backend could not switch to it).
    Meeting the target means on `samples` and on those kept apart (`acceptance`, judge())."""
    outputs = evaluate(base_float, samples)
    scores = {configured: score_of(outputs, target)}
    passed = judge(target, outputs, base_float, evaluate, acceptance or [])["passed"]
    chosen = configured
    for alternative in [] if passed else alternatives:
        if not affordable(alternative):
            continue
        if progress is not None:
            progress.note(f"fallback: trying {setting}: {alternative}")
        if use(alternative) is False:
            continue
        outputs = evaluate(base_float, samples)
        scores[alternative] = score = score_of(outputs, target)
        if judge(target, outputs, base_float, evaluate, acceptance or [])["passed"]:
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
