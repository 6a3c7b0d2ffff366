"""The accuracy-driven fallback with ORT: what qprep.quantize.search does for every backend, plus the trials
only ORT's second-long builds can afford.

A trial is a re-quantization (ranges and GPTQ cached by the quantizer) and an ORT run on the evaluation
samples; with static QDQ, a trial that only adds float nodes to a built set (an op type's rank, a candidate's
rank, a promotion) is derived from that build instead (derived_builds.py). Before any node is made float, four
settings are measured at the outputs: bias correction on the base float set, mse activation ranges, the tensors
whose channels spread too far for one int8 scale (channel_spread.py) kept float, and op types left float as a
whole. Candidates are then activation
edges (`edges`; MatMul nodes with dynamic quantization), those losing most accuracy first, promoted by gain
per multiply-add. Last, if the target is still missed, bias correction is measured on the float set the search
chose.

Every step is bounded by the time budget (quantize/budget.py): builds are timed (the first one, which
calibrates and runs GPTQ, apart from the later ones that reuse both), a step that would not end in time is not
started, bias correction stops between its waves, and the time of one build is kept for the final build.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Callable

import onnx

from qprep.errors import ModelError
from qprep.measure.layers import layer_errors
from qprep.model.info import graph_inputs, multiply_adds
from qprep.model.io import content_key
from qprep.model.runtime import run_model
from qprep.quantize import channel_spread, search
from qprep.quantize.backend import QuantizeJob
from qprep.quantize.budget import Budget
from qprep.quantize.ort.derived_builds import Derivation
from qprep.quantize.ort.derived_runs import DerivedRuns
from qprep.quantize.ort.quantizer import OrtQuantizer
from qprep.quantize.ort.settings import OrtSettings

log = logging.getLogger("qprep")

# Ops without weights whose int8 version only re-rounds an activation (elementwise, data movement, softmax).
# Conv/MatMul/Gemm are where INT8 pays; these are judged as whole op types before nodes are ranked.
_COMPUTE = {"Conv", "ConvTranspose", "MatMul", "Gemm"}
# Ops that only reshape: ORT's quantizer quantizes one only when its input is quantized, and puts its output on
# the input's grid; left float, its output holds the same values. So they are not ranked alone as op types (each
# rank is a build and a run, for nothing), unless extra_options ForceQuantizeNoInputCheck makes ORT
# quantize them after float producers too.
_RESHAPING = {"Reshape", "Transpose", "Squeeze", "Unsqueeze"}


class Trials(search.SearchBackend):
    """The search's backend: measurements at the settings chosen so far. Each phase replaces `settings`
    (immutable) with what it measured better, and every build is asked for with them: the quantizer is never
    changed. `measure(float_nodes, samples, settings)` → per-output metrics; results are remembered per
    (settings, float set, number of samples), as the range trial, the op-type phase and the search's base share
    builds."""

    def __init__(self, settings: OrtSettings, measure: Callable[[set[str], list[dict], OrtSettings], dict],
                 build_key: Callable[[set[str], OrtSettings], frozenset[str]] = lambda nodes, settings: nodes,
                 measure_candidate: Callable[[set[str], set[str], list[dict], OrtSettings], dict] | None = None):
        self.settings, self.build_key, self.measure_candidate = settings, build_key, measure_candidate
        self.remembered = search.Remembered(lambda nodes, samples: measure(nodes, samples, self.settings),
                                            lambda: self.settings)

    def evaluate(self, float_nodes: set[str], samples: list[dict]) -> dict:
        """(float sets that make the same build are measured once: OrtQuantizer.build_key)"""
        return self.remembered(set(self.build_key(float_nodes, self.settings)), samples)

    def evaluate_candidate(self, start: set[str], float_nodes: set[str], samples: list[dict]) -> dict:
        """Derived from start's build by `measure_candidate` (derived_builds.py) when given, else built; either
        way the same outputs, remembered with the builds'."""
        if self.measure_candidate is None:
            return self.evaluate(float_nodes, samples)
        start, nodes = set(self.build_key(start, self.settings)), set(self.build_key(float_nodes, self.settings))
        return self.remembered(nodes, samples, lambda: self.measure_candidate(start, nodes, samples, self.settings))

    def remember(self, float_nodes: set[str], samples: list[dict], outputs: dict) -> None:
        """What `evaluate` would measure for `float_nodes` at the current settings, known from a derived model."""
        self.remembered.store(set(self.build_key(float_nodes, self.settings)), samples, outputs)

    def use(self, **changes) -> None:
        self.settings = replace(self.settings, **changes)


