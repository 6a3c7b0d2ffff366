"""RKNN's trial and RKNN's ranking for the fallback's search (qprep/quantize/search/): a trial is a build on the
simulator (builder.py), and candidates are ranked by the toolkit's accuracy_analysis of the current build
(runner.py), not by one trial per candidate. What the search may make float16 (`candidates`): each LayerNorm
chain as one candidate, then every node not float yet, the layers that compute the outputs first.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from qprep.errors import QprepError
from qprep.quantize import outlier_positions, search
from qprep.quantize.backend import QuantizeJob
from qprep.quantize.budget import Budget
from qprep.quantize.rknn.io_names import translated

if TYPE_CHECKING:  # the builder is handed in (convert.py builds it)
    from qprep.quantize.rknn.builder import RknnBuilder

log = logging.getLogger("qprep")


class RknnTrials(search.SearchBackend):
    """The search's backend: a trial is a build on the simulator (a hybrid step2, seconds to minutes), so
    candidates are ranked by the toolkit's accuracy_analysis of the current build (the error each layer adds
    on its own) — all int8 in the first round, with the float16 layers promoted so far in later ones — not by
    one trial per node. The best build on all evaluation samples is pinned: the final export reuses it."""

    ranks_itself = True

    def __init__(self, builder: RknnBuilder, job: QuantizeJob, base_float: set[str], budget: Budget):
        self.builder, self.job, self.base_float, self.budget = builder, job, base_float, budget
        self.analysis_samples = job.evaluation_samples[: max(1, job.options.analysis_samples)]
        self.best_score = float("-inf")  # on the evaluation samples the search chooses on, so far
        self.remembered = search.Remembered(self.measure, lambda: builder.setting)
        self.groups: dict[str, tuple[str, ...]] = {}  # candidate name → its nodes (LayerNorm chains)
        self._ir_tensors: dict[str, tuple[str, ...]] = {}  # node → its IR tensors (count)
        self._nodes = {n.name: n for n in job.model.graph.node}

    def measure(self, float_nodes: set[str], samples: list[dict]) -> dict:
        with self.budget.timed("trial" if samples is self.job.evaluation_samples else "rank"):
            outputs = self.job.measure(samples, self.builder.session(float_nodes)(samples))
        score = search.score_of(outputs, self.job.fallback.target)
        if samples is self.job.evaluation_samples and score > self.best_score:  # the build the search returns
            self.best_score = score
            self.builder.pin(float_nodes)
        return outputs

    def evaluate(self, float_nodes: set[str], samples: list[dict]) -> dict:
        return self.remembered(float_nodes, samples)

    def count(self, float_nodes: set[str]) -> int:
        """The float16 layers `float_nodes` make: their distinct IR tensors (what a "≤ N non-int8 layers" budget
        counts; a MatMul and its bias Add are one layer, a node the toolkit fused away none)."""
        if not self.job.options.do_quantization:  # no hybrid build, no IR names
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


def candidates(job: QuantizeJob, builder: RknnBuilder, base_float: set[str]) -> search.Candidates:
    """What the search may make float16: each LayerNorm chain (chain_groups), then each node not float yet; the
    layers that compute the outputs are promoted first."""
    ops = {n.name: n.op_type for n in job.model.graph.node}
    # the Slices and Concats of outlier_positions.py compute nothing: float16 there would only move a conversion
    singles = [n.name for n in job.model.graph.node if n.name not in base_float and n.name not in builder.split.added]
    groups = chain_groups(job.model, base_float)
    # the layers that compute the outputs are tried first: the toolkit makes an output int8 "for performance",
    # one more rounding of exactly what the user reads, which a single-layer error does not rank by its effect
    # (BENCHMARKS.md: "output layers tried first")
    outputs = {o.name for o in job.model.graph.output}
    first = tuple(n.name for n in job.model.graph.node if set(n.output) & outputs and n.name in singles)
    return search.Candidates(list(groups) + singles, groups=groups, ops=ops, group_kind="LayerNorm chain",
                             first=first)


def chain_groups(model, base_float: set[str]) -> dict[str, tuple[str, ...]]:
    """Each LayerNorm chain as one candidate, named after its LayerNorm: float16 pays only for a chain whole (a
    MatMul, residual Add or LayerNorm of the chain alone gains next to nothing; BENCHMARKS.md: "LayerNorm chains
    as fallback candidates")."""
    groups = {}
    for chain in outlier_positions.layernorm_chains(model):
        members = tuple(n for n in chain if n not in base_float)
        if len(members) > 1:
            groups[f"{chain[-1]} (chain)"] = members
    return groups


def _ranked(builder: RknnBuilder, job: QuantizeJob, base_float: set[str], analysis_samples: list[dict],
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

