"""Accuracy-driven fallback: keep the fewest nodes float until an accuracy target holds.

Why measured, not by op type: excluding a whole op type from int8 can make a model *worse*, and
restoring the most harmful nodes together is not the sum of restoring each one (BENCHMARKS.md: "float nodes
measured, not chosen by op type"). So:

1. rank: quantize everything once (the base), then restore one candidate at a time and measure the outputs
   on a subset of the evaluation samples; a candidate's damage is how much its restoring helps. A candidate is
   a node, or a group of nodes that only together keep something float (ORT: an activation edge).
2. promote: add nodes in ranked order (`block` at a time, for backends where one build takes minutes),
   re-quantize and re-evaluate on all evaluation samples; a block that does not improve the outputs is dropped
   again. Then rank the rest again on top of the new float set (harm interacts) and promote again. Stop when
   the target holds, at `max_float_nodes`, when nothing helps any more, or when the time budget is spent.

The best float set found is always returned (the target met with the fewest float nodes, else the best score);
the backend builds its final model from it. The modules, in the order a search uses them:
    options.py      OPTIONS, the `quantize.fallback` config section; NodeSearch, what the node search reads of it
    backend.py      SearchBackend (what the search asks a backend: `evaluate(float_nodes, samples) →
                    per-output metrics`; where one trial per node is too slow, RKNN, `rank(chosen) → [{node, gain}]`
                    from its own per-layer analysis) and Candidates (what it may make float)
    acceptance.py   chosen on some samples, accepted on others: split_samples, judge (the gate with one standard
                    error to spare), score_of (the number the search climbs)
    settings.py     choose_setting (a backend setting measured before the node search) and Remembered (the memo
                    of builds every phase shares)
    rounds.py       Search: `Search(backend, Candidates(...), ...).run()` is the search, one Round at a time

The names below are what the backends (ort/search.py, rknn/search.py), the stage and channel_spread.py use.
"""

from qprep.quantize.search.acceptance import allowed_disagreement, gate_metrics, judge, score_of, split_samples
from qprep.quantize.search.backend import Candidates, SearchBackend
from qprep.quantize.search.options import OPTIONS, SEARCHED_NODES, NodeSearch, node_search
from qprep.quantize.search.rounds import FAST_SHARE, Outcome, Round, Search, Trial
from qprep.quantize.search.settings import Remembered, choose_setting

__all__ = ["FAST_SHARE", "OPTIONS", "SEARCHED_NODES", "Candidates", "NodeSearch", "Outcome", "Remembered", "Round",
           "Search", "SearchBackend", "Trial", "allowed_disagreement", "choose_setting", "gate_metrics", "judge",
           "node_search", "score_of", "split_samples"]
