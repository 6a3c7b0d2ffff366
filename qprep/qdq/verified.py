"""Apply a QDQ stage's rules in verified batches and roll back, one by one, the rewrites that fail.

The optimize stage verifies a whole pass and rolls the pass back. Here every rewrite is keyed by an *anchor*
(the name of the node it rewrites: the Conv it fuses, the Q it removes), so a failure costs only that rewrite:

    round:  apply every rule to the last accepted model (anchors that failed before excluded) → check
            ok                    → accept the batch
            culprits named        → the check pinned the failure on rewrites (a per-node probe): exclude them,
                                    retry the rest
            failure, no culprit   → split the batch in halves and settle each half on its own (bisection)
    repeat while a round still applies something (one rewrite often exposes the next match).

The check compares against the stage's input model, never against the previous batch, so accepted batches
cannot add up to more than the tolerance. A rule's `check` calls `log.permits(anchor)`; `rewrite` records a
`Rewrite` in the log with the nodes it orphaned, which are removed afterwards (nothing else in the graph is).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import onnx
import onnx_ir as ir
from onnx import helper
from onnxscript.rewriter import MatchResult

from qprep.errors import QprepError
from qprep.graph.verify import Tolerance, compare, cosine

# onnx.checker's verdict exactly as the optimize stage applies it (ORT runs some invalid graphs, so numbers
# alone do not prove validity). Private there today; see the report: it belongs in qprep/graph/verify.py.
from qprep.graph.verify import checker_problem as invalid
from qprep.model.prepare import name_nodes
from qprep.model.runtime import intermediate_values, ort_session, run_model
from qprep.qdq.params import drop_identity, remove_dead

log = logging.getLogger("qprep")


@dataclass
class Probe:
    """Where one rewrite can be checked on its own: feed the reference model's values of `inputs` to the
    rewritten subgraph and compare its `output` with the reference's, |a - b| <= atol + rtol * |a|."""

    inputs: list[str]
    output: str
    atol: float
    rtol: float = 0.0
    unit: str = ""  # how atol reads, for the record ("1 step of uint8 scale 0.031")


@dataclass
class Rewrite:
    anchor: str
    kind: str
    facts: dict = field(default_factory=dict)
    probe: Probe | None = None


class RewriteLog:
    """Shared by a stage's rules during one application: which anchors may be rewritten, what was, and why the
    other candidates were not."""

    def __init__(self, allowed: set[str] | None = None, excluded=()):
        self.allowed = allowed
        self.excluded = set(excluded)
        self.applied: list[Rewrite] = []
        self.refused: dict[str, str] = {}  # anchor -> reason (the last rule to look at it wins)
        self.orphans: list[ir.Node] = []  # producers a rewrite may have left without consumers
        self.identities: list[ir.Node] = []  # Identity nodes rules emitted to forward an existing value

    def permits(self, anchor: str | None) -> bool:
        return bool(anchor) and anchor not in self.excluded and (self.allowed is None or anchor in self.allowed)

    def refuse(self, anchor: str | None, reason: str, *sources) -> MatchResult:
        """A failed check with its reason, remembered for the record (only in unrestricted runs)."""
        if anchor and self.allowed is None:
            self.refused[anchor] = reason
        return MatchResult().fail(reason, *sources)

    def forward(self, op, value: ir.Value) -> ir.Value:
        """The rewrite result is an existing value: emit an Identity now, remove it after the sweep."""
        result = op.Identity(value)
        self.identities.append(result.producer())
        return result

    def finish(self) -> None:
        for node in self.identities:
            if node.graph is not None:
                drop_identity(node)
        remove_dead(self.orphans)


@dataclass
class Verdict:
    ok: bool
    reason: str = ""
    culprits: dict[str, str] = field(default_factory=dict)  # anchor -> why: failures pinned on one rewrite
    record: dict = field(default_factory=dict)  # what the check measured (outputs, probes), for the record


Apply = Callable[[ir.Model, RewriteLog], None]
Check = Callable[[onnx.ModelProto, list[Rewrite]], Verdict]


