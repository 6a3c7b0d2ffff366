"""The `remove_redundant_qdq` stage: Q/DQ nodes that compute nothing, removed; dequantization moved past
data-movement ops so they run on quantized data.

Rules (each exact: the outputs do not change, which the stage verifies to 1e-6 against its input model):

    round_trip     Q(DQ(q)) with identical type, axis, scales and zero points → q.
                   DQ→Q is then the identity: (q - z)·s / s rounds back to q for every 8/16-bit q. A chain
                   Q→DQ→Q→DQ with equal parameters is a round trip in the middle: it collapses to one pair.
    scaled_round_trip
                   Q(DQ(q)·c) or Q(DQ(q)/c), c a positive scalar constant, 8-bit q, Q's scale equal to DQ's
                   times c (divided by c) within a relative 1e-4, same type and zero point → q. Q computes
                   round((q - z)·r) + z with |r - 1| < 1e-4 and |q - z| <= 255, an error below 0.03 of a step:
                   it returns q itself. ONNX Runtime's quantizer leaves these around the /6 of every decomposed
                   hardswish and around scalar affine Muls (PP-LCNet): each costs a float op and two Q/DQ.
    data_movement  Q(op(DQ(q1)[, DQ(q2)…])) with op in DATA_MOVEMENT and Q's parameters identical to every DQ's
                   → op(q1[, q2…]): the op moves values without computing new ones, so it commutes with a
                   per-tensor DQ (MaxPool too: max commutes with the increasing map (q - z)·s when s > 0).
    sink_dq        op(DQ(q)) whose result is not requantized with the same parameters → DQ(op(q)): the same
                   exactness argument; the op then runs on 1-byte data and the next consumer sees DQ again
                   (e.g. a Conv after MaxPool in a PyTorch QAT export becomes fusable).

Not redundant, kept and counted: a *requantization*, DQ→Q (directly or around a data-movement op) whose
parameters differ; it changes the values (coarser or shifted grid).

Preconditions checked: constant scales and zero points, 8/16-bit integer types, per-tensor parameters for the
data-movement rules (a per-axis scale would need its axis remapped through Reshape/Transpose), MaxPool only on
8-bit data, positive scales and opset >= 12 (its first integer kernel), Concat only when every input carries
the same parameters, no second consumer of an intermediate value.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnx_ir as ir
from onnxscript.rewriter import MatchResult, RewriteRuleClassBase, RewriteRuleSet

from qprep.contract import RunContext, StageResult
from qprep.graph.ir import constant_array
from qprep.graph.rules import unique_node_name
from qprep.graph.verify import Tolerance
from qprep.model import info as model_info
from qprep.qdq.params import EIGHT_BIT, QParams, consumers, producer, qparams
from qprep.qdq.verified import OutputCheck, Rewrite, RewriteLog, Verdict, apply_verified
from qprep.schema import Settings
from qprep.stage_registry import stage

DATA_MOVEMENT = ("Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze", "MaxPool", "Slice", "Concat")
# Exact rewrites: no output may move by more than this (absolute). A quantized output changes by at least one
# step (≫ 1e-6) when anything changes, so this demands bit-identical quantized outputs; cosine is not gated
# (min_cosine -1): it is scale-invariant and would only reject in-tolerance changes of near-zero outputs.
TOLERANCE = Tolerance(atol=1e-6, rtol=0.0, min_cosine=-1.0)
MAX_SWEEPS = 10


def _data_inputs(node: ir.Node) -> list[int]:
    """Indices of the inputs an op moves (the rest are shapes, axes, starts…)."""
    return list(range(len(node.inputs))) if node.op_type == "Concat" else [0]


def _movement_problem(node: ir.Node, params: QParams, opset: int) -> str | None:
    """Why `node` cannot run on data quantized with `params`, or None."""
    if not params.per_tensor:
        return f"{node.op_type} with per-axis quantization (the axis would need remapping)"
    if any(out.uses() or out.is_graph_output() for out in node.outputs[1:]):
        return f"{node.op_type}'s second output is used"
    if node.op_type == "MaxPool":
        if params.dtype not in EIGHT_BIT:
            return "MaxPool has no 16-bit integer kernel"
        if opset < 12:
            return f"MaxPool on integers needs opset 12 (model: {opset})"
        if float(params.scale) <= 0:
            return "MaxPool commutes with dequantization only for a positive scale"
    return None


def _dequantized(node: ir.Node) -> tuple[list[ir.Node], QParams] | str:
    """The DQ nodes feeding every data input of `node`, with their common parameters, or why not."""
    dqs, params = [], None
    for index in _data_inputs(node):
        dq = producer(node.inputs[index], "DequantizeLinear")
        if dq is None:
            return "a data input is not dequantized"
        p = qparams(dq)
        if isinstance(p, str):
            return p
        if params is not None and not p.same_as(params):
            return "inputs are dequantized with different parameters"
        dqs.append(dq)
        params = p
    return dqs, params


def _opset(context) -> int:
    return context.model.opset_imports.get("", 0)


class RoundTrip(RewriteRuleClassBase):
    """Q(DQ(q)) with identical parameters → q."""

    def __init__(self, log: RewriteLog):
        super().__init__(name="round_trip")
        self.log = log

    def pattern(self, op, dequantized, scale):
        return op.QuantizeLinear(dequantized, scale, _allow_other_inputs=True, _outputs=["quantized"])

    def check(self, context, dequantized, quantized, **_) -> MatchResult:
        q = quantized.producer()
        if not self.log.permits(q.name):
            return MatchResult().fail("not in this batch")
        dq = producer(dequantized, "DequantizeLinear")
        if dq is None:
            return MatchResult().fail("input is not dequantized")
        before, after = qparams(dq), qparams(q)
        if isinstance(before, str) or isinstance(after, str):
            return self.log.refuse(q.name, before if isinstance(before, str) else after)
        if not before.same_as(after):
            return MatchResult().fail("requantization: parameters differ")  # counted by requantizations()
        return MatchResult()

    def rewrite(self, op, dequantized, quantized, **_):
        q, dq = quantized.producer(), dequantized.producer()
        self.log.orphans.append(dq)
        self.log.applied.append(Rewrite(q.name, "round_trip", {"dequantize": dq.name}))
        return self.log.forward(op, dq.inputs[0])


SCALE_MATCH = 1e-4  # relative: Q's scale vs DQ's scale times the constant (see scaled_round_trip)


class ScaledRoundTrip(RewriteRuleClassBase):
    """Q(DQ(q)·c) or Q(DQ(q)/c) whose Q grid is DQ's grid scaled by c → q."""

    def __init__(self, log: RewriteLog, op_type: str):
        super().__init__(name=f"scaled_round_trip.{op_type}")
        self.log, self.op_type = log, op_type

    def pattern(self, op, dequantized, factor, scale):
        scaled = getattr(op, self.op_type)(dequantized, factor)
        return op.QuantizeLinear(scaled, scale, _allow_other_inputs=True, _outputs=["quantized"])

    def check(self, context, dequantized, factor, quantized, **_) -> MatchResult:
        q = quantized.producer()
        if not self.log.permits(q.name):
            return MatchResult().fail("not in this batch")
        dq = producer(dequantized, "DequantizeLinear")
        c = constant_array(factor)
        if dq is None or c is None or c.size != 1:
            return MatchResult().fail("not DQ times a scalar constant")
        before, after = qparams(dq), qparams(q)
        if isinstance(before, str) or isinstance(after, str):
            return self.log.refuse(q.name, before if isinstance(before, str) else after)
        c = float(c.reshape(-1)[0])
        factor_value = c if self.op_type == "Mul" else (1 / c if c else 0.0)
        if not (before.per_tensor and after.per_tensor and before.dtype == after.dtype
                and before.dtype in EIGHT_BIT and np.array_equal(before.zero_point, after.zero_point)):
            return MatchResult().fail("per-axis, 16-bit, or type/zero point differ")
        if not factor_value > 0 or abs(float(before.scale) * factor_value / float(after.scale) - 1) >= SCALE_MATCH:
            return MatchResult().fail("Q's scale is not DQ's scale times the constant")
        return MatchResult()

    def rewrite(self, op, dequantized, quantized, **_):
        q, dq = quantized.producer(), dequantized.producer()
        self.log.orphans.append(dq)
        self.log.applied.append(Rewrite(q.name, "scaled_round_trip", {"op": self.op_type, "dequantize": dq.name}))
        return self.log.forward(op, dq.inputs[0])


