"""Which nodes of the result run float, and why: one reading of report.json for every view that counts them (the
report's "Kept float" table and fallback line, the mostly-float line, compare's kept_float, the batch summary's
float_nodes).

Why one place: each view counted another set (the keep_float set, the fallback's additions, the nodes ORT was
told to exclude, the RKNN toolkit's float16 layers), so one run read "met with 0 float nodes" beside "mostly float",
and the Conv and Gemm the spread-tensors phase left float were named nowhere.

The set is what the backend built: ORT — the nodes it excluded, the spread-tensors nodes, the nodes its
quantizer failed on, and any multiply-add node model.onnx runs float (`result.float_multiply_adds`, measured on
the model); RKNN — the float-set nodes the toolkit took as float16 layers; others — the float set. Each node gets
the first reason that holds, in REASONS' order; its cost is its share of the float model's multiply-adds
(`result.multiply_adds`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# reason → (what the report says, the setting that changes it)
REASONS = {
    "extreme": ("NaN/Inf or out-of-range values no int8 grid holds", ""),
    "keep_float": ("asked for by keep_float", "the keep_float stage's `op_types`, `nodes`, `patterns` or `layernorm`"),
    "fallback": ("chosen by the accuracy-driven fallback", "`quantize.fallback.max_float_nodes` or a lower target"),
    "spread": ("the spread-tensors phase (their tensors' channels spread too far for one int8 scale)",
               "`quantize.ort.spread_tensors: off` (or `int16`)"),
    "spread_rknn": ("the spread-tensors phase, as float16 (their tensors' channels spread too far for one int8 "
                    "scale)", "`quantize.fallback.max_float_nodes` (caps the spread set) or a lower target"),
    "op_types": ("op types the fallback left float", "a lower `quantize.fallback.target`"),
    "fast_kernels": ("Conv reading the model's input: too few channels for ONNX Runtime's fast int8 kernels",
                     "`quantize.ort.fast_kernels: false`"),
    "unquantizable": ("ONNX Runtime's quantizer fails on them", ""),
    "smoothing": ("the Mul restoring a smoothed LayerNorm's channels (an int8 scale would round its 1s)", ""),
    "excluded": ("named in `quantize.ort.nodes_to_exclude`", "`quantize.ort.nodes_to_exclude`"),
    "backend": ("not quantized by the backend (an op type or input it leaves float)", ""),
}


@dataclass
class FloatNodes:
    """The result's float nodes by reason ({reason: [node]}), their multiply-adds where counted, and the nodes
    counted but not named (the op types the fallback left float)."""

    groups: dict[str, list[str]] = field(default_factory=dict)
    unnamed: dict[str, int] = field(default_factory=dict)
    macs: dict[str, int] = field(default_factory=dict)  # the float model's multiply-adds per node
    op_types: list[str] = field(default_factory=list)  # the op types the fallback left float (unnamed["op_types"])

    @property
    def count(self) -> int:
        return sum(len(nodes) for nodes in self.groups.values()) + sum(self.unnamed.values())

    def share(self, reason: str) -> float | None:
        """The share of the float model's multiply-adds `reason`'s nodes hold; None when none were counted."""
        total = sum(self.macs.values())
        if not total:
            return None
        return sum(self.macs.get(node, 0) for node in self.groups.get(reason, [])) / total


def _quantize(report: dict) -> dict | None:
    return next((s for s in report.get("stages") or [] if s.get("name") == "quantize" and s.get("status") == "ok"),
                None)


def float_nodes(report: dict) -> FloatNodes | None:
    """The result's float nodes; None when no quantize stage finished (nothing was quantized: no count)."""
    stage = _quantize(report)
    if stage is None:
        return None
    result = report.get("result") or {}
    extreme = set(((stage.get("nonfinite") or {}).get("nodes")) or {})
    fallback = stage.get("fallback") or {}
    known = {"extreme": extreme, "keep_float": set(report.get("float_set") or []) - extreme,
             "fallback": {entry["node"] for entry in fallback.get("float_nodes") or []},
             "fast_kernels": set(stage.get("float_for_speed") or []),
             "unquantizable": {entry["node"] for entry in stage.get("unquantizable") or []}}
    backend, unnamed, op_types = stage.get("backend"), {}, []
    if backend == "ort":
        spread = stage.get("spread_tensors") or {}
        known["spread"] = set(spread.get("float_nodes") or [])
        built = set(stage.get("excluded_nodes") or []) | known["spread"] | known["unquantizable"]
        known["smoothing"] = {entry["restoring_mul"] for entry in
                              (stage.get("smoothed_layernorms") or {}).get("layernorms") or []
                              if entry.get("restoring_mul")}
        known["excluded"] = set(stage.get("excluded_nodes") or [])
        known["backend"] = set(result.get("float_multiply_adds") or [])
        built |= known["backend"]
        chosen = fallback.get("float_op_types") or {}
        if chosen.get("chosen") and chosen.get("nodes"):
            unnamed["op_types"], op_types = chosen["nodes"], list(chosen["chosen"])
    elif backend == "rknn" and "float16_layers" in stage:
        built = set((stage["float16_layers"].get("mapped") or {}))
        if (fallback.get("spread_tensors") or {}).get("tensors"):
            known["spread_rknn"] = built
        known["backend"] = built
    else:
        built = set(report.get("float_set") or [])
        known["backend"] = built
    macs = dict(result.get("multiply_adds") or {})
    groups: dict[str, list[str]] = {}
    for node in sorted(built, key=lambda name: (-macs.get(name, 0), name)):  # the costly ones first
        reason = next(key for key in REASONS if node in known.get(key, ()))
        groups.setdefault(reason, []).append(node)
    ordered = {key: groups[key] for key in REASONS if key in groups}
    return FloatNodes(ordered, unnamed, macs, op_types)


