"""The `fuse_conv_qdq` stage: the rules applied per Conv, each verified on its own and the whole model
against the stage input; the record (converted, refused with reasons, output steps)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnx_ir as ir

from qprep.contract import RunContext, StageResult
from qprep.model import info as model_info
from qprep.model.runtime import run_model
from qprep.model.saturation import this_cpu, u8s8_saturates
from qprep.qdq.fuse_conv.rules import rule_sets
from qprep.qdq.params import producer, qparams
from qprep.qdq.verified import ProbeCheck, Rewrite, RewriteLog, apply_verified
from qprep.schema import Key, Settings
from qprep.stage_registry import stage

MAX_SWEEPS = 10
# End-to-end gate. Integer kernels round a few elements per layer differently from float Conv + Q (ties,
# float summation order); through a deep CNN that adds up to a few output steps, exactly as much as ONNX Runtime's
# own session-time fusion of the same QDQ model (BENCHMARKS.md: "fuse_conv_qdq's end-to-end gate"). The per-node probe
# is the one-step proof; this gate only has to catch gross breakage (wiring, scales), hence 0.99.
DEFAULT_MIN_COSINE = 0.99


# ---------------------------------------------------------------------------------------------------------
# What the checks read from the graph
# ---------------------------------------------------------------------------------------------------------




def output_steps(model: onnx.ModelProto) -> dict[str, dict]:
    """Per graph output: the quantization step it is read at (its final DequantizeLinear), or, for a float
    output, the largest step among the nearest DequantizeLinear nodes upstream (reported, not gated)."""
    graph = ir.from_proto(model).graph
    steps = {}
    for output in graph.outputs:
        dq = producer(output, "DequantizeLinear")
        if dq is not None:
            params = qparams(dq)
            if not isinstance(params, str):
                steps[output.name] = {"scale": float(np.max(params.scale)), "from": f"DequantizeLinear {dq.name}"}
            continue
        nearest, stack, seen = [], [output], set()
        while stack:
            value = stack.pop()
            node = value.producer()
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            if node.op_type == "DequantizeLinear":
                nearest.append(node)
            else:
                stack.extend(v for v in node.inputs if v is not None)
        scales = [float(np.max(p.scale)) for p in map(qparams, nearest) if not isinstance(p, str)]
        if scales:
            steps[output.name] = {"scale": max(scales), "from": f"nearest upstream DequantizeLinear "
                                  f"({len(scales)}; the output itself is float)"}
    return steps


def _convertible(model: onnx.ModelProto, matmul: bool) -> int:
    counts = model_info.op_counts(model)
    return counts.get("Conv", 0) + (counts.get("MatMul", 0) if matmul else 0)


@stage("fuse_conv_qdq",
       summary="DQ→Conv→Q into QLinearConv (or ConvInteger + rescale), optionally MatMul; each within one step",
       format=Key("str", default="qlinear", choices=("qlinear", "integer", "qdq"),
                  doc="qlinear: QLinearConv where the output is requantized (ConvInteger + float rescale where "
                      "not); integer: ConvInteger + float rescale everywhere, the Q after it kept (for runtimes "
                      "without QLinearConv: ONNX Runtime's CPU ConvInteger is slow, 26x on EfficientNet-Lite0); "
                      "qdq: only the Div/BatchNorm a QAT export leaves after a Conv folded into its weight scales "
                      "and bias, the Conv kept between its Q/DQ (before quantize backend rknn, which builds a QAT "
                      "model from its own Q/DQ)"),
       matmul=Key("bool", default=False, doc="also fuse DQ→MatMul→Q into QLinearMatMul (MatMulInteger + rescale "
                                              "where not requantized or with format: integer)"),
       min_cosine=Key("float", default=DEFAULT_MIN_COSINE, minimum=-1,
                      doc="end-to-end gate: cosine of every output against the stage's input model (each rewrite "
                          "is also checked on its own: within one quantization step)"))
def fuse_conv_qdq(model: onnx.ModelProto, ctx: RunContext, options: Settings) -> StageResult:
    """Q/DQ around Conv (optionally MatMul) into integer operators ahead of time, so a runtime that does not fuse
    QDQ itself runs integer kernels; each rewrite is checked on ctx.verifier's samples (within one quantization
    step) and rolled back on its own."""
    counts = model_info.op_counts(model)
    if not counts.get("DequantizeLinear"):
        return StageResult(model=model, status="skipped",
                           reason="no DequantizeLinear nodes (a float model): nothing to fuse; quantize it first")
    if not _convertible(model, options.matmul):
        what = "Conv or MatMul" if options.matmul else "Conv (set matmul: true for MatMul)"
        return StageResult(model=model, status="skipped", reason=f"no {what} in the model")
    verifier = ctx.verifier
    steps = output_steps(model)
    check = ProbeCheck(model, verifier.samples, steps, options.min_cosine, verifier.threads)
    outcome = apply_verified(model, lambda m, log: _apply(m, log, options), check)
    folded = [r for r in outcome.applied if r.kind == "epilogue"]
    converted = [_with_epilogue(r, folded) for r in outcome.applied if r.kind in ("qlinear", "integer")]
    after = model_info.op_counts(outcome.model)
    details = {
        "format": options.format,
        "converted": dict(Counter(r.facts["to"] for r in converted)),
        "convs": {"before": counts.get("Conv", 0), "left": after.get("Conv", 0)},
        "matmuls": {"before": counts.get("MatMul", 0), "left": after.get("MatMul", 0)} if options.matmul else None,
        "epilogue_folded": dict(Counter(r.facts["op"] for r in folded)),
        "activations": dict(Counter(r.facts["activation"].split(" [")[0] for r in converted
                                    if "activation" in r.facts)),
        "bias": dict(Counter(r.facts["bias"] for r in converted if "bias" in r.facts)),
        "types": dict(Counter(r.facts["types"] for r in converted if "types" in r.facts)),
        "weights": dict(Counter(f"{r.facts['weights']}, {r.facts.get('weights_from', 'integer constant')}"
                                for r in converted)),
        "nodes": [{"node": r.anchor, **r.facts, **_probe_fact(check, r.anchor)} for r in converted],
        "refused": dict(Counter(outcome.refused.values())),
        "refused_nodes": dict(sorted(outcome.refused.items())[:20]),
        "verification": {"per_rewrite": "each rewritten node fed the QDQ model's own input: within one "
                                        "quantization step of its output",
                         "probes": _probe_summary(check, converted),
                         "end_to_end": f"every output's cosine against the stage input >= {options.min_cosine}",
                         **outcome.verification,
                         **({"deployed": _deployed(model, outcome.model, verifier), **_deployed_note()} if converted else {})},
        "verified_on": verifier.source,
        "checks": outcome.checks,
        "rewrite_seconds": outcome.rewrite_seconds,
        "verify_seconds": outcome.verify_seconds,
    }
    details = {k: v for k, v in details.items() if v is not None}
    return StageResult(model=outcome.model, details=details, rolled_back=outcome.rolled_back)


def _with_epilogue(rewrite: Rewrite, folded: list[Rewrite]) -> Rewrite:
    """The conversion's facts, with what was folded into that Conv first (and where its weights came from)."""
    mine = [r for r in folded if r.anchor == rewrite.anchor]
    if not mine:
        return rewrite
    facts = {**rewrite.facts, "weights_from": mine[0].facts["weights_from"],
             "epilogue": [r.facts["op"] for r in mine]}
    return Rewrite(rewrite.anchor, rewrite.kind, facts, rewrite.probe)