class AroundDataMovement(RewriteRuleClassBase):
    """Q(op(DQ(q)…)) with one set of parameters throughout → op(q…)."""

    def __init__(self, log: RewriteLog, op_type: str):
        super().__init__(name=f"data_movement.{op_type}")
        self.log, self.op_type = log, op_type

    def pattern(self, op, data, scale):
        moved = getattr(op, self.op_type)(data, _allow_other_inputs=True, _allow_other_attributes=True,
                                          _outputs=["moved"])
        return op.QuantizeLinear(moved, scale, _allow_other_inputs=True, _outputs=["quantized"])

    def check(self, context, moved, quantized, **_) -> MatchResult:
        q, node = quantized.producer(), moved.producer()
        if not self.log.permits(q.name):
            return MatchResult().fail("not in this batch")
        found = _dequantized(node)
        if isinstance(found, str):
            return MatchResult().fail(found)
        after = qparams(q)
        if isinstance(after, str):
            return self.log.refuse(q.name, after)
        if not found[1].same_as(after):
            return MatchResult().fail("requantization: parameters differ")  # counted by requantizations()
        problem = _movement_problem(node, after, _opset(context))
        return self.log.refuse(q.name, problem) if problem else MatchResult()

    def rewrite(self, op, moved, quantized, **_):
        q, node = quantized.producer(), moved.producer()
        inputs = list(node.inputs)
        for index in _data_inputs(node):
            dq = inputs[index].producer()
            self.log.orphans.append(dq)
            inputs[index] = dq.inputs[0]
        self.log.applied.append(Rewrite(q.name, "data_movement", {"op": node.op_type, "node": node.name}))
        return getattr(op, self.op_type)(*inputs, **dict(node.attributes.items()), _name=node.name)


