"""What a report says, once: report.json → a list of blocks that report.md and report.html both render.

Order is what a person asks first: is the result good enough (the verdict, verdict.py) and what that means for
the task, what could make those figures mislead (warnings), then what it cost in accuracy and speed
(evaluation), what each stage changed and decided, what came out. Inline markup in texts and cells is
Markdown's `**bold**` and `` `code` ``; the HTML renderer translates it.
"""

from __future__ import annotations

from dataclasses import dataclass

from qprep.report.decisions import decision_lines, files_lines
from qprep.report.fallback import fallback_tables
from qprep.report.float_nodes import float_nodes, mostly_float_text, table_rows
from qprep.report.layer_chart import band, layer_error, layers_line, worst_first
from qprep.report.verdict import INTERVAL_NOTE, agreement_text, distinct, judged_set, num, task_lines, verdict

NEAR_TIE = 0.9  # a changed top-1 whose FP32 top two are nearer than on 90% of the rows is a near tie


@dataclass
class Heading:
    level: int
    text: str


@dataclass
class Text:
    text: str
    note: bool = False  # a caveat the reader must not miss (evaluation notes)


@dataclass
class Bullets:
    items: list[str]


@dataclass
class Table:
    header: list[str]
    rows: list[list[str]]
    title: str = ""


@dataclass
class LayerChart:
    """Every tensor's error (layer_chart.py; HTML only, Markdown has the table of the worst beside it)."""

    layers: list[dict]
    left_out: dict[str, int] | None = None  # float tensors not compared, by reason: the heading counts them

def build(report: dict) -> list:
    model = report.get("model", {})
    found = verdict(report)
    blocks: list = [Heading(1, f"qprep report: {model.get('path', '?')}"), found]
    if found.mostly_float and mostly_float_text(report):  # what made it so, and the setting that changes it
        blocks.append(Text(mostly_float_text(report), note=True))
    tasks = task_lines(report.get("evaluation"))
    if tasks:
        blocks += [Bullets(tasks), Text(INTERVAL_NOTE)]
    if report.get("warnings"):  # on the first screen: each one can make the figures mean less than they seem to
        blocks += [Heading(2, "Warnings"), Bullets(list(report["warnings"]))]
    blocks.append(Bullets([
        f"status: **{report.get('status')}**" + (f" — {report['error']}" if report.get("error") else ""),
        f"input model: {model.get('kind', '?')}, {model.get('nodes', '?')} nodes, opsets {model.get('opsets', {})}",
        f"run time: {report.get('seconds', 0):.1f} s"]))
    calibration = report.get("calibration")
    if calibration:
        blocks.append(Text(f"Calibration data: {calibration['count']} samples ({calibration['format']}) from "
                           f"`{calibration['source']}`"))
    blocks += _evaluation(report.get("evaluation"))
    decisions = [line for stage in report.get("stages", []) for line in decision_lines(stage, report)]
    if decisions:
        blocks += [Heading(2, "Decisions"), Bullets(decisions)]
    files = files_lines(report)
    if files:
        blocks += [Heading(2, "Files"), Bullets(files)]
    blocks += _stages(report.get("stages", []))
    blocks += _result(report.get("result"), model)
    blocks += _kept_float(report)
    return blocks


def _kept_float(report: dict) -> list:
    """The result's float nodes by reason, with their share of the multiply-adds (float_nodes.py); before a
    quantize stage finished, the float set the stages recorded."""
    found = float_nodes(report)
    if found is None:
        names = report.get("float_set") or []
        return [Heading(2, f"Kept float ({len(names)} nodes)"), Text(", ".join(f"`{n}`" for n in names))] \
            if names else []
    if not found.count:
        return []
    return [Heading(2, f"Kept float ({found.count} nodes)"),
            Table(["why", "nodes", "multiply-adds", "which", "setting that changes it"], table_rows(found))]