def _probe_fact(check: ProbeCheck, anchor: str) -> dict:
    measured = check.measured.get(anchor)
    return {"probe_max_error": round(measured[0], 6)} if measured else {}


def _probe_summary(check: ProbeCheck, converted: list[Rewrite]) -> dict:
    """The worst per-node probe error per unit kind (integer steps, or float accumulator steps)."""
    summary: dict = {"count": 0}
    for rewrite in converted:
        if rewrite.anchor in check.measured:
            error, unit = check.measured[rewrite.anchor]
            key = "max_steps_at_q_output" if unit.startswith("1 step") else "max_abs_at_float_output"
            summary["count"] += 1
            summary[key] = max(summary.get(key, 0.0), round(error, 6))
    return summary


def _deployed(reference: onnx.ModelProto, result: onnx.ModelProto, verifier) -> dict:
    """Both models as ONNX Runtime deploys them (ORT_ENABLE_ALL fuses the QDQ model itself at session
    creation): how far apart the outputs are. 0 means this stage did what ORT does, ahead of time; on a CPU
    whose u8s8 kernels saturate, ORT's own fusion is the one that is off (the stage's ops take int8 weights as
    uint8 there), and `deployed_note` says so."""
    expected = run_model(reference, verifier.samples, verifier.threads, optimize=True)
    actual = run_model(result, verifier.samples, verifier.threads, optimize=True)
    return {name: max(float(np.abs(e[name].astype(np.float64) - a[name]).max()) for e, a in zip(expected, actual))
            for name in expected[0]}


def _deployed_note() -> dict:
    if not u8s8_saturates():
        return {}
    return {"deployed_note": f"{this_cpu()}: ONNX Runtime's own session-time fusion of the QDQ input "
                             "differs from it by the `deployed` figures; this stage's integer ops take int8 weights "
                             "as uint8 (+128) and keep the QDQ numbers (the per-rewrite probes)"}


def _apply(model: ir.Model, log: RewriteLog, options: Settings) -> None:
    for rule_set in rule_sets(log, options):
        for _ in range(MAX_SWEEPS):
            if not rule_set.apply_to_model(model):
                break
