"""The `keep_float` stage: which nodes must stay float (the *float set*), and on a QDQ model, float they become.

The float set: every LayerNormalization (also ORT's fused Skip/Simplified variants, and LayerNorms still
decomposed into ReduceMean/Sub/Pow/… — found with the optimize stage's own LayerNorm rules), plus the op
types, node names and name patterns (re.search) the config lists. The stage hands it back in its StageResult;
the runner puts it into the context of later stages for the quantize backends (ORT excludes those nodes, RKNN
keeps them float16) and into the report.

On a model with Q/DQ nodes it also removes the rounding around those nodes, so they compute on float32 end to
end:

    input   N(DQ(Q(x))) → N(x)      the pair on a float-set node's activation input is bypassed
    output  DQ(Q(N(…))) → N(…)      readers of the pair after a float-set node read N's output itself

A Q or DQ that still feeds something else stays for it; dequantized *constants* (quantized weights, e.g. the
LayerNorm scale) stay too: their float originals are not in the model. This changes numerics on purpose (that is
the point), so it is not verified; the record shows how far the outputs moved, and the evaluation measures the
effect against the FP32 reference.
"""

from __future__ import annotations

import re
from collections import Counter

import onnx
import onnx_ir as ir

from qprep.contract import RunContext, StageResult
from qprep.errors import ConfigError
from qprep.graph.verify import Tolerance, Verifier, compare
from qprep.model import info as model_info
from qprep.model.runtime import run_model
from qprep.optimize.passes.layernorm import decomposed_layernorm_nodes
from qprep.qdq.params import consumers, producer, remove_dead
from qprep.schema import Key, Settings, closest
from qprep.stage_registry import stage

LAYERNORM_OPS = ("LayerNormalization", "SkipLayerNormalization", "SimplifiedLayerNormalization",
                 "SkipSimplifiedLayerNormalization")


def float_set(model: ir.Model, options: Settings, proto: onnx.ModelProto) -> dict[str, str]:
    """node name → why it is in the float set. Raises ConfigError for names/op types/patterns that are wrong."""
    nodes = list(ir.traversal.RecursiveGraphIterator(model.graph))
    by_name = {n.name: n for n in nodes if n.name}
    patterns = check_names(options, set(by_name), {n.op_type for n in nodes})
    members: dict[str, str] = {}
    if options.layernorm:
        for node in nodes:
            if node.op_type in LAYERNORM_OPS:
                members[node.name] = node.op_type
        for group in decomposed_layernorm_nodes(proto):
            for name in group:
                members.setdefault(name, "decomposed LayerNorm")
    for op_type in options.op_types:
        for node in nodes:
            if node.op_type == op_type:
                members.setdefault(node.name, f"op_types: {op_type}")
    for name in options.nodes:
        members.setdefault(name, "nodes")
    for text, pattern in patterns:
        for name in by_name:
            if pattern.search(name):
                members.setdefault(name, f"patterns: {text}")
    return members


def check_names(options: Settings, names: set[str], present: set[str]) -> list[tuple[str, re.Pattern]]:
    """Refuse (ConfigError) an op type that is neither an ONNX operator nor in the model, a node name the model
    lacks and a pattern that is no regular expression → the compiled patterns. Run by the stage and, on the
    model as loaded, before the run (check_model): a typo found only at the stage had already cost the user the
    previous run that `--force` cleared."""
    for i, op_type in enumerate(options.op_types):
        if op_type not in present and not onnx.defs.has(op_type) and op_type not in LAYERNORM_OPS:
            guess = closest(op_type, present | {s.name for s in onnx.defs.get_all_schemas()})
            hint = f"; did you mean '{guess}'?" if guess else ""
            raise ConfigError(f"keep_float.op_types[{i}]: '{op_type}' is not an ONNX operator and no node in the "
                              f"model has that type{hint}")
    for i, name in enumerate(options.nodes):
        if name not in names:
            guess = closest(name, names)
            stem = re.sub(r"[\W\d_]+$", "", name).lower()
            examples = [n for n in sorted(names) if stem and stem in n.lower()][:3] or sorted(names)[:3]
            hint = f"did you mean '{guess}'?" if guess else \
                "names look like " + ", ".join(f"'{n}'" for n in examples) + " (as loaded; see report.json)"
            raise ConfigError(f"keep_float.nodes[{i}]: no node named '{name}' in the model; {hint}")
    compiled = []
    for i, text in enumerate(options.patterns):
        try:
            compiled.append((text, re.compile(text)))
        except re.error as exc:
            raise ConfigError(f"keep_float.patterns[{i}]: '{text}' is not a regular expression ({exc})") from None
    return compiled