class Measures:
    """How the fallback measures a float set with settings: `measure` builds it (each distinct model run once),
    `measure_candidate` derives a ranking or promotion trial's model from the build it adds to
    (derived_builds.py) and runs it from its first edit on (derived_runs.py). Both are timed in the budget."""

    def __init__(self, quantizer: OrtQuantizer, job: QuantizeJob, budget: Budget):
        self.quantizer, self.job, self.budget = quantizer, job, budget
        self.every = len(job.evaluation_samples)
        self.measured: dict = {}  # (built model's digest, samples) → metrics
        self.derived: dict = {}  # the last ranking reference: {"key", "reference", "derivation"}
        self.runs = DerivedRuns(job.threads)

    def ranking(self, samples: list[dict]) -> bool:
        """Whether `samples` are the ranking samples (a prefix of those the search chooses on, not all of them)."""
        return bool(samples) and samples[0] is self.job.evaluation_samples[0] and len(samples) < self.every

    def measure(self, float_nodes: set[str], samples: list[dict], settings: OrtSettings) -> dict:
        """Metrics of a build, run once per distinct model: float sets that differ only where the build does not
        look (beyond OrtQuantizer.build_key) give the same bytes."""
        with self.budget.timed(build_kind(self.quantizer, settings, len(samples) == self.every)):
            model = self.quantizer.build(float_nodes, settings, simplify=not self.ranking(samples),
                                         budget=self.budget)
            content = content_key(model)
            key = (content, id(samples[0]) if samples else None, len(samples))
            if content is None or key not in self.measured:
                self.measured[key] = self.job.measure(samples, run_model(model, samples, self.job.threads,
                                                                         optimize=True))
            return self.measured[key]

    def measure_candidate(self, start: set[str], float_nodes: set[str], samples: list[dict],
                          settings: OrtSettings) -> dict:
        """A ranking or promotion trial's model derived from the build of `start` (much cheaper than a build:
        BENCHMARKS.md: "ranking trials derived from the build they add to"); built like any trial where it cannot
        be derived. Timed apart from builds ("derived" on all samples): the time kept for the final build is a
        build's."""
        quantizer = self.quantizer
        if quantizer.dynamic or quantizer.options.format != "qdq" or settings.bias_correction:
            return self.measure(float_nodes, samples, settings)
        with self.budget.timed("rank" if len(samples) < self.every else "derived"):
            derived = self.derived
            if derived.get("key") != (frozenset(start), settings):
                reference = quantizer.build(start, settings, simplify=False)
                quantizable = (quantizer.build_key(quantizer.node_names, settings) - start
                               - set(quantizer.unquantizable))
                derived.update(key=(frozenset(start), settings), reference=reference, derivation=Derivation(
                    quantizer.model, reference,
                    lambda removed: quantizer.build(set(start) | removed, settings, simplify=False), quantizable))
            model = derived["derivation"].derive(float_nodes - start)
            try:
                # from its first edit on (derived_runs.py): a ranking trial from the reference's tensors, a
                # promotion (all samples, or those kept apart) from the last promotion's
                outputs = None if model is None else self.runs.run(derived["key"], derived["reference"], model,
                                                                   samples, from_last=not self.ranking(samples))
            except ModelError as exc:  # an edit ORT refuses: built instead
                log.debug("fallback: derived ranking model not run (%s): built instead", exc)
                outputs = None
            if outputs is not None:
                return self.job.measure(samples, outputs)
        return self.measure(float_nodes, samples, settings)


