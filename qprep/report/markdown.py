"""report.json → report.md: what went in, what each stage changed, what came out."""

from __future__ import annotations


def render_markdown(report: dict) -> str:
    model = report.get("model", {})
    lines = [f"# qprep report: {model.get('path', '?')}", ""]
    lines += [f"- status: **{report.get('status')}**" + (f" — {report['error']}" if report.get("error") else ""),
              f"- input model: {model.get('kind', '?')}, {model.get('nodes', '?')} nodes, opsets {model.get('opsets', {})}",
              f"- run time: {report.get('seconds', 0):.1f} s", ""]
    calibration = report.get("calibration")
    if calibration:
        lines += [f"Calibration data: {calibration['count']} samples ({calibration['format']}) from "
                  f"`{calibration['source']}`", ""]
    stages = report.get("stages", [])
    if stages:
        lines += ["## Stages", "", "| # | stage | status | nodes before → after | seconds | notes |",
                  "|---|---|---|---|---|---|"]
        for s in stages:
            notes = s.get("reason") or s.get("error") or ""
            if s.get("rolled_back"):
                notes = f"rolled back: {', '.join(str(r.get('pass', r)) if isinstance(r, dict) else str(r) for r in s['rolled_back'])}"
            lines.append(f"| {s['index'] + 1} | {s['name']} | {s['status']} | {s.get('nodes_before', '?')} → "
                         f"{s.get('nodes_after', '?')} | {s.get('seconds', 0):.2f} | {notes} |")
        lines.append("")
    else:
        lines += ["No stages configured: the result is the loaded model (nodes named, shapes inferred).", ""]
    result = report.get("result")
    if result:
        lines += ["## Result", "", f"`{result['path']}`: {result['kind']}, {result['nodes']} nodes, "
                  f"{result['bytes'] / 1e6:.2f} MB", "", "| op | input model | result |", "|---|---|---|"]
        before, after = model.get("op_counts", {}), result.get("op_counts", {})
        for op in sorted(set(before) | set(after), key=lambda o: (-after.get(o, 0), -before.get(o, 0), o)):
            lines.append(f"| {op} | {before.get(op, 0)} | {after.get(op, 0)} |")
        lines.append("")
    if report.get("warnings"):
        lines += ["## Warnings", ""] + [f"- {w}" for w in report["warnings"]] + [""]
    return "\n".join(lines)
