"""The phases of RKNN's fallback around the node search, in the order search.py runs them: the range
algorithm (`range_algorithm`: mmse against normal), the builds from here on faster if that was late
(`faster_if_late`), the float16 set around spread tensors (`spread_layers`), the range algorithm again with that
set float16 (`ranges_with_spread`), mmse's weight ranges (`mmse_weights`), and kl once more on the float16 set
of a search that missed (`ranges_after_search`). Each is a setting measured at the outputs
(search.choose_setting) or a float16 set tried whole, and each is offered on its own: the tests drive each
phase with a scripted builder, where a real one takes minutes a build.

The cost ratios below predict a build from the trials measured so far (Budget.predict); they are the slowest
measured, and where they were measured is in BENCHMARKS.md.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from qprep.quantize import channel_spread, search
from qprep.quantize.backend import QuantizeJob
from qprep.quantize.budget import Budget

if TYPE_CHECKING:  # the builder and the trials are handed in (search.py)
    from qprep.quantize.rknn.builder import RknnBuilder
    from qprep.quantize.rknn.trials import RknnTrials

log = logging.getLogger("qprep")

# how many times a normal build (with its evaluation) an mmse one takes, the slowest measured; a lower ratio let
# an mmse build start that ended past the budget (BENCHMARKS.md: "An mmse build was predicted at 3× a normal one")
MMSE_SLOWER = 20.0
# a kl_divergence trial against a normal one: its hybrid step1 (histograms over the calibration samples) runs
# again (BENCHMARKS.md: "kl_divergence ranges after the spread set, and after a missed search")
KL_SLOWER = 3.5
# weight_rounding mmse against the fallback's first trial (all int8 but the base float set, its build plain where
# that set is empty): an mmse build on a few samples, then a hybrid trial with its weight ranges. Not the
# slowest recent trial: after a switch of ranges it holds a step1, and the phase was skipped on that prediction.
# Plus a step1 on the model as prepared where none is kept (from GPTQ weights under normal ranges); under kl the
# file does not change (BENCHMARKS.md: "the mmse weight phase predicted from the first trial")
MMSE_WEIGHTS_SLOWER = 12.0


def range_algorithm(builder: RknnBuilder, trials: RknnTrials, job: QuantizeJob, base_float: set[str],
                    budget: Budget, alternatives: list[str]) -> dict:
    """`mmse` against the configured `normal` ranges, all int8 but `base_float` (choose_setting). mmse searches
    weight and activation ranges in step2, so every later build pays it again (minutes, vs seconds): measured once,
    kept only if it removes 15% of the error, and started only with as long again left after it for the phases
    that follow. In the last quarter of the budget the trials reuse the accepted build's ranges (ranges.py); not
    from the start: mmse's ranges depend on the float16 set, and a whole search on one build's ranges ended lower.
    With outlier positions computed apart (outlier_positions.py), mmse and kl clip the copies that hold them,
    which every token attends to: only normal is built then (the caller passes no alternative). The figures:
    BENCHMARKS.md, "the range algorithm measured first" and "mmse is started only when as long again is left"."""
    return search.choose_setting(
        "quantized_algorithm", builder.algorithm, alternatives,
        builder.use_algorithm, trials.evaluate, base_float, job.evaluation_samples, job.fallback.target,
        job.progress, min_gain=0.15,  # an mmse build is at least 3x a normal one, often minutes
        affordable=lambda algorithm: budget.allows(f"quantized_algorithm {algorithm} (with as long again left after it)",
                                                   2 * MMSE_SLOWER * budget.predict("trial")),
        acceptance=job.acceptance_samples)


def faster_if_late(builder: RknnBuilder, base_float: set[str], budget: Budget) -> bool:
    """After a range build that takes minutes (mmse), a trial that would end in the budget's last FAST_SHARE
    reuses the accepted build's ranges from here (as the search itself does, search.Search.faster_if_late):
    otherwise the spread phase predicts every trial as slow as that build and is skipped, and the target is
    missed (BENCHMARKS.md: "after a slow range build late in the budget")."""
    late = budget.ends_in_last(search.FAST_SHARE, budget.predict("trial"))
    if builder.algorithm == "normal" or not late or not builder.reuse_ranges(base_float):
        return False
    budget.forget("trial", "rank")
    log.info("fallback: a %s trial would end in the last quarter of the budget: the builds from here reuse its "
             "ranges", builder.algorithm)
    return True


def spread_layers(trials: RknnTrials, job: QuantizeJob, base_float: set[str],
                  budget: Budget) -> tuple[dict, set[str]]:
    """Float16 layers around the tensors whose channels one int8 scale cannot share, one build per set tried
    (channel_spread.choose), before the search; the kept set joins the base float set → (record, base float
    set). They count against max_float_nodes, as with ORT."""
    if not job.options.do_quantization:
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


def ranges_with_spread(builder: RknnBuilder, trials: RknnTrials, job: QuantizeJob, base_float: set[str],
                       spread: dict, budget: Budget) -> dict:
    """The range algorithm measured again once a spread set is float16 (`base_float` includes it): which one
    clips best depends on which tensors are still int8. From `normal`, `kl_divergence`: it can lose with every
    layer int8 and win once the few channels it would clip are float16, and its builds take no longer than
    normal's. From `mmse`, `normal` and `kl_divergence`, kept on any gain (their builds are faster): mmse can win
    with every layer int8 and lose with the spread set float16. The figures: BENCHMARKS.md, "kl_divergence ranges
    after the spread set, and after a missed search"."""
    if not spread.get("tensors"):
        return {}
    if builder.algorithm == "normal":
        return _kl_against_normal("quantized_algorithm with the spread set float16", builder, trials, job,
                                  base_float, budget)
    if builder.algorithm != "mmse":
        return {}
    return search.choose_setting(
        "quantized_algorithm with the spread set float16", builder.algorithm, ["normal", "kl_divergence"],
        builder.use_algorithm, trials.evaluate, base_float, job.evaluation_samples, job.fallback.target,
        job.progress, min_gain=0.0,
        affordable=lambda algorithm: budget.allows(f"quantized_algorithm {algorithm}", budget.predict("trial")),
        acceptance=job.acceptance_samples)


