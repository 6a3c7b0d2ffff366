"""The accuracy-driven fallback with RKNN builds: which layers become float16 (and whether `mmse` replaces
the `normal` range algorithm; which layers around tensors whose channels spread too far for int8 go float16
first) until the target is met or the budget spent. The search itself is qprep/quantize/search/; RKNN's trial
and ranking are in trials.py, the phases before and after the search in phases.py; this module runs them in
order. The builder is handed in (convert.py): nothing here builds one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qprep.quantize import search
from qprep.quantize.backend import QuantizeJob
from qprep.quantize.budget import Budget
from qprep.quantize.rknn import phases
from qprep.quantize.rknn import trials as rknn_trials

if TYPE_CHECKING:
    from qprep.quantize.rknn.builder import RknnBuilder


def fallback(builder: RknnBuilder, base_float: set[str], job: QuantizeJob) -> search.Outcome:
    """Which layers become float16, and which ranges build them: `mmse` against `normal` first, then the spread
    set, `kl_divergence` once that set is float16, mmse's weight ranges, the search with RKNN trials, and kl once
    more on the float16 set of a search that missed (each phase's reasons in phases.py)."""
    budget = Budget(job.fallback.time_budget_s, job.started)
    trials = rknn_trials.RknnTrials(builder, job, base_float, budget)
    # with outlier positions computed apart, mmse and kl clip the copies that hold them: only normal is built
    other_algorithms = (builder.algorithm == "normal" and job.options.do_quantization
                        and not builder.split.record)
    ranges = phases.range_algorithm(builder, trials, job, base_float, budget, ["mmse"] if other_algorithms else [])
    phases.faster_if_late(builder, base_float, budget)
    spread, base_float = phases.spread_layers(trials, job, base_float, budget)
    trials.base_float = base_float  # the search ranks the builds it trials: with the spread set float16
    again = {} if builder.split.record else phases.ranges_with_spread(builder, trials, job, base_float, spread, budget)
    weights = phases.mmse_weights(builder, trials, job, base_float, budget) if other_algorithms else {}
    candidates = rknn_trials.candidates(job, builder, base_float)
    trials.groups = candidates.groups
    # kl once more after a missed search, unless it lost already after the spread set (the time kept for it would
    # only shorten the search)
    kl_after = other_algorithms and "kl_divergence" not in again.get("scores", {})
    if kl_after:  # time kept for a kl build on the float16 set the search ends at
        budget.reserve_kind, budget.reserve_factor = "trial", phases.KL_SLOWER
    outcome = search.Search(trials, candidates, base_float, job.evaluation_samples,
                            search.node_search(job.fallback, spread), job.progress, budget,
                            job.acceptance_samples).run()
    budget.reserve_kind, budget.reserve_factor = None, 1.0
    after = phases.ranges_after_search(builder, trials, job, outcome, budget) if kl_after else {}
    measured = {"ranges_with_spread": again, "weight_rounding": weights, "ranges_after_search": after}
    outcome.record.update(ranges=ranges, spread_tensors=spread, budget=budget.record_dict(),
                          **{key: m for key, m in measured.items() if len(m.get("scores", {})) > 1})
    return outcome