def fallback(quantizer: OrtQuantizer, excluded: set[str], job: QuantizeJob) -> tuple[search.Outcome, OrtSettings]:
    """The float set and the settings the final build uses, with the search's record."""
    budget = Budget(job.fallback.time_budget_s, job.started)  # from the stage's start: everything counts
    # until a plain trial has run, the first build (calibration, GPTQ and a run) stands for one: an over-estimate
    budget.stand_ins.update({"trial": "first build", "rank": "trial"})
    measures = Measures(quantizer, job, budget)
    trials = Trials(quantizer.settings, measures.measure, quantizer.build_key, measures.measure_candidate)
    wanted = trials.settings.bias_correction
    trials.use(bias_correction=False)
    base = trials.evaluate(excluded, job.evaluation_samples)  # the base: calibration and GPTQ, needed by every step
    budget.reserve_kind = "trial"  # from now on, the time of one build is kept for the final one
    # bias correction is measured per float set (its waves take seconds), so not per trial: tried first on the
    # configured ranges when the base is near the target, or once the range and spread settings bring it near
    # (before the op-type phase, which can spend minutes for less: BENCHMARKS.md: "the search spent minutes on
    # the wrong phase"), else only on the float set the search chose; the search runs without it
    near = near_target(base, job.fallback.target)
    corrected_base = _corrected_base(trials, excluded, job, budget) if wanted and near else None
    configured = trials.settings.calibrate_method
    ranges = search.choose_setting(
        "calibrate_method", configured, ["mse"] if configured == "minmax" and not quantizer.dynamic else [],
        lambda method: trials.use(calibrate_method=method), trials.evaluate, excluded, job.evaluation_samples,
        job.fallback.target, job.progress,  # new ranges: a build as long as the first (GPTQ on new scales)
        affordable=lambda method: budget.allows(f"calibrate_method {method}", budget.predict("first build")),
        acceptance=job.acceptance_samples)
    spread = choose_spread_tensors(quantizer, trials, excluded, job, budget)
    if wanted and corrected_base is None and near_target(trials.evaluate(excluded, job.evaluation_samples),
                                                         job.fallback.target):
        near, corrected_base = True, _corrected_base(trials, excluded, job, budget)
    op_types = choose_float_op_types(quantizer, trials, excluded, job, budget)
    outcome = _search_nodes(quantizer, trials, excluded, job, budget, spread)
    outcome.record.update(float_op_types=op_types, ranges=ranges, spread_tensors=spread)
    if wanted:
        outcome.record["bias_correction"] = _correct_final(trials, outcome, corrected_base, job, budget)
        if not near:
            outcome.record["bias_correction"]["base"] = "not tried: the base was far from the target"
    outcome.record.update(seconds=round(budget.elapsed(), 1), budget=budget.record_dict())
    return outcome, trials.settings


def _search_nodes(quantizer: OrtQuantizer, trials: Trials, excluded: set[str], job: QuantizeJob, budget: Budget,
                  spread: dict) -> search.Outcome:
    """The search over nodes (qprep.quantize.search) at the settings chosen so far: candidates are activation
    edges (MatMul nodes with dynamic quantization) ranked by the accuracy lost across them, when the target is
    missed and the budget allows the ranking."""
    candidates = []
    met = search.judge(job.fallback.target, trials.evaluate(excluded, job.evaluation_samples), excluded,
                       trials.evaluate, job.acceptance_samples)["passed"]  # (measured already: cached)
    if not met and budget.allows("ranking candidates by per-layer error",
                                 budget.predict("rank") + budget.predict("trial")):
        candidates = _candidates(quantizer.model, quantizer.build(excluded, trials.settings, budget=budget),
                                 job.evaluation_samples[:8], excluded, job.threads)
    groups = {} if quantizer.dynamic else edges(quantizer.model, candidates)
    if groups:
        candidates = list(groups)
    macs = multiply_adds(quantizer.model)
    total = sum(macs.values()) or 1
    cost = {c: sum(macs.get(n, 0) for n in groups.get(c, (c,))) / total for c in candidates}
    return search.Search(trials, search.Candidates(candidates, groups, cost, quantizer.op_type_of), excluded,
                         job.evaluation_samples, search.node_search(job.fallback, spread),
                         job.progress, budget, job.acceptance_samples).run()


def build_kind(quantizer: OrtQuantizer, settings: OrtSettings, all_samples: bool) -> str:
    """The budget's kind of a build with `settings`: the first with a range method (calibration and GPTQ), a
    bias-corrected one (its waves make it longer than a trial: timed as one, it would make every later step look
    as long, and a search could never start: recorded in `4d645a9`), a trial on all evaluation samples, or a ranking
    trial on fewer."""
    if not quantizer.calibrated(settings.calibrate_method):
        return "first build"
    if settings.bias_correction:
        return "bias trial"
    return "trial" if all_samples else "rank"


