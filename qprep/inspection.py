"""`qprep inspect MODEL`: what a model is, before deciding how to quantize it."""

from __future__ import annotations

import importlib
from collections import Counter
from pathlib import Path

import onnx

from qprep.model import info as model_info
from qprep.model.load import load_model, unreadable

FUSED_GELU_OPS = ("Gelu", "FastGelu", "QuickGelu", "BiasGelu")


def inspect_model(path: str) -> dict:
    """The model summary plus its LayerNorms and GELUs: fused (one op) and decomposed per spelling, found by
    the matchers `optimize` fuses with on the graph as optimize hands it to them (fusable), and the candidates
    they refuse with the reason."""
    from qprep.graph.ir import MS_DOMAIN
    from qprep.optimize.passes.split_ort_fusions import SPLITS

    model = load_model(path, rewrites=False)
    summary = model_info.summary(model)
    refused = unreadable(model)
    if refused:  # what the graph library cannot read: described from the proto, the refusal named
        return {"path": str(path), "bytes": Path(path).stat().st_size, **summary, "refused": refused}
    layernorms, gelus = fusable(model)
    layernorms = {"fused": summary["op_counts"].get("LayerNormalization", 0), **layernorms}
    gelus = {"fused": sum(summary["op_counts"].get(op, 0) for op in FUSED_GELU_OPS), **gelus}
    ort_fused = Counter(n.op_type for n in model_info.iter_nodes(model.graph)
                        if n.domain == MS_DOMAIN and n.op_type in SPLITS)
    return {"path": str(path), "bytes": Path(path).stat().st_size, **summary, "layernorms": layernorms,
            "gelus": gelus, "decomposed_layernorms": sum(layernorms["decomposed"].values()),
            "ort_fused_ops": dict(sorted(ort_fused.items()))}


def fusable(model: onnx.ModelProto) -> tuple[dict, dict]:
    """(LayerNorms, GELUs) the optimize stage's fusions would find: their matchers run on a copy of the model as
    the passes before them in the stage's order leave it (ONNX Runtime's fused ops apart, cleanup, constants
    folded, shapes simplified). Why: on the graph as exported, an epsilon written Cast(constant) is refused,
    while optimize folds it first and fuses; inspect and init said 0 LayerNorms where the run fused 1."""
    import onnx_ir as ir

    from qprep.optimize.passes import PASS_MODULES, PassSettings
    from qprep.optimize.passes.gelu import count_gelus
    from qprep.optimize.passes.layernorm import find_layernorms

    before = [importlib.import_module(f"qprep.optimize.passes.{module}").PASS
              for module in PASS_MODULES[:PASS_MODULES.index("layernorm")]]
    failed: set[str] = set()
    while True:  # the stage rolls a pass that raises back: counted again from the model without it
        copy, running = ir.from_proto(model), None
        try:
            for running in (p for p in before if p.default and p.name not in failed):
                running.apply(copy, PassSettings())
        except Exception:  # noqa: BLE001 - any pass's error: the stage's rollback, here its skip
            failed.add(running.name)
            continue
        break
    prepared = ir.to_proto(copy)
    return find_layernorms(prepared), count_gelus(prepared)


def count_layernorms(model: onnx.ModelProto) -> int:
    """LayerNorms the model has fused plus those optimize would fuse (`fusable`): what init keeps float."""
    return model_info.op_counts(model).get("LayerNormalization", 0) + sum(fusable(model)[0]["decomposed"].values())


def _found(name: str, found: dict) -> list[str]:
    """'  LayerNorm: 0 fused, 13 decomposed (pytorch 13, fusable by `optimize`)' and one line per refusal."""
    decomposed = {form: n for form, n in found["decomposed"].items() if n}
    spellings = ", ".join(f"{form} {n}" for form, n in decomposed.items())
    line = f"  {name}: {found['fused']} fused, {sum(decomposed.values())} decomposed"
    lines = [line + (f" ({spellings}; fusable by `optimize`)" if decomposed else "")]
    lines += [f"    refused {n}: {reason}" for reason, n in found.get("refused", {}).items()]
    return lines


def render_inspection(info: dict) -> str:
    def shape(spec):
        return "[" + ", ".join(map(str, spec["shape"])) + "]" if spec["shape"] is not None else "(unknown rank)"

    lines = [f"{info['path']}  ({info['bytes'] / 1e6:.2f} MB, {info['parameter_bytes'] / 1e6:.2f} MB of parameters)",
             f"  kind:     {info['kind']}" + ("  (contains control flow)" if info["control_flow"] else ""),
             "  opsets:   " + ", ".join(f"{d} {v}" for d, v in info["opsets"].items()),
             f"  producer: {info['producer'] or '-'}"]
    lines.append("  inputs:")
    lines += [f"    {s['name']}: {s['dtype']} {shape(s)}" for s in info["inputs"]]
    lines.append("  outputs:")
    lines += [f"    {s['name']}: {s['dtype']} {shape(s)}" for s in info["outputs"]]
    if info.get("refused"):
        lines.append(f"  refused by init and by a run with stages: {info['refused']}")
    else:
        lines += _found("LayerNorm", info["layernorms"]) + _found("GELU", info["gelus"])
    if info.get("ort_fused_ops"):
        ops = ", ".join(f"{op} {n}" for op, n in info["ort_fused_ops"].items())
        lines.append(f"  ONNX Runtime's fused ops: {sum(info['ort_fused_ops'].values())} ({ops}; `optimize` takes "
                     "them apart)")
    lines.append(f"  nodes: {info['nodes']} ({len(info['op_counts'])} op types), initializers: {info['initializers']}")
    width = max((len(op) for op in info["op_counts"]), default=0)
    lines += [f"    {op:<{width}}  {count}" for op, count in info["op_counts"].items()]
    return "\n".join(lines)