@dataclass
class Outcome:
    model: onnx.ModelProto
    applied: list[Rewrite]
    refused: dict[str, str]
    rolled_back: list[dict]
    checks: int
    verification: dict  # the record of the last accepted check
    rewrite_seconds: float
    verify_seconds: float


class _Engine:
    def __init__(self, apply: Apply, check: Check, validate: Callable[[onnx.ModelProto], str | None]):
        self.apply, self.check, self.validate = apply, check, validate
        self.applied: list[Rewrite] = []
        self.failed: dict[str, dict] = {}
        self.refused: dict[str, str] = {}
        self.checks = 0
        self.verification: dict = {}
        self.rewrite_seconds = self.verify_seconds = 0.0

    def attempt(self, model: onnx.ModelProto, allowed: set[str] | None) -> tuple[onnx.ModelProto, RewriteLog]:
        start = time.perf_counter()
        ir_model = ir.from_proto(model)
        rewrite_log = RewriteLog(allowed, self.failed)
        self.apply(ir_model, rewrite_log)
        rewrite_log.finish()
        candidate = ir.to_proto(ir_model) if rewrite_log.applied else model
        self.rewrite_seconds += time.perf_counter() - start
        if allowed is None:
            self.refused.update(rewrite_log.refused)
        return candidate, rewrite_log

    def verify(self, candidate: onnx.ModelProto, rewrites: list[Rewrite]) -> Verdict:
        start = time.perf_counter()
        self.checks += 1
        problem = self.validate(candidate)
        try:
            verdict = Verdict(False, problem) if problem else self.check(candidate, rewrites)
        except QprepError as exc:  # ONNX Runtime refused the candidate
            verdict = Verdict(False, str(exc))
        self.verify_seconds += time.perf_counter() - start
        return verdict

    def settle(self, base: onnx.ModelProto, anchors: list[str] | None) -> onnx.ModelProto:
        """Apply the anchors (None: every candidate) on `base`; keep what verifies, roll back what does not."""
        candidate, rewrite_log = self.attempt(base, None if anchors is None else set(anchors))
        if not rewrite_log.applied:
            return base
        verdict = self.verify(candidate, rewrite_log.applied)
        if verdict.ok:
            self.applied += rewrite_log.applied
            self.verification = verdict.record
            return candidate
        kinds: dict[str, str] = {}
        for r in rewrite_log.applied:
            kinds[r.anchor] = f"{kinds[r.anchor]}+{r.kind}" if r.anchor in kinds else r.kind
        if verdict.culprits:
            for anchor, reason in verdict.culprits.items():
                self._fail(anchor, kinds.get(anchor, "?"), reason)
            return self.settle(base, [r.anchor for r in rewrite_log.applied if r.anchor not in self.failed])
        # one anchor can carry several rewrites (a Conv's epilogue folds and its fusion): bisect anchors, since
        # re-applying one anchor re-applies all of its rewrites
        batch = list(dict.fromkeys(r.anchor for r in rewrite_log.applied))
        if len(batch) == 1:
            self._fail(batch[0], kinds[batch[0]], verdict.reason)
            return base
        middle = len(batch) // 2
        return self.settle(self.settle(base, batch[:middle]), batch[middle:])

    def _fail(self, anchor: str, kind: str, reason: str) -> None:
        log.warning("rewrite %s (%s) rolled back: %s", anchor, kind, reason)
        # "pass" is the key the report renderers read for every stage's rollbacks (optimize's record shape)
        self.failed[anchor] = {"pass": f"{kind} {anchor}", "rewrite": anchor, "kind": kind, "reason": reason}