def _evaluation(evaluation: dict | None) -> list:
    if not evaluation:
        return []
    samples = evaluation["samples"]
    blocks: list = [Heading(2, "Accuracy against the reference"),
                    Text(f"Reference `{evaluation['reference_model']}`, {samples['count']} evaluation samples from "
                         f"`{samples.get('source', '?')}`.")]
    blocks += [Text(note, note=True) for note in evaluation.get("notes", [])]
    blocks += _outputs(evaluation["outputs"])
    heldout = evaluation.get("heldout")
    if heldout:
        blocks.append(Text(f"**Held-out samples** ({heldout['samples']['count']} from "
                           f"`{heldout['samples'].get('source', '?')}`; no decision of the run saw them):"))
        blocks += [Text(note, note=True) for note in heldout.get("notes", [])]
        blocks += _outputs(heldout["outputs"], why=False)
    gate = evaluation.get("gate")
    if gate:
        kind = "Accuracy floor (no gate configured; it catches a collapse)" if gate.get("source") == "floor" else "Gate"
        judged = " (judged on the held-out samples)" if judged_set(evaluation)[0] == "held-out" else ""
        blocks.append(Table(["metric", "value", "needs", "result"], [
            [c["metric"] + (f" (for {c['stands_for']})" if c.get("stands_for") else ""),
             "not measured" if c["value"] is None else distinct(c["value"], c["threshold"]),
             f"{'≤' if c.get('kind') == 'maximum' else '≥'} {c['threshold']:.4g}",
             ("ok" if c["passed"] else "**missed**") + (f" (too few to decide: {c['undecided']})"
                                                         if c.get("undecided") else "")] for c in gate["checks"]],
            title=f"{kind} {'passed' if gate['passed'] else '**missed**'}{judged}"))
        if gate.get("worst_tensors"):
            blocks.append(Text("Worst: " + "; ".join(gate["worst_tensors"]), note=True))
    blocks += latency_blocks(evaluation.get("latency"))
    sizes = evaluation.get("size_bytes")
    if sizes:
        blocks.append(Text(f"Size: reference {sizes['reference'] / 1e6:.2f} MB, "
                           f"result {sizes['result'] / 1e6:.2f} MB."))
    blocks += _layers(evaluation.get("layers"), evaluation.get("layers_left_out"))
    # the worst samples of the set the verdict is judged on: the held-out one when given
    split, _, judged = judged_set(evaluation)
    which = "held-out samples" if split == "held-out" else "samples"
    for name, m in judged.items():
        rows = m.get("worst_samples", [])
        if rows and "reference_text" in rows[0]:  # ctc: what each side reads
            blocks.append(Table(["sample", m.get("worst_by", "?"), "FP32 reads", "result reads"],
                                [[r["sample"], f"{_value(r):.3g}", _quoted(r["reference_text"]),
                                  _quoted(r["result_text"])] for r in rows], title=f"Worst {which} for {name}"))
        elif rows:
            blocks.append(Text(f"Worst {which} for {name} ({m.get('worst_by', 'cosine')}): "
                               + ", ".join(f"{r['sample']} ({_value(r):.4g})" for r in rows)))
        if m.get("top1_changed"):
            blocks.append(Text(changed_text(m["top1_changed"], m.get("samples"), which, name)))
    return blocks


def changed_text(changed: list[dict], samples: int | None, which: str, name: str) -> str:
    """The samples whose top-1 changed, nearest tie first, and how many were near ties in FP32 (metrics._flips):
    those flip under any rounding, so a few of them say little about the quantization."""
    near = sum(c["closer_than"] >= NEAR_TIE for c in changed)
    listed = ", ".join(f"{c['sample']} (top two {c['float_gap']:.3g} apart, nearer than "
                       f"{100 * c['closer_than']:.0f}% of FP32's top-two gaps)" for c in changed[:8])
    more = f" and {len(changed) - 8} more" if len(changed) > 8 else ""
    return (f"Top-1 of {name} changed on {len(changed)} of {samples or '?'} {which}: {listed}{more}; {near} of them "
            f"among FP32's {100 * (1 - NEAR_TIE):.0f}% nearest ties.")


def _quoted(text: str) -> str:
    """A decoded text as a cell, quoted so that spaces and an empty text stay visible."""
    return f"“{text}”"


