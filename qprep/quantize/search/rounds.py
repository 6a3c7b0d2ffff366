"""The search itself: rounds of ranking and promotion until the target holds (the method: the package's
docstring). Each round is a `Round`: where its ranking stopped and why, and what it promoted; the next round
follows from it (`Round.following`), so the search's state is that object, not flags set in one method and read
in another.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

from qprep.quantize.budget import Budget
from qprep.quantize.search.acceptance import MIN_GAIN, allowed_disagreement, gate_metrics, judge, score_of
from qprep.quantize.search.backend import Candidates, SearchBackend
from qprep.quantize.search.options import NodeSearch

log = logging.getLogger("qprep")

ENOUGH_GAIN = 2.0  # round 1 ranks until its gains add up to this many times what the target still needs
MIN_RANKED = 8  # … and at least this many candidates
MIN_COST = 0.01  # candidates below 1% of the model's compute are ranked by gain alone
FAST_SHARE = 0.25  # of the budget, left to a backend's faster builds (RKNN mmse: seconds a trial, not minutes)


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


@dataclass
class Round:
    """One round: its ranking (on which candidates, where it stopped and why) and its promotions. A ranking by
    trials may stop early, once its gains are enough (`stopped` "enough": ENOUGH_GAIN in round 1, a candidate
    that clearly helps later) or for time ("time"); the round after an early stop goes on where it stopped and,
    if this one promoted nothing, ranks every candidate left (`following`)."""

    index: int  # 1 for the first round
    full: bool = False  # rank every candidate left, no early stop
    ranked_last: frozenset[str] = frozenset()  # measured by the round before, which stopped early: ranked last
    start: tuple[str, ...] | None = None  # the candidates float when it ranked by trials: its trials derive from it
    measured: set[str] = field(default_factory=set)  # the candidates its ranking measured
    stopped: str = ""  # why its ranking stopped before the last candidate: "", "enough" or "time"
    promoted: int = 0  # candidates it promoted
    capped: bool = False  # the float-node cap refused a block

    def following(self) -> Round:
        early = self.stopped == "enough"
        return Round(self.index + 1, full=early and not self.promoted,
                     ranked_last=frozenset(self.measured) if early else frozenset())


class Search:
    """One search: rank the candidates, promote them most harmful first, re-rank each round, until the target
    holds, the float-node cap or the time budget is reached, or nothing helps. `budget`: the backend's, started
    when its own fallback work began, so it covers that work too; no trial starts that would end past it."""

    def __init__(self, backend: SearchBackend, candidates: Candidates, base_float: set[str], samples: list[dict],
                 settings: NodeSearch, progress=None, budget: Budget | None = None,
                 acceptance: list[dict] | None = None):
        self.backend, self.candidates, self.base_float = backend, candidates, set(base_float)
        self.samples, self.settings, self.progress = samples, settings, progress
        self.acceptance = acceptance or []  # samples kept apart: a float set passes only if it holds on them too
        self.target = settings.fallback.target
        self.budget = budget or Budget(settings.fallback.time_budget_s)
        self.trials: list[Trial] = []
        self.chosen: tuple[str, ...] = ()  # candidates accepted so far
        self.gains: dict[str, float] = {}  # promoted candidate → its gain in the round that promoted it
        self.round: Round | None = None  # the round under way
        self.asked_faster = False  # the backend was asked to build the faster way (faster_if_late: once)
        self.fast_from: int | None = None  # index of the first trial built the faster way, if it does
        self.best = self.current = None

    def run(self) -> Outcome:
        base = self.trial("base", (), (), self.samples)
        base.accepted = True
        self.say(f"base (all quantized): score {base.score:.5f}, target {'met' if base.passed else 'missed'} "
                 f"({_metrics_text(base.metrics)})")
        self.best = self.current = base
        stop = "target met" if base.passed else ""
        names = self.candidates.names
        remaining = list(names if self.backend.ranks_itself else names[: self.settings.fallback.max_candidates])
        ranking: list[dict] = []
        if not stop:  # a slow trial that would run into the last quarter: the faster way from the start
            self.faster_if_late(self.budget.predict("trial"))
        if not stop and not self.budget.allows("ranking", self.budget.predict("trial")):
            stop = "time budget spent"
        while not stop:
            this = self.round = self.round.following() if self.round else Round(1)
            ranked = self.ranked(remaining, this)
            ranking = ranking if this.index > 1 else ranked
            stop = self.promote(ranked, this)
            remaining = [n for n in remaining if n not in self.chosen]
            if not stop and this.capped:  # the cap is (nearly) full: another round would only rank
                stop = self.cap_reached()
            elif not stop and not this.promoted and this.stopped == "enough" and remaining:
                continue  # the next round ranks every candidate left, not only the first ones (Round.following)
            elif not stop and (not this.promoted or not remaining):
                stop = ("time budget spent" if this.stopped == "time" and not this.promoted
                        else "no candidate left that helps")
            elif not stop and not self.budget.fits(self.budget.predict("trial")):
                stop = "time budget spent"
        float_nodes = sorted(self.base_float | self.candidates.nodes(self.best.float_nodes, self.base_float))
        rounds = self.round.index if self.round else 0
        return Outcome(float_nodes, self.best.passed, self.record(base, ranking, stop, rounds))

    def cap_reached(self) -> str:
        """The stop reason at the cap, with the cap as configured: the spread phase's nodes count against it
        (search.node_search gives this search only the rest)."""
        spread, cap = self.settings.spread_nodes, self.settings.max_float_nodes
        if not self.settings.spread_counted:
            return f"{cap} searched nodes reached (max_float_nodes unset)" + (
                f", beside the spread set's {spread}" if spread else "")
        return f"max_float_nodes ({cap + spread}) reached" + (f", {spread} of them the spread set's" if spread else "")

    def ranked(self, remaining: list[str], this: Round) -> list[dict]:
        """This round's candidates, most harmful first (by gain per cost when costs are known)."""
        if self.backend.ranks_itself:
            ranked = [row for row in self.backend.rank(self.chosen) if row["node"] in remaining]
        else:
            ranked = self.rank_by_trials(remaining, this)
        cost = self.candidates.cost
        if cost:
            ranked = sorted(ranked, key=lambda row: -row["gain"] / max(cost.get(row["node"], 0.0), MIN_COST))
        if this.index == 1 and self.candidates.first:
            ranked = sorted(ranked, key=lambda row: row["node"] not in self.candidates.first)  # stable
        return ranked

    def rank_by_trials(self, pool: list[str], this: Round) -> list[dict]:
        """Each candidate's gain when it alone joins the float set. Re-ranked every round on top of the
        candidates already float, because harm interacts: an edge between two quantized nodes is only float
        when both are. Where and why the ranking stopped is recorded in `this`."""
        rank_samples = self.samples[: self.settings.fallback.rank_samples]
        # after a ranking that stopped early, go on where it stopped (its unhelpful first nodes last)
        pool = [n for n in pool if n not in this.ranked_last] + [n for n in pool if n in this.ranked_last]
        base = self.trial("rank", self.chosen, (), rank_samples)
        this.start = self.chosen
        self.say(f"round {this.index}: ranking {len(pool)} candidates on {len(rank_samples)} samples")
        enough = self.enough_gain(self.current.score) if this.index == 1 and not this.full else None
        # a later round ranks until a candidate clearly helps: round 1 has ranked them all once, and what helps
        # now is mostly what the nodes made float since then unlocked (BENCHMARKS.md: "Later rounds rank until a
        # candidate clearly helps")
        clear = MIN_GAIN * (1.0 - base.score) if this.index > 1 and not this.full else None
        rows = []
        for index, name in enumerate(pool):
            if enough is not None and index >= MIN_RANKED and sum(max(r["gain"], 0.0) for r in rows) >= enough:
                self.say(f"ranking stopped after {index} nodes: their gains add up to {ENOUGH_GAIN:g}× what the "
                         "target still needs (the rest are ranked in the next round if needed)")
                this.stopped = "enough"
                break
            helping = sum(r["gain"] > 0 and r["gain"] >= clear for r in rows) if clear is not None else 0
            if helping and index >= MIN_RANKED:
                self.say(f"ranking stopped after {index} nodes: {helping} of them "
                         f"remove {MIN_GAIN:.0%} of the error left alone (the rest are ranked in the next round "
                         "if needed)")
                this.stopped = "enough"
                break
            share = 0.5 if this.index == 1 else 0.9  # of the budget: leave time to promote
            if (self.elapsed() > self.budget.seconds * share
                    or not self.budget.fits(self.budget.predict("rank") + self.budget.predict("trial"))):
                self.say(f"ranking stopped after {index} nodes (time budget)")
                this.stopped = "time"
                break
            t = self.trial("rank", self.chosen, (name,), rank_samples)
            rows.append({"node": name, "gain": t.score - base.score})
        this.measured = {row["node"] for row in rows}
        return sorted(rows, key=lambda row: -row["gain"])

    def enough_gain(self, score: float) -> float | None:
        """The total gain after which round 1 stops ranking: ENOUGH_GAIN × what `score` (the search's, on all the
        samples it chooses on) still lacks of the target's cosine, when the target has one. Why: ranking costs one
        build per candidate; the candidates come in order of the accuracy lost across them (local error), and the
        first few held every node the search then promoted. Not the ranking samples' own base: a few samples may
        score above the target where all of them score below, and the rule would never apply (BENCHMARKS.md:
        "the ORT search's builds and rankings made cheaper"). None (rank all) when the target has no cosine or the
        score meets it."""
        needed = [v for k, v in self.target.items() if k.rpartition(".")[2] in ("cosine_mean", "cosine_min")]
        if not needed or min(needed) <= score:
            return None
        return ENOUGH_GAIN * (min(needed) - score)

    def promote(self, ranked: list[dict], this: Round) -> str:
        """Add the helpful candidates `block` at a time, each block kept only if it pays for itself → why the
        search stops, or "" (what was promoted, and whether the float-node cap refused a block: in `this`)."""
        block_size, cap = self.settings.fallback.block, self.settings.max_float_nodes
        helpful = [row["node"] for row in ranked if row["gain"] > 0]
        self.say(f"round {this.index}: {len(helpful)} of {len(ranked)} candidates help when kept float; "
                 f"promoting in blocks of {block_size}")
        for start in range(0, len(helpful), block_size):
            if self.out_of_time():
                return "time budget spent"
            block = tuple(helpful[start:start + block_size])
            if not self.candidates.nodes(block, self.base_float) - self.candidates.nodes(self.chosen, self.base_float):
                continue  # nodes of a group promoted earlier this round
            if self.backend.count(self.candidates.nodes(self.chosen + block, self.base_float)) > cap:
                this.capped = True  # a smaller candidate further down may still fit
                continue
            t = self.trial("promote", self.chosen, block, self.samples)
            # a float node must pay for itself: at least 1% of the error left (noise-level gains are refused)
            if t.passed or t.score - self.current.score >= MIN_GAIN * (1.0 - self.current.score):
                t.accepted, self.chosen, self.current = True, self.chosen + block, t
                this.promoted += len(block)
                self.gains.update({row["node"]: row["gain"] for row in ranked if row["node"] in block})
                self.best = t if _better(t, self.best) else self.best
            self.say(f"{'+' if t.accepted else '-'} {', '.join(block)}: score {t.score:.5f} "
                     f"({_metrics_text(t.metrics)}){' target met' if t.passed else ''}")
            if t.passed:
                return "target met"
        return ""

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
        they are forgotten. Why at the start too: a range setting chosen late (RKNN's mmse, minutes a build) left
        too little for one slow trial, and the search stopped before its first one."""
        if self.asked_faster:
            return False
        if not self.budget.ends_in_last(FAST_SHARE, trial_seconds):
            return False
        self.asked_faster = True
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
        if added and phase in ("rank", "promote") and self.round is not None and self.round.start is not None:
            # from the build the round ranked on (promotions add to it too: one build per round, not per trial)
            reference = self.base_float | self.candidates.nodes(self.round.start, self.base_float)

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
            record["why"] = _why(best, ranking, stop, self.target, len(self.samples))
        return record


def _better(a: Trial, b: Trial) -> bool:
    if a.passed != b.passed:
        return a.passed
    if a.passed:
        return (a.nodes, -a.score) < (b.nodes, -b.score)
    return a.score > b.score


def _metrics_text(metrics: dict) -> str:
    return ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items())


def _why(best: Trial, ranking: list[dict], stop: str, target: dict, samples: int) -> str:
    missed = ", ".join(f"{k} {v:.4f}" for k, v in best.metrics.items() if isinstance(v, float))
    helpful = sum(r["gain"] > 0 for r in ranking)
    reason = (f"target not met ({stop}); best: {missed} with {best.nodes} float nodes; "
              f"{helpful} of {len(ranking)} candidates ranked first helped when kept float")
    limit = _sample_limit(best, target, samples)
    if limit:
        return f"{reason}; {limit}"
    if stop.startswith("no candidate"):
        return (reason + ": the remaining error is spread over many layers (see the per-layer table; try more "
                "calibration data or another backend mode)")
    return reason + ": raise time_budget_s / max_float_nodes to search further"


def _sample_limit(best: Trial, target: dict, samples: int) -> str:
    """When the best float set met an agreement only by less than its standard error, what the sample count
    allows: on 36 samples a 0.97 agreement needs all 36 (one flip is 2.8%), so no float set short of exact can
    pass, and raising the budget or keeping more float is the wrong advice."""
    for key in best.margin or {}:
        metric = key.rpartition(".")[2]
        threshold = target.get(key, target.get(metric))
        if threshold is None or not metric.endswith("_agreement"):
            continue
        allowed = int(math.floor(allowed_disagreement(threshold, samples) * samples + 1e-9))
        return (f"on the {samples} samples it chooses on, {metric} {threshold:g} counts as met with one standard "
                f"error to spare only with at most {allowed} of {samples} disagreeing: add evaluation samples, "
                f"or lower the target")
    return ""