def apply_verified(model: onnx.ModelProto, apply: Apply, check: Check, max_rounds: int = 8) -> Outcome:
    """Run `apply` (the stage's rules on an IR copy) until nothing more matches, keeping only what `check` and
    onnx.checker accept. The input proto is not modified."""
    engine = _Engine(apply, check, invalid)
    current = _named(model)
    for _ in range(max_rounds):
        before = (len(engine.applied), len(engine.failed))
        current = engine.settle(current, None)
        if (len(engine.applied), len(engine.failed)) == before:
            break
    applied_anchors = {r.anchor for r in engine.applied}
    refused = {a: r for a, r in engine.refused.items() if a not in applied_anchors and a not in engine.failed}
    return Outcome(model=current, applied=engine.applied, refused=refused, rolled_back=list(engine.failed.values()),
                   checks=engine.checks, verification=engine.verification,
                   rewrite_seconds=round(engine.rewrite_seconds, 3), verify_seconds=round(engine.verify_seconds, 3))


def _named(model: onnx.ModelProto) -> onnx.ModelProto:
    """Rewrites are keyed by node names: a model from outside the pipeline (whose loader names every node) gets
    the loader's names on a copy."""
    names = [node.name for node in model.graph.node]
    if all(names) and len(set(names)) == len(names):
        return model
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    name_nodes(copy.graph)
    return copy


# ---------------------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------------------


class OutputCheck:
    """Every output of the candidate against the stage's input model, one tolerance for all outputs."""

    def __init__(self, reference: onnx.ModelProto, samples: list[dict], tolerance: Tolerance, threads: int = 2):
        self.samples, self.tolerance, self.threads = samples, tolerance, threads
        self.reference = run_model(reference, samples, threads)

    def __call__(self, candidate: onnx.ModelProto, rewrites: list[Rewrite]) -> Verdict:
        verification = compare(self.reference, run_model(candidate, self.samples, self.threads), self.tolerance)
        return Verdict(verification.ok, verification.reason, record=verification.as_dict())


class ProbeCheck:
    """Each rewrite on its own (its probe: the rewritten subgraph fed the reference model's own inputs to it),
    then the whole candidate against the reference outputs, gated by cosine per output.

    Why both: the integer kernels round differently from float Conv + QuantizeLinear on some elements, and a
    one-step difference early in a deep network moves the final outputs by several steps (ONNX Runtime's own
    QDQ fusion does the same), so "one quantization step" can only be proved per rewritten node. The end-to-end
    comparison catches what a per-node probe cannot (wiring, names) and is recorded in output steps.
    """

    def __init__(self, reference: onnx.ModelProto, samples: list[dict], steps: dict[str, dict], min_cosine: float,
                 threads: int = 2):
        self.reference_model, self.samples, self.steps = reference, samples, steps
        self.min_cosine, self.threads = min_cosine, threads
        self.reference = run_model(reference, samples, threads)
        self._captured: dict[str, list[np.ndarray]] = {}
        self.measured: dict[str, tuple[float, str]] = {}  # anchor -> (worst probe error, its unit), last probe

    def __call__(self, candidate: onnx.ModelProto, rewrites: list[Rewrite]) -> Verdict:
        probes = [r for r in rewrites if r.probe is not None]
        self._capture({name for r in probes for name in (*r.probe.inputs, r.probe.output)})
        culprits = {}
        for rewrite in probes:
            problem, measured = self._probe(candidate, rewrite.probe)
            if problem:
                culprits[rewrite.anchor] = problem
            self.measured[rewrite.anchor] = (measured, rewrite.probe.unit)
        if culprits:
            return Verdict(False, "; ".join(f"{a}: {r}" for a, r in culprits.items()), culprits)
        result = run_model(candidate, self.samples, self.threads)
        outputs, reasons = {}, []
        for name in self.reference[0]:
            if name not in result[0]:
                return Verdict(False, f"output '{name}' disappeared")
            shapes = {(np.shape(r[name]), np.shape(c[name])) for r, c in zip(self.reference, result)}
            changed = next(((a, b) for a, b in shapes if a != b), None)
            if changed:  # broadcasting would otherwise compare a wrong-shaped output without complaint
                return Verdict(False, f"output '{name}' changed shape {changed[0]} -> {changed[1]}")
            stats = _output_stats([r[name] for r in self.reference], [c[name] for c in result], self.steps.get(name))
            outputs[name] = stats
            if stats["cosine_min"] < self.min_cosine:
                reasons.append(f"output '{name}': cosine {stats['cosine_min']:.6f} < {self.min_cosine}")
        record = {"samples": len(self.samples), "outputs": outputs}
        return Verdict(not reasons, "; ".join(reasons), record=record)

    def _capture(self, names: set[str]) -> None:
        """The reference model's values of these tensors on every sample (one ORT run for all new names)."""
        missing = sorted(names - set(self._captured))
        if not missing:
            return
        for values in intermediate_values(self.reference_model, missing, self.samples, self.threads):
            for name, value in values.items():
                self._captured.setdefault(name, []).append(value)

    def _probe(self, candidate: onnx.ModelProto, probe: Probe) -> tuple[str | None, float]:
        """(why it fails or None, the worst error in the probe's unit)."""
        inputs = {name: self._captured[name][0].dtype for name in probe.inputs}
        expected = self._captured[probe.output]
        model = subgraph(candidate, inputs, probe.output, expected[0].dtype)
        try:
            session = ort_session(model, threads=self.threads)
            got = [session.run([probe.output], {n: self._captured[n][i] for n in probe.inputs})[0]
                   for i in range(len(self.samples))]
        except Exception as exc:  # noqa: BLE001 - ORT raises its own types; the reason goes to the record
            return f"ONNX Runtime cannot run the rewritten node: {str(exc).splitlines()[0][:160]}", float("inf")
        worst = 0.0
        for a, b in zip(expected, got):
            a64, b64 = a.astype(np.float64), b.astype(np.float64)
            if a.shape != b.shape:
                return f"shape {b.shape} differs from {a.shape}", float("inf")
            excess = np.abs(a64 - b64) - probe.rtol * np.abs(a64)
            worst = max(worst, float(excess.max()) if excess.size else 0.0)
        if worst > probe.atol:
            return f"differs from the QDQ original by {worst:.4g} > {probe.atol:.4g} ({probe.unit})", worst
        return None, worst