NEAR = 2.0  # bias correction is tried on the base when its error is at most this many times the target's


def near_target(outputs: dict, target: dict) -> bool:
    """Whether the base's error (1 − score) is within NEAR times the target's, and what each agreement in the
    target misses within NEAR times what the gate lets it miss on these samples (search.allowed_disagreement).

    Why: bias correction moves the score by a fraction of a percent, and far from the target it rarely helps;
    each try is a build, its waves and a run on every evaluation sample. An agreement the base misses by more
    than the gate can forgive is not met by a correction either. The measurements behind the rule:
    BENCHMARKS.md: "bias correction only where it can decide" and "Bias correction keeps the best prefix".
    Public for its tests: the cases it separates would each take a search to reach through `fallback`."""
    thresholds = [v for k, v in target.items() if k.rpartition(".")[2] in ("cosine_mean", "cosine_min")]
    if thresholds and 1.0 - search.score_of(outputs, target) > NEAR * (1.0 - min(thresholds)):
        return False
    for key, threshold in target.items():
        output, _, metric = key.rpartition(".")
        if not metric.endswith("_agreement"):
            continue
        for name in [output] if output else list(outputs):  # the outputs the gate judges by this key
            metrics = outputs.get(name) or {}
            value, count = metrics.get(metric), metrics.get(f"{metric.removesuffix('_agreement')}_count")
            if value is not None and count and 1.0 - value > NEAR * search.allowed_disagreement(threshold, count):
                return False
    return True


def _corrected_base(trials: Trials, excluded: set[str], job: QuantizeJob, budget: Budget) -> dict | None:
    """The base float set with bias correction: if that meets the target, the search ends at its base trial
    with it, which can leave no node float (BENCHMARKS.md: "empirical bias correction"); otherwise the search
    runs without it. Not tried when not even a build fits in the budget (its waves stop in time by themselves)."""
    if not budget.allows("bias correction on the base", budget.predict("trial")):  # (its stand-in: the first build)
        return None
    started = budget.elapsed()
    trials.use(bias_correction=True)
    outputs = trials.evaluate(excluded, job.evaluation_samples)
    passed = search.judge(job.fallback.target, outputs, excluded, trials.evaluate, job.acceptance_samples)["passed"]
    trials.use(bias_correction=passed)
    score = search.score_of(outputs, job.fallback.target)
    log.info("fallback: bias correction on the base: score %.5f%s", score, ", target met" if passed else "")
    return {"score": score, "passed": passed, "float_set": set(excluded), "seconds": budget.elapsed() - started}


def _correct_final(trials: Trials, outcome: search.Outcome, base: dict | None, job: QuantizeJob,
                   budget: Budget) -> dict:
    """Bias correction on the float set the search chose, when the search missed its target (measured again
    unless that is the base's set, if the budget has room for its build, a few of its waves and the final build)
    and kept if the score goes up. Not measured once the target is met: like a float node, it is added only while
    the target needs it (BENCHMARKS.md: "bias correction only where it can decide")."""
    target, float_set = job.fallback.target, set(outcome.float_nodes)
    record = {"base": {"score": base["score"], "passed": base["passed"]}} if base else {}
    if base and base["passed"]:
        record["kept"] = True
        return record
    if outcome.passed:
        record.update(kept=False, why="not measured: the target was met without it")
        return record
    cost = 2 * budget.predict("trial") + 3 * budget.predict("bias wave")  # its build + the final build + waves
    if ((base is None or float_set != base["float_set"])
            and not budget.allows("bias correction on the chosen float set", cost)):
        record.update(kept=False, why="no time left in the budget to measure it on the chosen float set")
        return record
    without = outcome.record["best"]["score"]
    trials.use(bias_correction=True)
    outputs = trials.evaluate(float_set, job.evaluation_samples)
    gate = search.judge(target, outputs, float_set, trials.evaluate, job.acceptance_samples)
    score, passed = search.score_of(outputs, target), gate["passed"]
    kept = score > without and (passed or not outcome.passed)
    trials.use(bias_correction=kept)
    record["final"] = {"without": without, "with": score, "passed": passed}
    record["kept"] = kept
    log.info("fallback: bias correction on the chosen float set: score %.5f → %.5f (%s)", without, score,
             "kept" if kept else "left out")
    if kept:
        outcome.passed = passed
        outcome.record.update(passed=passed, best={"score": score, "metrics": search.gate_metrics(gate),
                                                    **({"unseen": gate["unseen"]} if gate.get("unseen") else {})})
        if passed:
            outcome.record.pop("why", None)
    return record


