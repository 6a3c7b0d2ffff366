"""One row per model for batch summaries, read from each run's report.json (the summary never recomputes).

Its figures are those of the set the verdict judged (the held-out samples when given), beside the figure that
decided and the set named (compare.decided_by): one figure per question, the one the verdict used."""

from __future__ import annotations

import csv
import io
from html import escape
from pathlib import Path

from qprep.disk.reading import read_json
from qprep import jsonfile
from qprep.jsonfile import number
from qprep.measure.metrics import main_agreement
from qprep.report.float_nodes import float_count
from qprep.report.verdict import decided_by, judged_set

COLUMNS = ["model", "status", "decided_by", "cosine_mean", "agreement", "judged_on", "speedup",
           "original_ms", "optimized_ms", "result_ms", "nodes_before", "nodes_after",
           "layernorms_fused", "float_nodes", "int8_macs", "seconds", "error", "run_dir"]


def summary_row(name: str, run_dir: Path, seconds: float | None, error: str = "", status: str | None = None,
                note: str = "") -> dict:
    row = {"model": name, "status": status or "ok", "run_dir": str(run_dir), "error": error, "note": note,
           "seconds": None if seconds is None else round(seconds, 1)}
    try:
        report = jsonfile.numbers(read_json(run_dir / "report.json"))
    except (OSError, ValueError):
        return row
    if status is None:
        row["status"] = report.get("status", "ok")
    model, result = report.get("model", {}), report.get("result", {})
    # a deployable other than model.onnx (RKNN's .rknn): model.onnx's nodes are the float model it was built from
    row.update(nodes_before=model.get("nodes"), nodes_after=None if result.get("deployable") else result.get("nodes"),
               layernorms_fused=_layernorms_fused(report.get("stages") or []),
               float_nodes=_float_nodes(report), int8_macs=number(result.get("integer_share")))
    if seconds is None:
        row["seconds"] = report.get("seconds")
    evaluation = report.get("evaluation") or {}
    split, samples, outputs = judged_set(evaluation)
    row["cosine_mean"], row["agreement"] = _headline(outputs)
    figure = decided_by(evaluation)
    row["decided_by"] = figure["text"] if figure else None
    if evaluation:
        row["judged_on"] = f"{split}, {samples.get('count', '?')} samples"
    row.update(latency_figures(evaluation.get("latency") or {}))
    return row


def _float_nodes(report: dict) -> int:
    """The result's float nodes as its report counts them (float_nodes.py); with nothing quantized, the float set."""
    count = float_count(report)
    return len(report.get("float_set") or []) if count is None else count


def _layernorms_fused(stages: list[dict]) -> int | None:
    """LayerNorms the optimize stage fused (its fuse_layernorm pass); None without that stage. Why not the
    LayerNormalization count after minus before: a failed run has no result (it read minus the model's count),
    and a later stage may take one apart or a cleanup drop one (it read -1 on a DETR)."""
    passes = [p for s in stages if s.get("name") == "optimize" for p in s.get("passes") or []]
    fused = [(p.get("details") or {}).get("fused", 0) for p in passes if p.get("pass") == "fuse_layernorm"
             and p.get("status") != "rolled back"]
    return sum(fused) if fused else None


def latency_figures(latency: dict) -> dict:
    """The speed-up and the median ms of original, optimized float and result at ORT's default level (None where
    not timed: no optimize, an RKNN result)."""
    return {"speedup": number(latency.get("speedup")),
            **{f"{column}_ms": number((latency.get(label) or {}).get("median_ms"))
               for column, label in (("original", "reference"), ("optimized", "optimized"), ("result", "result"))}}


def _headline(outputs: dict | None) -> tuple[float | None, float | None]:
    """(worst cosine over the outputs, the main output's agreement) of one sample set."""
    if not outputs:
        return None, None
    first = next(iter(outputs.values()))  # the main output: the first one the model declares
    prefix = main_agreement(first)
    cosines = [number(m["cosine_mean"]) for m in outputs.values() if m.get("cosine_mean") is not None]
    return (min(cosines) if cosines else None,  # outputs judged by cosine only (measure/kinds.py)
            number(first[f"{prefix}_agreement"]) if prefix else None)


def _cell(value) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.4f}" if value <= 1.0 else f"{value:.2f}"
    return str(value)


def render_summary_md(rows: list[dict], ran_on: str = "") -> str:
    lines = ["# qprep batch summary", ""] + ([f"Ran on {ran_on}.", ""] if ran_on else []) + ["| " + " | ".join(COLUMNS[:-1]) + " |", "|" + "---|" * (len(COLUMNS) - 1)]
    for row in rows:
        cells = [_cell(row.get(c)) for c in COLUMNS[:-1]]
        if row.get("note"):
            cells[-1] = (cells[-1] if cells[-1] != "–" else "") + f" ({row['note']})"
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def render_summary_csv(rows: list[dict]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=COLUMNS + ["note"], extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()


def render_summary_html(rows: list[dict], ran_on: str = "") -> str:
    head = "".join(f"<th>{escape(c)}</th>" for c in COLUMNS[:-1])
    body = []
    for row in rows:
        style = {"failed": "#f8d7da", "refused": "#f8d7da", "gate missed": "#fff3cd"}.get(row["status"], "")
        cells = "".join(f"<td>{escape(_cell(row.get(c)).replace('`', ''))}</td>" for c in COLUMNS[:-1])
        body.append(f"<tr style='background:{style}'>{cells}</tr>")
    return ("<!doctype html><html><head><meta charset='utf-8'><title>qprep batch</title><style>"
            "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:3px 8px;font:13px system-ui}"
            "</style></head><body><h1>qprep batch summary</h1>"
            + (f"<p>Ran on {escape(ran_on)}.</p>" if ran_on else "") + "<table><tr>" + head + "</tr>" + "".join(body)
            + "</table></body></html>\n")
