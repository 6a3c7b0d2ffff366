"""report.json → report.html: one self-contained page (inline CSS and SVG) that opens offline."""

from __future__ import annotations

from html import escape

from qprep.report.fallback import fallback_tables

from qprep.report.markdown import _num, agreement_text
from qprep.report.plots import bar_chart

STYLE = """body{font-family:system-ui,sans-serif;margin:2em;max-width:1100px;color:#222}
table{border-collapse:collapse;margin:.6em 0}td,th{border:1px solid #ccc;padding:3px 8px;font-size:13px}
th{background:#f3f3f3;text-align:left}.ok{color:#1e8449}.bad{color:#c0392b;font-weight:bold}
code{font-size:12px}.note{background:#fff6d6;padding:6px 10px;border-left:4px solid #e6b800}"""


def render_html(report: dict) -> str:
    model = report.get("model", {})
    status = report.get("status", "?")
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>qprep report</title>"
             f"<style>{STYLE}</style></head><body>",
             f"<h1>qprep report: {escape(str(model.get('path', '?')))}</h1>",
             f"<p>Status: <b class='{'ok' if status == 'ok' else 'bad'}'>{escape(status)}</b>"
             + (f" — {escape(report['error'])}" if report.get("error") else "")
             + f" · input: {escape(str(model.get('kind')))}, {model.get('nodes')} nodes · "
               f"run time {report.get('seconds', 0):.1f} s</p>"]
    parts += _evaluation(report.get("evaluation"))
    parts += _stages(report.get("stages", []))
    if report.get("float_set"):
        parts.append(f"<h2>Kept float ({len(report['float_set'])} nodes)</h2><p>"
                     + ", ".join(f"<code>{escape(n)}</code>" for n in report["float_set"]) + "</p>")
    if report.get("warnings"):
        parts.append("<h2>Warnings</h2><ul>" + "".join(f"<li>{escape(w)}</li>" for w in report["warnings"]) + "</ul>")
    parts.append("</body></html>")
    return "\n".join(parts)


def _table(header: list[str], rows: list[list]) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _evaluation(evaluation: dict | None) -> list[str]:
    if not evaluation:
        return []
    parts = ["<h2>Accuracy against the reference</h2>",
             f"<p>Reference <code>{escape(evaluation['reference_model'])}</code>, "
             f"{evaluation['samples']['count']} evaluation samples.</p>"]
    parts += [f"<p class='note'>{escape(n)}</p>" for n in evaluation.get("notes", [])]
    rows = [[escape(name), f"{m['cosine_mean']:.5f}", f"{m['cosine_min']:.5f}", f"{m['sqnr_db']:.1f}",
             f"{m['max_abs']:.3g}", escape(agreement_text(m))] for name, m in evaluation["outputs"].items()]
    parts.append(_table(["output", "cosine mean", "cosine min", "SQNR dB", "max abs", "agreement (95% CI)"], rows))
    gate = evaluation.get("gate")
    if gate:
        rows = [[escape(c["metric"]), "n/a" if c["value"] is None else f"{c['value']:.4g}",
                 f"{'≤' if c.get('kind') == 'maximum' else '≥'} {c['threshold']}",
                 f"<span class='{'ok' if c['passed'] else 'bad'}'>{'ok' if c['passed'] else 'missed'}</span>"]
                for c in gate["checks"]]
        parts.append("<h3>Gate</h3>" + _table(["metric", "value", "needs", "result"], rows))
    latency = evaluation.get("latency")
    if latency and "speedup" in latency:
        parts.append(f"<p>Latency (batch 1, {latency['settings']['threads']} threads, median of "
                     f"{latency['result']['runs']} runs): reference {latency['reference']['median_ms']:.2f} ms, "
                     f"result {latency['result']['median_ms']:.2f} ms — <b>{latency['speedup']:.2f}×</b></p>")
    elif latency:
        parts.append(f"<p>Latency: {escape(latency['status'])}</p>")
    layers = evaluation.get("layers")
    if layers:
        in_order = sorted(layers, key=lambda r: r["order"])
        parts.append("<h3>Per-layer error (accumulated, in graph order)</h3>")
        if all(r.get("sqnr_db") is not None for r in in_order):
            parts.append(bar_chart([(r["tensor"], r["sqnr_db"]) for r in in_order[:80]], "SQNR (dB) per tensor", " dB"))
        else:  # backends that report cosine only (RKNN accuracy_analysis): 100 × cosine, so 99.x reads easily
            parts.append(bar_chart([(r["tensor"], 100 * r["cosine_mean"]) for r in in_order[:80]],
                                   "accumulated cosine × 100 per tensor", ""))
        rows = [[f"<code>{escape(r['tensor'])}</code>", escape(r["op_type"]), f"{r['cosine_mean']:.5f}",
                 _num(r.get("single_cosine"), ".5f"), _num(r.get("sqnr_db"), ".1f")] for r in layers[:20]]
        parts.append("<h3>Worst layers</h3>" + _table(["tensor", "op", "cosine (accumulated)", "cosine (layer alone)",
                                                       "SQNR dB"], rows))
    return parts


def _stages(stages: list[dict]) -> list[str]:
    if not stages:
        return ["<p>No stages configured.</p>"]
    rows = [[str(s["index"] + 1), escape(s["name"]), escape(s["status"]),
             f"{s.get('nodes_before', '?')} → {s.get('nodes_after', '?')}", f"{s.get('seconds', 0):.2f}",
             escape(s.get("reason") or s.get("error") or
                    (f"rolled back: {', '.join(str(r.get('pass') or r.get('rewrite') or r) for r in s['rolled_back'])}"
                     if s.get("rolled_back") else ""))]
            for s in stages]
    parts = ["<h2>Stages</h2>", _table(["#", "stage", "status", "nodes", "seconds", "notes"], rows)]
    for s in stages:
        if s.get("passes"):
            rows = [[escape(p["pass"]), escape(p["status"]), str(p["matches"]), str(p["nodes_removed"]),
                     escape(", ".join(f"{op} {n:+d}" for op, n in p.get("op_delta", {}).items()))]
                    for p in s["passes"]]
            parts.append(f"<h3>{escape(s['name'])}: passes</h3>"
                         + _table(["pass", "status", "rewrites", "nodes removed", "ops changed"], rows))
        view = fallback_tables(s)
        if view is not None:
            verdict, tables = view
            parts.append(f"<h3>{escape(s['name'])}: accuracy-driven fallback</h3>"
                         f"<p>{escape(verdict).replace('**', '')}</p>")
            parts += [f"<h4>{escape(title)}</h4>" + _table(header, [[escape(c) for c in row] for row in rows])
                      for title, header, rows in tables]
    return parts