class SinkDequantize(RewriteRuleClassBase):
    """op(DQ(q)…) → DQ(op(q…)) when the result is not requantized with the same parameters (that is
    AroundDataMovement's match) and the DQ feeds nothing else."""

    def __init__(self, log: RewriteLog, op_type: str):
        super().__init__(name=f"sink_dq.{op_type}")
        self.log, self.op_type = log, op_type

    def pattern(self, op, data):
        return getattr(op, self.op_type)(data, _allow_other_inputs=True, _allow_other_attributes=True,
                                         _outputs=["moved"])

    def check(self, context, moved, **_) -> MatchResult:
        node = moved.producer()
        if not self.log.permits(node.name):
            return MatchResult().fail("not in this batch")
        found = _dequantized(node)
        if isinstance(found, str):
            return MatchResult().fail(found)
        dqs, params = found
        if any(use.node is not node for dq in dqs for use in dq.outputs[0].uses()) or any(
                dq.outputs[0].is_graph_output() for dq in dqs):
            return MatchResult().fail("the dequantized value has other consumers")
        users = consumers(moved)
        if len(users) == 1 and users[0].op_type == "QuantizeLinear" and not moved.is_graph_output():
            after = qparams(users[0])
            if not isinstance(after, str) and after.same_as(params):
                return MatchResult().fail("requantized with the same parameters: data_movement's match")
        problem = _movement_problem(node, params, _opset(context))
        return self.log.refuse(node.name, problem) if problem else MatchResult()

    def rewrite(self, op, moved, **_):
        node = moved.producer()
        inputs = list(node.inputs)
        dq = inputs[_data_inputs(node)[0]].producer()
        for index in _data_inputs(node):
            self.log.orphans.append(inputs[index].producer())
            inputs[index] = inputs[index].producer().inputs[0]
        self.log.applied.append(Rewrite(node.name, "sink_dq", {"op": node.op_type}))
        quantized = getattr(op, self.op_type)(*inputs, **dict(node.attributes.items()), _name=node.name)
        return op.DequantizeLinear(quantized, *dq.inputs[1:], **dict(dq.attributes.items()),
                                   _name=unique_node_name(node.graph, f"{node.name}/DequantizeLinear"))


def rules(log: RewriteLog) -> RewriteRuleSet:
    return RewriteRuleSet([RoundTrip.rule(log), ScaledRoundTrip.rule(log, "Div"),
                           *ScaledRoundTrip.rule(log, "Mul").commute(), *(AroundDataMovement.rule(log, t) for t in DATA_MOVEMENT),
                           *(SinkDequantize.rule(log, t) for t in DATA_MOVEMENT)])


def apply(model: ir.Model, log: RewriteLog) -> None:
    """Every rule, repeated while a sweep still rewrites (a removal often exposes the next match)."""
    rule_set = rules(log)
    for _ in range(MAX_SWEEPS):
        if not rule_set.apply_to_model(model):
            break