def mmse_weights(builder: RknnBuilder, trials: RknnTrials, job: QuantizeJob, base_float: set[str],
                 budget: Budget) -> dict:
    """`weight_rounding: mmse` against the weights as they are, with the ranges and the float16 set the phases
    before chose (`normal` or `kl_divergence`): mmse's gain can lie in its weight ranges
    (model_file.MMSE_WEIGHT_SAMPLES), which a build on a few samples gives, and every later build stays as fast as
    a normal one, where a full mmse build per trial may not fit the budget. After the spread set and kl, which
    are cheaper, since mmse's weight ranges can lose to GPTQ's (BENCHMARKS.md: "mmse's weight ranges without an
    mmse build per trial")."""
    if builder.algorithm == "mmse" or not builder.rounds_weights() or builder.weight_rounding == "mmse":
        return {}
    before, now = builder.weight_rounding, builder.weights_in_use()  # under kl: nearest, whatever is configured

    def use(method: str) -> bool:
        return builder.use_weight_rounding(before if method == now else method)

    return search.choose_setting(
        "weight_rounding", now, ["mmse"], use, trials.evaluate, base_float, job.evaluation_samples,
        job.fallback.target, job.progress, min_gain=0.05,
        affordable=lambda method: budget.allows(f"weight_rounding {method}",
                                                MMSE_WEIGHTS_SLOWER * budget.first("trial")
                                                + builder.step1_seconds("prepared")),
        acceptance=job.acceptance_samples)


def ranges_after_search(builder: RknnBuilder, trials: RknnTrials, job: QuantizeJob, outcome: search.Outcome,
                        budget: Budget) -> dict:
    """`kl_divergence` ranges measured once more on the float16 set of a search that missed its target (from
    `normal` only, as after a spread set): once the layers that int8 hurts most are float16, kl's clipping costs
    less than it saves (BENCHMARKS.md, as for ranges_with_spread). Kept if they meet the target or remove
    MIN_GAIN of the error; the outcome then says so."""
    if outcome.passed or builder.algorithm != "normal" or not job.options.do_quantization:
        return {}
    target, float_set = job.fallback.target, set(outcome.float_nodes)
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


def _kl_against_normal(setting: str, builder: RknnBuilder, trials: RknnTrials, job: QuantizeJob,
                       float_set: set[str], budget: Budget) -> dict:
    """`normal` against `kl_divergence` ranges on `float_set` (choose_setting), a kl build predicted at KL_SLOWER
    normal trials."""
    return search.choose_setting(
        setting, builder.algorithm, ["kl_divergence"], builder.use_algorithm, trials.evaluate, float_set,
        job.evaluation_samples, job.fallback.target, job.progress,
        affordable=lambda algorithm: budget.allows(f"quantized_algorithm {algorithm}",
                                                   KL_SLOWER * budget.predict("trial")),
        acceptance=job.acceptance_samples)