def _outputs(outputs: dict, why: bool = True) -> list:
    """The per-output table of one sample set (each output's kind and the figures that judge it), why each
    kind was chosen, and task accuracy where labels were given."""
    # SQNR over all samples, and per sample (mean_sqnr_db: what a cosine threshold also holds, see gate.py)
    blocks: list = [Table(["output", "kind", "judged by", "cosine mean", "cosine min", "SQNR dB",
                           "SQNR dB per sample", "max abs"],
                          [[name, m.get("kind", "tensor"), judged_text(m), num(m.get("cosine_mean"), ".5f"),
                            num(m.get("cosine_min"), ".5f"), num(m.get("sqnr_db"), ".1f"),
                            num(m.get("mean_sqnr_db"), ".1f"), num(m.get("max_abs"), ".3g")]
                           for name, m in outputs.items()])]
    if why and any("why" in m for m in outputs.values()):
        blocks.append(Bullets([f"`{name}` is judged as **{m['kind']}**: {m['why']}"
                               for name, m in outputs.items() if "why" in m]))
    for name, m in outputs.items():
        if "top1_accuracy" in m:
            low, high = m["top1_accuracy_ci95"]
            blocks.append(Text(f"Task accuracy of {name} against ground truth ({m['labelled_samples']} labelled "
                               f"samples): FP32 {100 * m['reference_top1_accuracy']:.1f}%, result "
                               f"{100 * m['top1_accuracy']:.1f}% ({100 * low:.1f}–{100 * high:.1f}%)."))
    return blocks


def latency_blocks(latency: dict | None) -> list:
    """Original → optimized float → result, at ORT's default level and, for the float models, at
    ORT_ENABLE_BASIC (what optimize bought where the runtime does not fuse by itself); what was not timed, why."""
    if not latency:
        return []
    if "reference" not in latency:  # nothing timed (an RKNN result, and optimize changed nothing or did not run)
        return [Text(f"Latency: {text}.") for text in (latency.get("status"), latency.get("optimized_status")) if text]
    basic = latency.get("basic") or {}
    rows = [["original", _timing(latency["reference"]), _timing(basic.get("reference"))],
            ["optimized float", _timing(latency.get("optimized"), latency, "optimized_"),
             _timing(basic.get("optimized"), basic, "optimized_")]]
    result = _timing(latency.get("result"), latency, "") if "result" in latency else "not timed"
    rows.append(["result", result, "–"])
    level = basic.get("level", "ORT_ENABLE_BASIC")
    blocks: list = [Table(["model", f"ONNX Runtime default ({latency['settings']['graph_optimization']})",
                           f"{level} (no fusions of its own, as an NPU toolkit's input)"], rows,
                          title=f"Latency (batch 1, {latency['settings']['threads']} threads, CPU; median of "
                                f"{_runs_text(latency)})")]
    said = [latency.get("optimized_status"), basic.get("status"), latency.get("status")]
    blocks += [Text(f"Latency: {text}.") for text in said if text]
    if latency.get("seconds") is not None:
        blocks.append(Text(f"The latency step took {latency['seconds']:.1f} s."))
    return blocks


def _timing(timing: dict | None, against: dict | None = None, prefix: str = "") -> str:
    """'12.3 ms ±1.5%', with the speed-up over the original (and its rounds' range) when `against` holds one."""
    if not timing:
        return "–"
    text = f"{_ms(timing['median_ms'])} ms" + (f" ±{100 * timing['interval']:.1f}%" if timing.get("interval") else "")
    if against and f"{prefix}speedup" in against:
        text += f" — **{against[prefix + 'speedup']:.2f}×**{_round_range(against, prefix)}"
    return text


def _ms(value: float) -> str:
    return f"{value:.0f}" if value >= 100 else f"{value:.2f}" if value >= 1 else f"{value:.3g}"


def _round_range(latency: dict, prefix: str = "") -> str:
    """' (rounds 1.17–1.25×)' when the speed was timed in more than one round (reports before it have none)."""
    low_high = latency.get(f"{prefix}speedup_rounds")
    if not low_high or latency["reference"].get("rounds", 1) < 2:
        return ""
    return f" (rounds {low_high[0]:.2f}–{low_high[1]:.2f}×)"