def choose_spread_tensors(quantizer: OrtQuantizer, trials: Trials, excluded: set[str], job: QuantizeJob,
                          budget: Budget) -> dict:
    """The tensors whose channels one int8 scale cannot share, kept out of int8 before any node is made float
    (their edges float, or 16-bit: option spread_tensors; channel_spread.choose): a model can miss its target by
    far with them int8 and meet it with their edges float (BENCHMARKS.md: "channel spread"). Float edges count
    against max_float_nodes (16-bit ones do not: their nodes stay quantized)."""
    how = quantizer.options.spread_tensors
    if quantizer.dynamic or quantizer.options.format != "qdq" or how == "off":
        return {}
    float_outputs = {o for n in quantizer.model.graph.node if n.name in excluded for o in n.output}
    calibrated = [name for name in quantizer.calibrate(trials.settings.calibrate_method) if name not in float_outputs]
    # quantizer.model: the model at the opset ORT's quantizer needs
    record, _ = channel_spread.choose(
        job, quantizer.model, calibrated, how, lambda tensors: trials.use(spread_tensors=tensors), trials.evaluate,
        excluded, budget,
        lambda tensors: len(channel_spread.nodes_around(quantizer.model, tensors) - excluded) if how == "float" else 0)
    return record


def choose_float_op_types(quantizer: OrtQuantizer, trials: Trials, excluded: set[str], job: QuantizeJob,
                          budget: Budget) -> dict:
    """Leave an op type float when that measurably helps: on PP-OCRv4 rec, quantizing the hardswish chains
    (Add, Clip, Mul) re-rounds every activation three times. Greedy: rank each type on the ranking samples, keep
    each drop that helps on all samples; then try all these types at once (one of a chain's ops left float
    alone only adds Q/DQ pairs), kept if better still. The chosen types stay in `trials.settings`."""
    target = job.fallback.target
    outputs = trials.evaluate(excluded, job.evaluation_samples)
    if search.judge(target, outputs, excluded, trials.evaluate, job.acceptance_samples)["passed"]:
        return {"chosen": [], "trials": [], "nodes": 0}
    current = search.score_of(outputs, target)
    present = {n.op_type for n in quantizer.model.graph.node if n.name not in excluded}
    types = [t for t in quantizer.op_types if t in present and t not in _COMPUTE]
    exact = set() if quantizer.options.extra_options.get("ForceQuantizeNoInputCheck") else _RESHAPING
    rank_samples = job.evaluation_samples[: job.fallback.rank_samples]
    base = search.score_of(trials.evaluate(excluded, rank_samples), target)
    gains = {}

    def with_types(chosen) -> set[str]:
        return {n.name for n in quantizer.model.graph.node if n.op_type in chosen} | excluded

    for op_type in (t for t in types if t not in exact):
        if not budget.allows(f"op type {op_type} ranked", budget.predict("rank") + budget.predict("trial")):
            break
        # ranked as its nodes made float, derived from the base's build like the search's ranking trials (the
        # same build as the op type left float: ORT checks the op type and the node name in one place)
        gains[op_type] = search.score_of(trials.evaluate_candidate(excluded, with_types({op_type}), rank_samples),
                                         target) - base
    attempts = []

    def attempt(chosen: frozenset[str], label: str, rank_gain) -> None:
        """Leave `chosen` float if that beats the current score on all samples, else put the last set back."""
        nonlocal current
        if not budget.allows(f"op types {label} tried", budget.predict("trial")):
            return
        previous = trials.settings.float_op_types
        if previous:
            trials.use(float_op_types=chosen)
            score = search.score_of(trials.evaluate(excluded, job.evaluation_samples), target)
        else:  # derived from the base's build, as the ranks were: the build with these types left float
            outputs = trials.evaluate_candidate(excluded, with_types(chosen), job.evaluation_samples)
            trials.use(float_op_types=chosen)
            trials.remember(excluded, job.evaluation_samples, outputs)  # (kept: the search's base, not built again)
            score = search.score_of(outputs, target)
        kept = score > current
        attempts.append({"op_type": label, "rank_gain": rank_gain, "score": score, "kept": kept})
        if kept:
            current = score
        else:
            trials.use(float_op_types=previous)

    for op_type in sorted((t for t in gains if gains[t] > 0), key=lambda t: -gains[t]):
        attempt(trials.settings.float_op_types | {op_type}, op_type, gains[op_type])
    union = frozenset(types)  # every re-rounding type at once: a hardswish chain only pays when all its ops stay float
    if len(union) > 1 and union != trials.settings.float_op_types:
        attempt(union, "+".join(sorted(union)), None)
    chosen = trials.settings.float_op_types
    if job.progress is not None and chosen:
        job.progress.note(f"fallback: op types left float: {', '.join(sorted(chosen))} "
                          f"(score {base:.5f} → {current:.5f})")
    log.info("ort fallback: op types left float %s, score %.5f → %.5f", sorted(chosen), base, current)
    return {"chosen": sorted(chosen), "trials": attempts,
            "nodes": sum(n.op_type in chosen for n in quantizer.model.graph.node)}


