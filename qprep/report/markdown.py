"""report.json → report.md: what went in, what each stage changed, what came out."""

from __future__ import annotations

from qprep.report.fallback import fallback_tables


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
            lines += _fallback(s)
            against = (s.get("effect") or {}).get("against_fp32")
            if against:
                for output, values in against["outputs"].items():
                    lines += [f"{s['name']}: cosine of `{output}` against the FP32 model "
                              f"{values['cosine_mean_before']:.4f} before → {values['cosine_mean_after']:.4f} after "
                              f"({against['samples']} samples).", ""]
    else:
        lines += ["No stages configured: the result is the loaded model (nodes named, shapes inferred).", ""]
    result = report.get("result")
    if result:
        deployable = result.get("deployable")
        lines += ["## Result", ""]
        if deployable:
            lines += [f"Deployable: `{deployable['path']}` ({deployable['bytes'] / 1e6:.2f} MB); {deployable['note']}.", ""]
        lines += [f"`{result['path']}`: {result['kind']}, {result['nodes']} nodes, "
                  f"{result['bytes'] / 1e6:.2f} MB", "", "| op | input model | result |", "|---|---|---|"]
        before, after = model.get("op_counts", {}), result.get("op_counts", {})
        for op in sorted(set(before) | set(after), key=lambda o: (-after.get(o, 0), -before.get(o, 0), o)):
            lines.append(f"| {op} | {before.get(op, 0)} | {after.get(op, 0)} |")
        lines.append("")
    lines += _evaluation(report.get("evaluation"))
    if report.get("warnings"):
        lines += ["## Warnings", ""] + [f"- {w}" for w in report["warnings"]] + [""]
    return "\n".join(lines)


def _fallback(stage: dict) -> list[str]:
    view = fallback_tables(stage)
    if view is None:
        return []
    verdict, tables = view
    lines = [f"### {stage['name']}: accuracy-driven fallback", "", verdict, ""]
    for title, header, rows in tables:
        lines += [f"{title}:", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(row) + " |" for row in rows] + [""]
    return lines


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


def _evaluation(evaluation: dict | None) -> list[str]:
    if not evaluation:
        return []
    samples = evaluation["samples"]
    lines = ["## Accuracy against the reference", "",
             f"Reference `{evaluation['reference_model']}`, {samples['count']} evaluation samples from "
             f"`{samples['source']}`.", ""]
    lines += [f"> {note}" for note in evaluation.get("notes", [])]
    lines += ["| output | cosine mean | cosine min | SQNR dB | max abs | agreement (95% CI) |", "|---|---|---|---|---|---|"]
    for name, m in evaluation["outputs"].items():
        lines.append(f"| {name} | {m['cosine_mean']:.5f} | {m['cosine_min']:.5f} | {m['sqnr_db']:.1f} | "
                     f"{m['max_abs']:.3g} | {agreement_text(m)} |")
    lines.append("")
    for name, m in evaluation["outputs"].items():
        if "top1_accuracy" in m:
            low, high = m["top1_accuracy_ci95"]
            lines += [f"Task accuracy of {name} against ground truth ({m['labelled_samples']} labelled samples): "
                      f"FP32 {100 * m['reference_top1_accuracy']:.1f}%, result {100 * m['top1_accuracy']:.1f}% "
                      f"({100 * low:.1f}–{100 * high:.1f}%).", ""]
    gate = evaluation.get("gate")
    if gate:
        verdict = "passed" if gate["passed"] else "**missed**"
        checks = "; ".join(f"{c['metric']} {'n/a' if c['value'] is None else format(c['value'], '.4g')} "
                           f"({'>=' if c.get('kind') != 'maximum' else '<='} {c['threshold']}: "
                           f"{'ok' if c['passed'] else 'missed'})" for c in gate["checks"])
        lines += [f"Gate {verdict}: {checks}", ""]
    latency = evaluation.get("latency")
    if latency and "speedup" in latency:
        lines += [f"Latency (batch 1, {latency['settings']['threads']} threads, median of "
                  f"{latency['result']['runs']} runs): reference {latency['reference']['median_ms']:.2f} ms, "
                  f"result {latency['result']['median_ms']:.2f} ms — **{latency['speedup']:.2f}×**.", ""]
    elif latency:
        lines += [f"Latency: {latency['status']}.", ""]
    sizes = evaluation.get("size_bytes")
    if sizes:
        lines += [f"Size: reference {sizes['reference'] / 1e6:.2f} MB, result {sizes['result'] / 1e6:.2f} MB.", ""]
    layers = evaluation.get("layers")
    if layers:
        lines += ["### Worst layers (accumulated error, worst first)", "",
                  "| tensor | op | cosine (accumulated) | cosine (this layer alone) | SQNR dB |", "|---|---|---|---|---|"]
        lines += [f"| `{r['tensor']}` | {r['op_type']} | {r['cosine_mean']:.5f} | "
                  f"{_num(r.get('single_cosine'), '.5f')} | {_num(r.get('sqnr_db'), '.1f')} |" for r in layers[:15]]
        lines.append("")
    worst = {name: m.get("worst_samples", []) for name, m in evaluation["outputs"].items()}
    for name, rows in worst.items():
        if rows:
            listed = ", ".join(f"{r['sample']} ({r['cosine']:.4f})" for r in rows)
            lines += [f"Worst samples for {name} (cosine): {listed}", ""]
    return lines


def agreement_text(m: dict) -> str:
    for prefix in ("top1", "step"):
        if f"{prefix}_agreement" in m:
            low, high = m[f"{prefix}_agreement_ci95"]
            return (f"{prefix} {100 * m[f'{prefix}_agreement']:.1f}% ({100 * low:.1f}–{100 * high:.1f}%, "
                    f"n={m[f'{prefix}_count']})")
    return "–"


def _num(value, spec: str) -> str:
    return "–" if value is None else format(value, spec)
