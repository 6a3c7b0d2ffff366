"""`qprep compare A B [C…]`: runs (run directories, report.json or batch summary.json) side by side.

Every column after the first shows its delta to the first; a delta in the worse direction beyond a
`--fail-on-regression METRIC=THRESHOLD` makes the command exit 1 (for CI). One run alone is shown as its
result against its FP32 reference.
"""

from __future__ import annotations

import json
from html import escape
from pathlib import Path

from qprep.errors import QprepError
from qprep.evaluate.metrics import OUTPUT_METRICS, higher_is_better


def load_record(path: str) -> tuple[str, dict]:
    target = Path(path)
    for candidate in (target, target / "report.json", target / "summary.json"):
        if candidate.is_file():
            try:
                data = json.loads(candidate.read_text())
            except ValueError:
                raise QprepError(f"compare: {candidate} is not valid JSON") from None
            return ("summary" if "models" in data else "report"), data
    raise QprepError(f"compare: {path} holds no report.json or summary.json")


def metrics_of(kind: str, data: dict) -> dict[str, float | None]:
    """Flat metric name → value; report outputs are `<output>.<metric>`, summaries `<model>.<metric>`."""
    flat: dict[str, float | None] = {}
    if kind == "summary":
        for row in data["models"]:
            for metric in ("cosine_mean", "agreement", "speedup"):
                flat[f"{row['model']}.{metric}"] = row.get(metric)
        return flat
    evaluation = data.get("evaluation") or {}
    for output, values in (evaluation.get("outputs") or {}).items():
        for metric in OUTPUT_METRICS:
            if metric in values:
                flat[f"{output}.{metric}"] = values[metric]
    latency = evaluation.get("latency") or {}
    if "speedup" in latency:
        flat["latency.speedup"] = latency["speedup"]
        flat["latency.result_ms"] = latency["result"]["median_ms"]
    flat["result.nodes"] = (data.get("result") or {}).get("nodes")
    return flat


def compare(paths: list[str], fail_on: dict[str, float]) -> dict:
    records = [(path, *load_record(path)) for path in paths]
    if len(records) == 1 and records[0][1] == "report":
        return _single(records[0][0], records[0][2])
    columns = [path for path, _, _ in records]
    values = [metrics_of(kind, data) for _, kind, data in records]
    known = {m for v in values for m in v} | {m.rsplit(".", 1)[-1] for v in values for m in v}
    for metric in fail_on:
        if metric not in known:
            raise QprepError(f"--fail-on-regression {metric}: no run reports this metric "
                             f"(metrics: {', '.join(sorted(m for m in known if '.' not in m))})")
    rows, regressions = [], []
    for metric in dict.fromkeys(m for v in values for m in v):
        base = values[0].get(metric)
        cells = []
        for column, v in zip(columns[1:], values[1:]):
            value = v.get(metric)
            delta = None if value is None or base is None else value - base
            worse = delta is not None and (delta < 0 if higher_is_better(metric) else delta > 0)
            cells.append({"value": value, "delta": delta, "worse": worse})
            threshold = _threshold(metric, fail_on)
            if worse and threshold is not None and abs(delta) > threshold:
                regressions.append({"metric": metric, "run": column, "base": base, "value": value,
                                    "delta": delta, "threshold": threshold})
        rows.append({"metric": metric, "base": base, "others": cells})
    return {"columns": columns, "rows": rows, "regressions": regressions}


def _threshold(metric: str, fail_on: dict[str, float]) -> float | None:
    """`cosine_mean=0.01` applies to every output's cosine_mean; `logits.cosine_mean=…` to one."""
    if metric in fail_on:
        return fail_on[metric]
    return fail_on.get(metric.rsplit(".", 1)[-1])


def _single(path: str, report: dict) -> dict:
    evaluation = report.get("evaluation")
    if not evaluation:
        raise QprepError(f"compare: {path} has no evaluation section; add `evaluation:` to its config to compare "
                         "the result with its FP32 reference")
    rows = []
    for output, values in evaluation["outputs"].items():
        for metric in OUTPUT_METRICS:
            if metric in values:
                perfect = 0.0 if metric == "max_abs" else (float("inf") if metric == "sqnr_db" else 1.0)
                rows.append({"metric": f"{output}.{metric}", "base": perfect,
                             "others": [{"value": values[metric], "delta": values[metric] - perfect
                                         if perfect != float("inf") else None, "worse": False}]})
    latency = evaluation.get("latency") or {}
    if "speedup" in latency:
        rows.append({"metric": "latency.median_ms", "base": latency["reference"]["median_ms"],
                     "others": [{"value": latency["result"]["median_ms"],
                                 "delta": latency["result"]["median_ms"] - latency["reference"]["median_ms"],
                                 "worse": False}]})
    sizes = evaluation.get("size_bytes") or {}
    if sizes:
        rows.append({"metric": "size.MB", "base": sizes["reference"] / 1e6,
                     "others": [{"value": sizes["result"] / 1e6, "delta": (sizes["result"] - sizes["reference"]) / 1e6,
                                 "worse": False}]})
    return {"columns": ["FP32 reference", f"result ({path})"], "rows": rows, "regressions": []}


def _fmt(value) -> str:
    if value is None:
        return "–"
    return f"{value:.6g}"


def render_text(result: dict) -> str:
    header = ["metric", result["columns"][0]] + [f"{c} (Δ)" for c in result["columns"][1:]]
    table = [header]
    for row in result["rows"]:
        cells = [row["metric"], _fmt(row["base"])]
        for cell in row["others"]:
            mark = " ▼" if cell["worse"] else ""
            delta = "" if cell["delta"] is None else f" ({cell['delta']:+.4g})"
            cells.append(f"{_fmt(cell['value'])}{delta}{mark}")
        table.append(cells)
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)) for r in table]
    for reg in result["regressions"]:
        lines.append(f"REGRESSION {reg['metric']} in {reg['run']}: {_fmt(reg['base'])} → {_fmt(reg['value'])} "
                     f"(Δ {reg['delta']:+.4g}, allowed {reg['threshold']})")
    return "\n".join(lines) + "\n"


def render_markdown(result: dict) -> str:
    header = ["metric", result["columns"][0]] + [f"{c} (Δ)" for c in result["columns"][1:]]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in result["rows"]:
        cells = [row["metric"], _fmt(row["base"])]
        for cell in row["others"]:
            delta = "" if cell["delta"] is None else f" ({cell['delta']:+.4g})"
            text = f"{_fmt(cell['value'])}{delta}"
            cells.append(f"**{text}**" if cell["worse"] else text)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def render_html(result: dict) -> str:
    header = ["metric", result["columns"][0]] + [f"{c} (Δ)" for c in result["columns"][1:]]
    rows = []
    for row in result["rows"]:
        cells = [f"<td>{escape(row['metric'])}</td><td>{_fmt(row['base'])}</td>"]
        for cell in row["others"]:
            delta = "" if cell["delta"] is None else f" ({cell['delta']:+.4g})"
            colour = " style='background:#f8d7da'" if cell["worse"] else ""
            cells.append(f"<td{colour}>{_fmt(cell['value'])}{delta}</td>")
        rows.append("<tr>" + "".join(cells) + "</tr>")
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    return ("<!doctype html><html><head><meta charset='utf-8'><title>qprep compare</title><style>table{border-collapse:"
            "collapse}td,th{border:1px solid #ccc;padding:3px 8px;font:13px system-ui}</style></head><body>"
            f"<h1>qprep compare</h1><table><tr>{head}</tr>{''.join(rows)}</table></body></html>\n")