def edges(model: onnx.ModelProto, ordered_nodes: list[str]) -> dict[str, tuple[str, ...]]:
    """Activation tensor → the quantized nodes that must all be float for it to stay float (its producer and
    every consumer: with Q/DQ, a tensor is rounded when any of them is quantized). Why edges, not nodes: while
    one of them is quantized the tensor is still rounded, so one edge float can do what single nodes do not
    (BENCHMARKS.md: "activation edges, promoted by gain per multiply-add").
    Ordered as `ordered_nodes` (most accuracy lost first) by the edge's first member; duplicates dropped."""
    position = {name: i for i, name in enumerate(ordered_nodes)}
    consumers: dict[str, list[str]] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node.name)
    tensors = [(o, node.name) for node in model.graph.node for o in node.output]
    tensors += [(spec.name, None) for spec in graph_inputs(model)]
    found, seen = [], set()
    for tensor, producer in tensors:
        members = tuple(dict.fromkeys(n for n in [producer, *consumers.get(tensor, [])] if n in position))
        if members and frozenset(members) not in seen:
            seen.add(frozenset(members))
            found.append((min(position[n] for n in members), tensor, members))
    return {tensor: members for _, tensor, members in sorted(found, key=lambda e: e[0])}


def _candidates(float_model: onnx.ModelProto, quantized: onnx.ModelProto, samples: list[dict], excluded: set[str],
                threads: int) -> list[str]:
    """Nodes the quantizer touched (an input from DequantizeLinear, or replaced by an integer op), ordered by
    the accuracy lost across the node itself: SQNR at its inputs minus SQNR at its output (accumulated errors
    cancel out). Nodes whose output cannot be compared (graph outputs: the last classifier layer) come first."""
    dq_outputs = {o for n in quantized.graph.node if n.op_type == "DequantizeLinear" for o in n.output}
    in_quantized = {n.name: n for n in quantized.graph.node}
    originals = {n.name: n for n in float_model.graph.node}
    touched = [n for n in float_model.graph.node if n.name not in excluded and (
        n.name not in in_quantized  # replaced by an integer op (QOperator, dynamic MatMulInteger)
        or set(in_quantized[n.name].input) & dq_outputs)]
    rows = {r["node"]: r["sqnr_db"] for r in layer_errors(float_model, quantized, samples, threads)}
    producer = {o: n.name for n in float_model.graph.node for o in n.output}
    ceiling = 80.0  # dB: graph inputs and weights count as (nearly) exact

    def local_loss(node) -> float:
        before = min([rows.get(producer[i], ceiling) for i in originals[node.name].input if i in producer]
                     or [ceiling])
        return float("inf") if node.name not in rows else min(before, ceiling) - min(rows[node.name], ceiling)

    return [n.name for n in sorted(touched, key=lambda n: -local_loss(n))]