def requantizations(model: onnx.ModelProto) -> list[dict]:
    """DQ→Q with different parameters, directly or around a data-movement op: kept, listed for the record."""
    ir_model = ir.from_proto(model)
    found = []
    for node in ir_model.graph:
        if node.op_type != "QuantizeLinear" or node.domain not in ("", "ai.onnx"):
            continue
        source = node.inputs[0].producer()
        via = None
        if source is not None and source.op_type in DATA_MOVEMENT and source.domain in ("", "ai.onnx"):
            via, dq = source.op_type, producer(source.inputs[0], "DequantizeLinear")
        else:
            dq = producer(node.inputs[0], "DequantizeLinear")
        if dq is None:
            continue
        before, after = qparams(dq), qparams(node)
        if isinstance(before, str) or isinstance(after, str) or before.same_as(after):
            continue
        found.append({"node": node.name, "from": before.describe(), "to": after.describe(),
                      **({"around": via} if via else {})})
    return found


def simplify(model: onnx.ModelProto, samples: list[dict], threads: int = 2,
             verify: bool = True) -> tuple[onnx.ModelProto, dict]:
    """These exact rules on a quantizer's output: (model, rewrites by kind). ONNX Runtime's QDQ models carry
    scaled round trips (PP-OCR classifier: 17, one per hardswish). `verify=False` skips the ORT comparison
    (onnx.checker still runs): for a caller that re-quantizes many times and verified the first result. Then
    one round is enough: `apply` sweeps to a fixpoint and nothing is rolled back, so a second round finds nothing
    and only costs time (BENCHMARKS.md: "one round of exact QDQ rules per build")."""
    check = OutputCheck(model, samples, TOLERANCE, threads) if verify else (lambda candidate, rewrites: Verdict(True))
    outcome = apply_verified(model, apply, check, max_rounds=8 if verify else 1)
    return outcome.model, dict(Counter(r.kind for r in outcome.applied))


def _qdq_counts(model: onnx.ModelProto) -> dict[str, int]:
    counts = model_info.op_counts(model)
    return {op: counts.get(op, 0) for op in ("QuantizeLinear", "DequantizeLinear")}


@stage("remove_redundant_qdq",
       summary="remove Q/DQ round trips and doubled pairs, run data-movement ops on quantized data (exact, verified)")
def remove_redundant_qdq(model: onnx.ModelProto, ctx: RunContext, options: Settings) -> StageResult:
    """Q/DQ that compute nothing removed, DQ moved past data-movement ops: fewer float ops for the runtime and
    more fusable patterns for the stages after it; each rewrite verified exact on ctx.verifier's samples."""
    before = _qdq_counts(model)
    if not any(before.values()):
        return StageResult(model=model, status="skipped",
                           reason="no QuantizeLinear/DequantizeLinear nodes (a float model): nothing to remove")
    verifier = ctx.verifier
    check = OutputCheck(model, verifier.samples, TOLERANCE, verifier.threads)
    outcome = apply_verified(model, apply, check)
    after = _qdq_counts(outcome.model)
    kinds = Counter(r.kind for r in outcome.applied)
    requantized = requantizations(outcome.model)
    details = {
        "rewrites": {kind: kinds.get(kind, 0) for kind in ("round_trip", "scaled_round_trip", "data_movement",
                                                            "sink_dq")},
        "data_movement_ops": dict(sorted(Counter(r.facts["op"] for r in outcome.applied
                                                 if r.kind in ("data_movement", "sink_dq")).items())),
        "qdq_nodes_before": before,
        "qdq_nodes_after": after,
        "qdq_nodes_removed": sum(before.values()) - sum(after.values()),
        "requantizations_kept": {"count": len(requantized), "nodes": requantized[:20]},
        "refused": dict(Counter(outcome.refused.values())),
        "verification": {"tolerance": {"atol": TOLERANCE.atol, "rtol": TOLERANCE.rtol,
                                       "min_cosine": TOLERANCE.min_cosine, "reference": "the stage's input model"},
                         **outcome.verification},
        "verified_on": verifier.source,
        "checks": outcome.checks,
        "rewrite_seconds": outcome.rewrite_seconds,
        "verify_seconds": outcome.verify_seconds,
    }
    return StageResult(model=outcome.model, details=details, rolled_back=outcome.rolled_back)