def _layers(layers: list[dict] | None, left_out: dict[str, int] | None = None) -> list:
    if not layers:  # every tensor left out: say so, the note is all the reader has
        return [Heading(3, "Per-layer error"), Text(layers_line([], left_out))] if left_out else []
    worst = worst_first(layers)[:15]
    return [Heading(3, "Per-layer error"), LayerChart(layers, left_out), Text(layers_line(layers, left_out)),
            Table(["tensor", "op", "1 − cosine", "cosine (accumulated)", "cosine (this layer alone)", "SQNR dB"],
                  [[f"`{r['tensor']}`", r.get("op_type", "?"), f"{band(layer_error(r))} {layer_error(r):.2g}",
                    num(r.get("cosine_mean"), ".5f"), num(r.get("single_cosine"), ".5f"), num(r.get("sqnr_db"), ".1f")]
                   for r in worst], title=f"Worst {len(worst)} tensors (accumulated error, worst first)")]


def _stages(stages: list[dict]) -> list:
    if not stages:
        return [Text("No stages configured: the result is the loaded model (nodes named, shapes inferred).")]
    rows = []
    for s in stages:
        notes = s.get("reason") or s.get("error") or ""
        if s.get("rolled_back"):
            notes = "rolled back: " + ", ".join(
                str(r.get("pass") or r.get("rewrite") or r) if isinstance(r, dict) else str(r) for r in s["rolled_back"])
        rows.append([str(s["index"] + 1), s["name"], s["status"],
                     f"{s.get('nodes_before', '?')} → {s.get('nodes_after', '?')}", f"{s.get('seconds', 0):.2f}", notes])
    blocks: list = [Heading(2, "Stages"), Table(["#", "stage", "status", "nodes before → after", "seconds", "notes"],
                                                rows)]
    for s in stages:
        blocks += _passes(s)
        view = fallback_tables(s)
        if view is not None and view[1]:  # its verdict line is under Decisions; no heading over no table
            blocks.append(Heading(3, f"{s['name']}: accuracy-driven fallback"))
            blocks += [Table(header, table_rows, title=title) for title, header, table_rows in view[1]]
        against = (s.get("effect") or {}).get("against_fp32")
        for output, values in (against or {}).get("outputs", {}).items():
            blocks.append(Text(f"{s['name']}: cosine of `{output}` against the FP32 model "
                               f"{num(values['cosine_mean_before'], '.4f', 'not measured')} before → "
                               f"{num(values['cosine_mean_after'], '.4f', 'not measured')} after "
                               f"({against['samples']} samples)."))
    return blocks


def _checks_text(checks: dict | None) -> str:
    """How the rounds were verified: once per round, or pass by pass after a failed round check."""
    if not checks:
        return ""
    text = f"; {checks['rounds_checked_at_once']} round(s) verified as a whole"
    if checks["rounds_replayed"]:
        text += f", {checks['rounds_replayed']} replayed pass by pass to find the pass that changed the numbers"
    return text