def check_model(options: Settings, model: onnx.ModelProto) -> None:
    """The names, op types and patterns the options give, checked on the model as loaded (see check_names)."""
    nodes = list(model_info.iter_nodes(model.graph))
    check_names(options, {n.name for n in nodes if n.name}, {n.op_type for n in nodes})


def unquantize(model: ir.Model, names: set[str]) -> dict:
    """Bypass the Q/DQ pairs on the inputs and outputs of the named nodes (in place); returns the record."""
    before = Counter(n.op_type for n in model.graph if n.op_type in ("QuantizeLinear", "DequantizeLinear"))
    orphans, kept, touched = [], Counter(), {}
    inputs_bypassed = outputs_bypassed = 0
    for node in list(model.graph):
        if node.name not in names:
            continue
        changed = {"inputs": 0, "outputs": 0}
        for index, value in enumerate(node.inputs):
            dq = producer(value, "DequantizeLinear")
            if dq is None:
                continue
            q = producer(dq.inputs[0], "QuantizeLinear")
            if q is None:
                kept["dequantized constant or integer tensor on an input (no float original in the model)"] += 1
                continue
            source = q.inputs[0]
            if source.dtype is not None and value.dtype is not None and source.dtype != value.dtype:
                kept["the pair converts between float types"] += 1
                continue
            node.replace_input_with(index, source)
            orphans.append(dq)
            changed["inputs"] += 1
        for output in node.outputs:
            for q in [u for u in consumers(output) if u.op_type == "QuantizeLinear" and u.domain in ("", "ai.onnx")]:
                for user in consumers(q.outputs[0]):
                    if user.op_type != "DequantizeLinear":
                        kept[f"the QuantizeLinear after it also feeds {user.op_type} on integers"] += 1
                for dq in [u for u in consumers(q.outputs[0]) if u.op_type == "DequantizeLinear"]:
                    result = dq.outputs[0]
                    if result.dtype is not None and output.dtype is not None and result.dtype != output.dtype:
                        kept["the pair converts between float types"] += 1
                        continue
                    if result.is_graph_output() and output.is_graph_output():
                        kept["both ends are graph outputs"] += 1
                        continue
                    is_output = result.is_graph_output()
                    ir.convenience.replace_all_uses_with(result, output, replace_graph_outputs=True)
                    if is_output:  # the graph output keeps its name, type and shape
                        output.name = result.name
                        output.shape = output.shape or result.shape
                        output.type = output.type or result.type
                    orphans.append(dq)
                    changed["outputs"] += 1
                orphans.append(q)
        if changed["inputs"] or changed["outputs"]:
            touched[node.name] = changed
            inputs_bypassed += changed["inputs"]
            outputs_bypassed += changed["outputs"]
    remove_dead(orphans)
    after = Counter(n.op_type for n in model.graph if n.op_type in ("QuantizeLinear", "DequantizeLinear"))
    return {"input_pairs_bypassed": inputs_bypassed, "output_pairs_bypassed": outputs_bypassed,
            "qdq_nodes_removed": {op: before[op] - after[op] for op in ("QuantizeLinear", "DequantizeLinear")},
            "kept": dict(kept), "nodes": [{"node": n, **c} for n, c in list(touched.items())[:50]]}


