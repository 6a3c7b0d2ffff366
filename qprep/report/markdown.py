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
        for s in stages:
            lines += _passes_table(s)
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


def _passes_table(stage: dict) -> list[str]:
    """Per-pass detail of a stage that runs passes (optimize): what matched, what was kept, how it verified."""
    passes = stage.get("passes")
    if not passes:
        return []
    lines = [f"### {stage['name']}: passes", "",
             f"Verified on {stage.get('verified_on', '?')}; rewriting {stage.get('rewrite_seconds', 0):.2f} s, "
             f"verification {stage.get('verify_seconds', 0):.2f} s, {stage.get('rounds', 1)} round(s).", "",
             "| pass | status | rewrites | nodes removed | ops changed | worst max abs error | seconds |",
             "|---|---|---|---|---|---|---|"]
    for p in passes:
        outputs = (p.get("verification") or {}).get("outputs", {})
        worst = max((o["max_abs"] for o in outputs.values()), default=None)
        delta = ", ".join(f"{op} {n:+d}" for op, n in sorted(p.get("op_delta", {}).items(), key=lambda kv: -abs(kv[1])))
        lines.append(f"| {p['pass']} | {p['status']} | {p['matches']} | {p['nodes_removed']} | {delta or '–'} | "
                     f"{'–' if worst is None else f'{worst:.2g}'} | {p['seconds'] + p['verify_seconds']:.2f} |")
    for r in stage.get("rolled_back", []):
        lines.append(f"\nRolled back: **{r['pass']}** (round {r['round']}): {r['reason']}")
    return lines + [""]