def _passes(stage: dict) -> list:
    """Per-pass detail of a stage that runs passes (optimize): what matched, what was kept, how it verified."""
    passes = stage.get("passes")
    if not passes:
        return []
    rows = []
    for p in passes:
        outputs = (p.get("verification") or {}).get("outputs", {})
        worst = max((o["max_abs"] for o in outputs.values()), default=None)
        delta = ", ".join(f"{op} {n:+d}" for op, n in sorted(p.get("op_delta", {}).items(), key=lambda kv: -abs(kv[1])))
        rows.append([p["pass"], p["status"], str(p["matches"]), str(p["nodes_removed"]), delta or "–",
                     "–" if worst is None else f"{worst:.2g}", f"{p['seconds'] + p['verify_seconds']:.2f}"])
    blocks = [Heading(3, f"{stage['name']}: passes"),
              Text(f"Verified on {stage.get('verified_on', '?')}; rewriting {stage.get('rewrite_seconds', 0):.2f} s, "
                   f"verification {stage.get('verify_seconds', 0):.2f} s, {stage.get('rounds', 1)} round(s)"
                   f"{_checks_text(stage.get('checks'))}."),
              Table(["pass", "status", "rewrites", "nodes removed", "ops changed", "worst max abs error", "seconds"],
                    rows)]
    blocks += [Text(f"Rolled back: **{r['pass']}** (round {r['round']}): {r['reason']}")
               for r in stage.get("rolled_back", []) if isinstance(r, dict) and "pass" in r]
    blocks += [Text(f"Left unfused by **{p['pass']}**: " + "; ".join(f"{n}× {reason}" for reason, n in refused.items()))
               for p in passes if (refused := (p.get("details") or {}).get("refused"))]
    blocks += [Text(f"Left unfolded by **{p['pass']}**: " + "; ".join(f"{n}× {LEFT.get(reason, reason)}"
                                                                     for reason, n in left.items()))
               for p in passes if (left := (p.get("details") or {}).get("left"))]
    return blocks


# Why constant folding left a node (qprep/optimize/passes/fold_constants.py's `left` counts)
LEFT = {"cost": "over the folding cost bound", "size": "a result over the size cap",
        "not_runnable": "ONNX Runtime cannot evaluate it (random, control flow, custom domain or refused)"}


def _result(result: dict | None, model: dict) -> list:
    if not result:
        return []
    blocks: list = [Heading(2, "Result")]
    deployable = result.get("deployable")
    if deployable:
        blocks.append(Text(f"Deployable: `{deployable['path']}` ({deployable['bytes'] / 1e6:.2f} MB); "
                           f"{deployable['note']}."))
    share = result.get("integer_share")
    blocks.append(Text(f"`{result['path']}`: {result['kind']}, {result['nodes']} nodes, "
                       f"{result['bytes'] / 1e6:.2f} MB"
                       + (f"; {share:.0%} of the multiply-adds (Conv, MatMul, Gemm) run on integers"
                          if share is not None else "")
                       + (f"; **{result['float_layers_in_bodies']} layers inside If/Loop/Scan bodies run float** "
                          "(not counted in that share: the quantizer does not enter control flow)"
                          if result.get("float_layers_in_bodies") else "")))
    before, after = model.get("op_counts", {}), result.get("op_counts", {})
    ordered = sorted(set(before) | set(after), key=lambda o: (-after.get(o, 0), -before.get(o, 0), o))
    blocks.append(Table(["op", "input model", "result"], [[op, str(before.get(op, 0)), str(after.get(op, 0))]
                                                          for op in ordered]))
    return blocks


def judged_text(m: dict) -> str:
    """The figures that judge an output (metrics.JUDGED_BY), agreements with their 95% interval."""
    if m.get("not_measured"):
        return "not measured"
    parts = []
    for metric in m.get("judged_by") or ["cosine_mean"]:
        if metric.endswith("_agreement"):
            parts.append(agreement_text(m, metric[: -len("_agreement")]))
        else:
            parts.append(f"{metric} " + num(m.get(metric), ".5f" if metric.startswith("cosine") else ".4g",
                                             "not measured"))
    return "; ".join(parts)


def _value(row: dict) -> float:
    """A worst-sample row's figure (reports before the kinds wrote it as `cosine`)."""
    return row["value"] if "value" in row else row["cosine"]


def _runs_text(latency: dict) -> str:
    """'50 runs', or for timings that stopped once their median was known: '12–50 runs per round'; each
    model's interval is in its cell."""
    timings = [t for t in (latency.get("reference"), latency.get("optimized"), latency.get("result")) if t]
    counts = [n for t in timings for n in t.get("round_runs", [])]
    if counts and min(counts) != max(counts):
        within = latency["reference"].get("tight")
        return (f"{min(counts)}–{max(counts)} runs per round"
                + (f", each until its median was known within ±{100 * within:g}%, a slow model's runs fewer"
                   if within else "")
                + (" or the time budget spent" if latency["reference"].get("seconds") else ""))
    return f"{latency['reference']['runs']} runs"
