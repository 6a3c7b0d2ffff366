"""`qprep inspect MODEL`: what a model is, before deciding how to quantize it."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from qprep.model import info as model_info
from qprep.model.load import load_model

FUSED_GELU_OPS = ("Gelu", "FastGelu", "QuickGelu", "BiasGelu")


def inspect_model(path: str) -> dict:
    """The model summary plus its LayerNorms and GELUs: fused (one op) and decomposed per spelling, found by
    the matchers `optimize` fuses with, and the candidates they refuse with the reason."""
    from qprep.graph.ir import MS_DOMAIN
    from qprep.optimize.passes.gelu import count_gelus
    from qprep.optimize.passes.layernorm import find_layernorms
    from qprep.optimize.passes.split_ort_fusions import SPLITS

    model = load_model(path)
    summary = model_info.summary(model)
    layernorms = {"fused": summary["op_counts"].get("LayerNormalization", 0), **find_layernorms(model)}
    gelus = {"fused": sum(summary["op_counts"].get(op, 0) for op in FUSED_GELU_OPS), **count_gelus(model)}
    ort_fused = Counter(n.op_type for n in model_info.iter_nodes(model.graph)
                        if n.domain == MS_DOMAIN and n.op_type in SPLITS)
    return {"path": str(path), "bytes": Path(path).stat().st_size, **summary, "layernorms": layernorms,
            "gelus": gelus, "decomposed_layernorms": sum(layernorms["decomposed"].values()),
            "ort_fused_ops": dict(sorted(ort_fused.items()))}


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
    lines += _found("LayerNorm", info["layernorms"]) + _found("GELU", info["gelus"])
    if info["ort_fused_ops"]:
        ops = ", ".join(f"{op} {n}" for op, n in info["ort_fused_ops"].items())
        lines.append(f"  ONNX Runtime's fused ops: {sum(info['ort_fused_ops'].values())} ({ops}; `optimize` takes "
                     "them apart)")
    lines.append(f"  nodes: {info['nodes']} ({len(info['op_counts'])} op types), initializers: {info['initializers']}")
    width = max((len(op) for op in info["op_counts"]), default=0)
    lines += [f"    {op:<{width}}  {count}" for op, count in info["op_counts"].items()]
    return "\n".join(lines)
