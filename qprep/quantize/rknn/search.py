"""The accuracy-driven fallback with RKNN builds: which layers become float16 (and whether `mmse` replaces
the `normal` range algorithm; which layers around tensors whose channels spread too far for int8 go float16
first) until the target is met or the budget spent. The search itself is
qprep/quantize/search.py; this module gives it RKNN's trial (a build on the simulator, builder.py) and RKNN's
ranking (the toolkit's accuracy_analysis, runner.py).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from qprep.errors import QprepError
from qprep.quantize import channel_spread, outlier_positions, search
from qprep.quantize.backend import BackendInput
from qprep.quantize.budget import Budget
from qprep.quantize.rknn.io_names import translated

if TYPE_CHECKING:  # builder.py calls this module: a run-time import would be circular
    from qprep.quantize.rknn.builder import RknnBuilder

log = logging.getLogger("qprep")

# how many times a normal build (with its evaluation) an mmse one takes, the slowest measured (rknn-toolkit2 2.5.0,
# this 2-core machine): EfficientNet-Lite0 9 s → 169 s (19x), PP-OCRv4 rec 24 s → 274 s (11x), MiniLM 3x. With 3x,
# rec's mmse build, predicted ~110 s, was started with 260 s of a 300 s budget left and ended 14 s past it.
MMSE_SLOWER = 20.0
# a kl_divergence trial against a normal one: its hybrid step1 (histograms over the calibration samples) runs
# again: MiniLM 45 s vs ~20 s (2.3x), PP-OCRv4 rec 42 s vs ~13.5 s (3.1x)
KL_SLOWER = 3.5
# weight_rounding mmse against the fallback's first trial (all int8 but the base float set, its build plain where
# that set is empty): an mmse build on 8 samples, then a hybrid trial with its weight ranges. Build on 8 samples
# against first trial (rknn-toolkit2 2.5.0, this machine): EfficientNet-Lite0 51 s / 9.5 s, PP-OCRv4 rec 66 / 9,
# PP-OCRv4 det 54 / 21 (a hybrid first trial), the zoo's PP-OCRv3 det at 736×544 200 / 21 — 2.6-9.5x, and one
# trial more. Not the slowest recent trial: after a switch of ranges it holds a step1 (PP-OCRv3 det: 54 s,
# predicted 8 x 54 = 432 s with 415 s left, so the phase was skipped). Plus a step1 on the model as prepared where
# none is kept (from GPTQ weights under normal ranges: PP-OCRv3 det 65 s); under kl the file does not change
MMSE_WEIGHTS_SLOWER = 12.0


class RknnTrials(search.SearchBackend):
    """The search's backend: a trial is a build on the simulator (a hybrid step2, seconds to minutes), so
    candidates are ranked by the toolkit's accuracy_analysis of the current build (the error each layer adds
    on its own) — all int8 in the first round, with the float16 layers promoted so far in later ones — not by
    one trial per node. The best build on all evaluation samples is pinned: the final export reuses it."""

    ranks_itself = True

    def __init__(self, builder: RknnBuilder, job: BackendInput, base_float: set[str], budget: Budget):
        self.builder, self.job, self.base_float, self.budget = builder, job, base_float, budget
        self.analysis_samples = job.evaluation_samples[: max(1, job.options["analysis_samples"])]
        self.best_score = float("-inf")  # on the evaluation samples the search chooses on, so far
        self.remembered = search.Remembered(self.measure, lambda: builder.setting)
        self.groups: dict[str, tuple[str, ...]] = {}  # candidate name → its nodes (LayerNorm chains)
        self._ir_tensors: dict[str, tuple[str, ...]] = {}  # node → its IR tensors (count)
        self._nodes = {n.name: n for n in job.model.graph.node}

    def measure(self, float_nodes: set[str], samples: list[dict]) -> dict:
        with self.budget.timed("trial" if samples is self.job.evaluation_samples else "rank"):
            outputs = self.job.measure(samples, self.builder.session(float_nodes)(samples))
        score = search.score_of(outputs, self.job.fallback["target"])
        if samples is self.job.evaluation_samples and score > self.best_score:  # the build the search returns
            self.best_score = score
            self.builder.pin(float_nodes)
        return outputs

    def evaluate(self, float_nodes: set[str], samples: list[dict]) -> dict:
        return self.remembered(float_nodes, samples)

    def count(self, float_nodes: set[str]) -> int:
        """The float16 layers `float_nodes` make: their distinct IR tensors (what a "≤ N non-int8 layers" budget
        counts; a MatMul and its bias Add are one layer, a node the toolkit fused away none)."""
        if not self.job.options["do_quantization"]:  # no hybrid build, no IR names
            return len(float_nodes)
        ir = None  # IR names do not change between builds of one model: each node mapped once
        for name in float_nodes:
            if name not in self._ir_tensors:
                ir = ir or self.builder.ir_names()
                self._ir_tensors[name] = tuple(ir.map_node(self._nodes[name])[0]) if name in self._nodes else ()
        return len({t for name in float_nodes for t in self._ir_tensors[name]})

    def rank(self, chosen: tuple[str, ...]) -> list[dict]:
        return _ranked(self.builder, self.job, self.base_float, self.analysis_samples, chosen, self.groups)

    def faster(self, float_nodes: set[str]) -> bool:
        return self.builder.reuse_ranges(float_nodes)


def fallback(builder: RknnBuilder, base_float: set[str], job: BackendInput) -> search.Outcome:
    """Which layers become float16, and which ranges build them: `mmse` against `normal` first, then the spread
    set, `kl_divergence` once that set is float16, mmse's weight ranges, the search with RKNN trials, and kl once
    more on the float16 set of a search that missed (each phase's reasons in its helper)."""
    budget = Budget(job.fallback["time_budget_s"], job.started)
    trials = RknnTrials(builder, job, base_float, budget)
    other_algorithms = (builder.algorithm == "normal" and job.options["do_quantization"]
                        and not builder.split.record)
    # mmse searches weight and activation ranges in step2, so every later build pays it again (minutes, vs
    # seconds): measured once, kept only if it removes 15% of the error. All int8, 128 samples, against normal
    # with GPTQ weights: EfficientNet-Lite0 0.9976 → 0.9984 (its target met with no float layer), PP-OCRv4 rec
    # 0.9729 → 0.9791 (23%; its search then reaches 0.9895 in 20 minutes, the normal one was at 0.975 after 12);
    # MiniLM 0.505 → 0.533 (6%, builds 3× slower) keeps normal; cls meets its target with normal.
    # In the last quarter of the budget the trials reuse the accepted build's ranges (seconds each,
    # ranges.py). Not from the start: mmse's ranges depend on the float16 set, and a whole search on one
    # build's ranges ended lower (rec 0.9843 vs 0.9895).
    # With outlier positions computed apart (outlier_positions.py), mmse and kl clip the copies that hold them,
    # which every token attends to: MiniLM all int8 0.58 with either, normal 0.95. Only normal is built then.
    ranges = search.choose_setting(
        "quantized_algorithm", builder.algorithm, ["mmse"] if other_algorithms else [],
        builder.use_algorithm, trials.evaluate, base_float, job.evaluation_samples, job.fallback["target"],
        job.progress, min_gain=0.15,  # an mmse build is at least 3x a normal one (MiniLM), often minutes
        # … and half the time left must stay for the phases after it: PP-OCRv4 rec kept mmse after 230 of its 300 s,
        # held-out 0.9889 / 97.9% (missed); without it, the spread set and kl meet the target (0.9945 / 98.7%)
        affordable=lambda algorithm: budget.allows(f"quantized_algorithm {algorithm} (with as long again left after it)",
                                                   2 * MMSE_SLOWER * budget.predict("trial")),
        acceptance=job.acceptance_samples)
    _faster_if_late(builder, base_float, budget)
    spread, base_float = _spread_layers(trials, job, base_float, budget)
    trials.base_float = base_float  # the search ranks the builds it trials: with the spread set float16
    again = {} if builder.split.record else _ranges_with_spread(builder, trials, job, base_float, spread, budget)
    weights = _mmse_weights(builder, trials, job, base_float, budget) if other_algorithms else {}
    ops = {n.name: n.op_type for n in job.model.graph.node}
    # the Slices and Concats of outlier_positions.py compute nothing: float16 there would only move a conversion
    singles = [n.name for n in job.model.graph.node if n.name not in base_float and n.name not in builder.split.added]
    trials.groups = _chain_groups(job.model, base_float)
    # the layers that compute the outputs are tried first: the toolkit makes an output int8 "for performance",
    # one more rounding of exactly what the user reads, which a single-layer error does not rank by its effect
    # (all-MiniLM-L6-v2: 1 - 0.99886, the 19th-worst of 232 layers, and +0.0005 on the output as the only float16
    # layer)
    outputs = {o.name for o in job.model.graph.output}
    first = tuple(n.name for n in job.model.graph.node if set(n.output) & outputs and n.name in singles)
    candidates = search.Candidates(list(trials.groups) + singles, groups=trials.groups, ops=ops,
                                   group_kind="LayerNorm chain", first=first)
    # kl once more after a missed search, unless it lost already after the spread set (EfficientNet-Lite0: 0.9931
    # vs 0.9974; the time kept for it would only shorten the search)
    kl_after = other_algorithms and "kl_divergence" not in again.get("scores", {})
    if kl_after:  # time kept for a kl build on the float16 set the search ends at
        budget.reserve_kind, budget.reserve_factor = "trial", KL_SLOWER
    outcome = search.Search(trials, candidates, base_float, job.evaluation_samples,
                            channel_spread.search_options(job.fallback, spread), job.progress, budget,
                            job.acceptance_samples).run()
    budget.reserve_kind, budget.reserve_factor = None, 1.0
    after = _ranges_after_search(builder, trials, job, outcome, budget) if kl_after else {}
    measured = {"ranges_with_spread": again, "weight_rounding": weights, "ranges_after_search": after}
    outcome.record.update(ranges=ranges, spread_tensors=spread, budget=budget.record_dict(),
                          **{key: m for key, m in measured.items() if len(m.get("scores", {})) > 1})
    return outcome


def _mmse_weights(builder: RknnBuilder, trials: RknnTrials, job: BackendInput, base_float: set[str],
                  budget: Budget) -> dict:
    """`weight_rounding: mmse` against the weights as they are, with the ranges and the float16 set the phases
    before chose (`normal` or `kl_divergence`): mmse's gain can lie in its weight ranges
    (builder.MMSE_WEIGHT_SAMPLES), which a build on a few samples gives, and every later build stays as fast as
    a normal one. EfficientNet-Lite0 all int8 with its spread set float16: GPTQ 0.99738 → 0.99802 (target met)
    in ~60 s, where a full mmse build takes ~150 s and is affordable in its 300 s only in quiet minutes; the zoo's
    PP-OCRv3 det with kl ranges: 0.98669 → 0.98908. After the spread set and kl, which are cheaper: PP-OCRv4 rec
    meets its target with them, and mmse's weight ranges lose there (0.96735 vs GPTQ 0.97335 all int8)."""
    if builder.algorithm == "mmse" or not builder.rounds_weights() or builder.weight_rounding == "mmse":
        return {}
    before, now = builder.weight_rounding, builder.weights_in_use()  # under kl: nearest, whatever is configured

    def use(method: str) -> bool:
        return builder.use_weight_rounding(before if method == now else method)

    return search.choose_setting(
        "weight_rounding", now, ["mmse"], use, trials.evaluate, base_float, job.evaluation_samples,
        job.fallback["target"], job.progress, min_gain=0.05,
        affordable=lambda method: budget.allows(f"weight_rounding {method}",
                                                MMSE_WEIGHTS_SLOWER * budget.first("trial")
                                                + builder.step1_seconds("prepared")),
        acceptance=job.acceptance_samples)


def _faster_if_late(builder: RknnBuilder, base_float: set[str], budget: Budget) -> bool:
    """After a range build that takes minutes (mmse), a trial that would end in the budget's last FAST_SHARE
    reuses the accepted build's ranges from here (as the search itself does, search.Search.faster_if_late):
    otherwise the spread phase predicts every trial as slow as that build and is skipped (PP-OCRv4 rec: mmse kept
    after 230 s of 300, its spread phase skipped at ~206 s predicted, held-out 0.9792, target missed)."""
    late = budget.ends_in_last(search.FAST_SHARE, budget.predict("trial"))
    if builder.algorithm == "normal" or not late or not builder.reuse_ranges(base_float):
        return False
    budget.forget("trial", "rank")
    log.info("fallback: a %s trial would end in the last quarter of the budget: the builds from here reuse its "
             "ranges", builder.algorithm)
    return True


def _ranges_with_spread(builder: RknnBuilder, trials: RknnTrials, job: BackendInput, base_float: set[str],
                        spread: dict, budget: Budget) -> dict:
    """The range algorithm measured again once a spread set is float16 (`base_float` includes it): which one
    clips best depends on which tensors are still int8. From `normal`, `kl_divergence` (PP-OCRv4 rec: kl loses
    with every layer int8, 0.9713 vs 0.9734 on the evaluation samples, and wins with the spread set float16,
    held-out 0.9945 vs 0.9854, the target met with no node promoted; its builds take no longer than normal's).
    From `mmse`, `normal` and `kl_divergence`, kept on any gain (their builds are faster): all-MiniLM-L6-v2 on
    RKNN, mmse 0.908 vs normal 0.835 with every layer int8, but with the FFN outputs of layers 0-2 float16
    (Add, LayerNorm; 9 layers) normal 0.940 vs mmse 0.923 held-out."""
    if not spread.get("tensors"):
        return {}
    if builder.algorithm == "normal":
        return _kl_against_normal("quantized_algorithm with the spread set float16", builder, trials, job,
                                  base_float, budget)
    if builder.algorithm != "mmse":
        return {}
    return search.choose_setting(
        "quantized_algorithm with the spread set float16", builder.algorithm, ["normal", "kl_divergence"],
        builder.use_algorithm, trials.evaluate, base_float, job.evaluation_samples, job.fallback["target"],
        job.progress, min_gain=0.0,
        affordable=lambda algorithm: budget.allows(f"quantized_algorithm {algorithm}", budget.predict("trial")),
        acceptance=job.acceptance_samples)


def _ranges_after_search(builder: RknnBuilder, trials: RknnTrials, job: BackendInput, outcome: search.Outcome,
                         budget: Budget) -> dict:
    """`kl_divergence` ranges measured once more on the float16 set of a search that missed its target (from
    `normal` only, as after a spread set): once the layers that int8 hurts most are float16, kl's clipping costs
    less than it saves (all-MiniLM-L6-v2 with the 13 layers its search made float16: normal 0.9013, kl 0.9390
    held-out). Kept if they meet the target or remove MIN_GAIN of the error; the outcome then says so."""
    if outcome.passed or builder.algorithm != "normal" or not job.options["do_quantization"]:
        return {}
    target, float_set = job.fallback["target"], set(outcome.float_nodes)
    result = _kl_against_normal("quantized_algorithm on the search's float16 set", builder, trials, job, float_set,
                                budget)
    if result["chosen"] != result["configured"]:  # every evaluation below was made by choose_setting: remembered
        outputs = trials.evaluate(float_set, job.evaluation_samples)
        gate = search.judge(target, outputs, float_set, trials.evaluate, job.acceptance_samples)
        outcome.passed = gate["passed"]
        outcome.record.update(passed=gate["passed"], best={"score": search.score_of(outputs, target),
                                                           "metrics": search.gate_metrics(gate)})
        if gate["passed"]:
            outcome.record.pop("why", None)
    return result


def _kl_against_normal(setting: str, builder: RknnBuilder, trials: RknnTrials, job: BackendInput,
                       float_set: set[str], budget: Budget) -> dict:
    """`normal` against `kl_divergence` ranges on `float_set` (choose_setting), a kl build predicted at KL_SLOWER
    normal trials."""
    return search.choose_setting(
        setting, builder.algorithm, ["kl_divergence"], builder.use_algorithm, trials.evaluate, float_set,
        job.evaluation_samples, job.fallback["target"], job.progress,
        affordable=lambda algorithm: budget.allows(f"quantized_algorithm {algorithm}",
                                                   KL_SLOWER * budget.predict("trial")),
        acceptance=job.acceptance_samples)


def _spread_layers(trials: RknnTrials, job: BackendInput, base_float: set[str],
                   budget: Budget) -> tuple[dict, set[str]]:
    """Float16 layers around the tensors whose channels one int8 scale cannot share, one build per set tried
    (channel_spread.choose), before the search; the kept set joins the base float set → (record, base float
    set). They count against max_float_nodes, as with ORT."""
    if not job.options["do_quantization"]:
        return {}, base_float
    around = {}  # tensors → the layers that keep them float16

    def layers(tensors: frozenset[str]) -> set[str]:
        if tensors not in around:
            around[tensors] = channel_spread.nodes_around(job.model, tensors) - base_float
        return around[tensors]

    trying = [frozenset()]
    record, kept = channel_spread.choose(
        job, job.model, [o for n in job.model.graph.node if n.op_type != "Constant" for o in n.output], "float16",
        trying.append, lambda float_nodes, samples: trials.evaluate(float_nodes | layers(trying[-1]), samples),
        base_float, budget, lambda tensors: trials.count(layers(tensors)))
    return record, base_float | layers(kept)


def _chain_groups(model, base_float: set[str]) -> dict[str, tuple[str, ...]]:
    """Each LayerNorm chain as one candidate, named after its LayerNorm: float16 pays only for a chain whole
    (all-MiniLM-L6-v2, its token 0 computed apart, all int8 0.950 on 24 held-out samples: the FFN output's
    MatMul, residual Add or LayerNorm alone +0.0002 or less; the FFN chains of layers 4 and 5, 10 layers, 0.972)."""
    groups = {}
    for chain in outlier_positions.layernorm_chains(model):
        members = tuple(n for n in chain if n not in base_float)
        if len(members) > 1:
            groups[f"{chain[-1]} (chain)"] = members
    return groups


def _ranked(builder: RknnBuilder, job: BackendInput, base_float: set[str], analysis_samples: list[dict],
            chosen: tuple[str, ...], groups: dict[str, tuple[str, ...]]) -> list[dict]:
    """The nodes not yet float, by the error their IR tensors add on their own (1 - single cosine) in the
    build with `chosen` as float16 layers, largest first; one node per group of tensors. A LayerNorm chain
    (`groups`) gains what its nodes not yet float gain together."""
    chosen = {n for name in chosen for n in groups.get(name, (name,))}
    try:
        analysis = builder.session(base_float | chosen).analyze(analysis_samples)
    except QprepError as exc:
        if not chosen or getattr(exc, "crashed", False):  # a crashed worker took every build with it
            raise
        log.warning("rknn fallback: accuracy_analysis of the build with float16 layers failed (%s); "
                    "ranking stops", exc)
        return []
    ir = builder.ir_names()
    # rows carry the user's names, the IR map the toolkit's (io_names.py)
    single = {translated(row["tensor"], builder.renames): row.get("single_cosine", 1.0) for row in analysis}
    rows, seen = [], set()
    for node in job.model.graph.node:
        if node.name in base_float or node.name in chosen or node.name in builder.split.added:
            continue  # an added Slice maps to the tensors of the copy it feeds, which must rank under its own name
        tensors, _ = ir.map_node(node)
        key = tuple(tensors)
        if not tensors or key in seen or not any(t in single for t in tensors):
            continue
        seen.add(key)
        rows.append({"node": node.name, "gain": max(1.0 - single[t] for t in tensors if t in single)})
    gains = {row["node"]: row["gain"] for row in rows}
    for name, members in groups.items():
        if not chosen.issuperset(members):
            rows.append({"node": name, "gain": sum(gains.get(n, 0.0) for n in members)})
    return sorted(rows, key=lambda row: -row["gain"])