@stage("keep_float",
       check_model=check_model,
       summary="compute the float set (LayerNorms + configured ops/nodes/patterns); on a QDQ model remove its Q/DQ",
       layernorm=Key("bool", default=True, doc="LayerNormalization nodes (fused, or still decomposed) stay float"),
       op_types=Key("list", item=Key("str"), default=[], doc="op types that stay float, e.g. [Softmax, Gelu]"),
       nodes=Key("list", item=Key("str"), default=[], doc="node names that stay float"),
       patterns=Key("list", item=Key("str"), default=[],
                    doc="regular expressions searched in node names (re.search), e.g. ['attention/.*Add$']"))
def keep_float(model: onnx.ModelProto, ctx: RunContext, options: Settings) -> StageResult:
    """Hands back the float set (for the quantize backends after it) and, on a QDQ model, that model with the
    float set's Q/DQ pairs bypassed."""
    ir_model = ir.from_proto(model)
    members = float_set(ir_model, options, model)
    warnings = [f"keep_float: pattern '{text}' matches no node name" for text in options.patterns
                if not any(reason == f"patterns: {text}" for reason in members.values())]
    summary = {"count": len(members), "by_reason": dict(Counter(_reason_kind(r) for r in members.values()))}
    if not members:
        return StageResult(model=model, status="skipped",
                           reason="the float set is empty: no LayerNormalization in the model and no op_types, "
                                  "nodes or patterns configured", warnings=warnings)
    counts = model_info.op_counts(model)
    if not (counts.get("QuantizeLinear") or counts.get("DequantizeLinear")):
        return StageResult(model=model, details={
            "float_set": summary, "model_kind": model_info.model_kind(model),
            "note": "no Q/DQ nodes: nothing removed; the float set is recorded for the quantize backends, which "
                    "keep these nodes float"}, float_set=set(members), warnings=warnings)
    record = unquantize(ir_model, set(members))
    result = ir.to_proto(ir_model)
    outputs = {label: run_model(m, ctx.verifier.samples, ctx.verifier.threads)
               for label, m in (("before", model), ("after", result))}  # each model runs once
    details = {"float_set": summary, "model_kind": model_info.model_kind(model), "removed": record,
               "effect": _effect(outputs)}
    evaluation = ctx.config["evaluation"]
    if evaluation and evaluation.get("reference_model"):
        details["effect"]["against_fp32"] = _against_reference(outputs, evaluation["reference_model"],
                                                               ctx.verifier)
    return StageResult(model=result, details=details, float_set=set(members), warnings=warnings)


def _against_reference(outputs: dict[str, list[dict]], reference_path: str, verifier: Verifier) -> dict:
    """Cosine of the QDQ model's outputs against the FP32 model it came from, before and after the float set
    lost its rounding: the number that says whether keeping these nodes float helped."""
    from qprep.measure.metrics import compare_output
    from qprep.model.load import load_model

    reference = run_model(load_model(reference_path), verifier.samples, verifier.threads)
    results = {}
    for label, result in outputs.items():
        for name in reference[0]:
            metrics = compare_output([r[name] for r in reference], [o[name] for o in result], "tensor")
            results.setdefault(name, {})[f"cosine_mean_{label}"] = metrics["cosine_mean"]
    return {"reference_model": reference_path, "samples": len(verifier.samples), "outputs": results}


def _reason_kind(reason: str) -> str:
    return reason.split(":", 1)[0]


def _effect(outputs: dict[str, list[dict]]) -> dict:
    """How far the outputs moved (on purpose; not gated): per output max |Δ| and minimum cosine."""
    verdict = compare(outputs["before"], outputs["after"], Tolerance(0.0, 0.0, -1.0))
    return {"note": "numerics change on purpose (no rounding around the float set); not verified - the "
                    "evaluation measures the effect against the FP32 reference",
            "against": "the stage's input model", "samples": verdict.samples,
            "outputs": {name: {"max_abs": o["max_abs"], "cosine_min": o["cosine_min"]}
                        for name, o in verdict.outputs.items()}}