def float_count(report: dict) -> int | None:
    """How many nodes of the result run float (None: nothing was quantized)."""
    found = float_nodes(report)
    return None if found is None else found.count


MAX_LISTED = 12  # names per reason in the table; the rest are in report.json


def table_rows(found: FloatNodes) -> list[list[str]]:
    """One row per reason: why, how many, their share of the multiply-adds, the nodes, the setting."""
    rows = []
    for reason, nodes in found.groups.items():
        share = found.share(reason)
        names = ", ".join(f"`{node}`" for node in nodes[:MAX_LISTED])
        more = f", … and {len(nodes) - MAX_LISTED} more" if len(nodes) > MAX_LISTED else ""
        rows.append([REASONS[reason][0], str(len(nodes)), "–" if share is None else f"{share:.0%}", names + more,
                     REASONS[reason][1] or "–"])
    for reason, count in found.unnamed.items():  # the fallback's float op types (report.json names no node)
        rows.append([REASONS[reason][0], str(count), "–", f"the {', '.join(found.op_types)} nodes",
                     REASONS[reason][1]])
    return rows


def mostly_float_text(report: dict) -> str:
    """Under evaluation.min_integer_share: what made the result mostly float (the reason whose nodes hold the most
    multiply-adds) and the setting that changes it, in one line; "" when no reason holds any."""
    found = float_nodes(report)
    if found is None:
        return ""
    costly = [(found.share(reason) or 0, reason) for reason in found.groups]
    share, reason = max(costly, default=(0, ""))
    if not share:
        return ""
    heavy = [node for node in found.groups[reason] if found.macs.get(node)]  # costly first (float_nodes)
    named = ", ".join(f"`{node}`" for node in heavy[:4]) + (", …" if len(heavy) > 4 else "")
    setting = REASONS[reason][1]
    change = f"; to change it: {setting}" if setting else "; no setting changes it"
    return (f"Mostly float: {len(found.groups[reason])} node(s) holding {share:.0%} of the multiply-adds ({named}) "
            f"run float ({REASONS[reason][0]}){change}.")