def _output_stats(reference: list[np.ndarray], result: list[np.ndarray], step: dict | None) -> dict:
    max_abs = max(float(np.abs(np.asarray(a, np.float64) - b).max()) for a, b in zip(reference, result))
    stats = {"max_abs": max_abs, "cosine_min": min(cosine(a, b) for a, b in zip(reference, result))}
    if step and step.get("scale"):
        stats.update(step=step["scale"], max_steps=round(max_abs / step["scale"], 3), step_from=step["from"])
    return stats


def subgraph(model: onnx.ModelProto, inputs: dict[str, np.dtype], output: str, output_dtype) -> onnx.ModelProto:
    """The nodes computing `output` from `inputs` (and constants), as a model of their own."""
    producers = {name: node for node in model.graph.node for name in node.output if name}
    initializers = {t.name: t for t in model.graph.initializer}
    order = {id(node): i for i, node in enumerate(model.graph.node)}
    chosen: dict[int, onnx.NodeProto] = {}
    stack = [output]
    while stack:
        name = stack.pop()
        if not name or name in inputs or name in initializers:
            continue
        node = producers.get(name)
        if node is None:
            raise QprepError(f"probe of '{output}': '{name}' is not computed from {sorted(inputs)} "
                             "(internal: a rule declared an incomplete probe)")
        if id(node) not in chosen:
            chosen[id(node)] = node
            stack.extend(node.input)
    nodes = sorted(chosen.values(), key=lambda n: order[id(n)])
    used = {name for node in nodes for name in node.input}
    graph = helper.make_graph(
        nodes, "probe",
        [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(np.dtype(d)), None)
         for n, d in inputs.items()],
        [helper.make_tensor_value_info(output, helper.np_dtype_to_tensor_dtype(np.dtype(output_dtype)), None)],
        [initializers[n] for n in sorted(used) if n in initializers])
    return helper.make_model(graph, opset_imports=list(model.opset_import), ir_version=model.ir_version)
