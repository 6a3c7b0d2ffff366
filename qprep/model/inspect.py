"""`qprep inspect MODEL`: what a model is, before deciding how to quantize it."""

from __future__ import annotations

from pathlib import Path

from qprep.model import info as model_info
from qprep.model.io import load_model


def inspect_model(path: str) -> dict:
    from qprep.optimize.passes.layernorm import count_decomposed_layernorms

    model = load_model(path)
    return {"path": str(path), "bytes": Path(path).stat().st_size, **model_info.summary(model),
            "decomposed_layernorms": count_decomposed_layernorms(model)}


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
    fused = info["op_counts"].get("LayerNormalization", 0)
    lines.append(f"  LayerNorm: {fused} fused, {info['decomposed_layernorms']} decomposed (fusable by `optimize`)")
    lines.append(f"  nodes: {info['nodes']} ({len(info['op_counts'])} op types), initializers: {info['initializers']}")
    width = max((len(op) for op in info["op_counts"]), default=0)
    lines += [f"    {op:<{width}}  {count}" for op, count in info["op_counts"].items()]
    return "\n".join(lines)
