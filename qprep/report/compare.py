"""`qprep compare A B [C…]`: runs (run directories, report.json or batch summary.json) side by side.

Every column after the first shows its delta to the first; a delta in the worse direction beyond a
`--fail-on-regression METRIC=THRESHOLD` makes the command exit 1 (for CI). A latency delta is worse only beyond
both runs' timing spreads (`spreads_of`), and the original model's latency never is: timing noise is not a
regression of the result. One run alone is shown as its
result against its FP32 reference. Above the figures: each run's status, verdict, the figure that decided it
and the samples it was measured on, the backend and the model to deploy. The figures are those of the set the
verdict judged (the held-out samples when given, `judged_outputs`), so no column shows another figure than the
one that decided (verdict.decided_by, also read by batch summaries and `qprep evaluate`). The user's own
`evaluation.metric` has its rows whether or not the gate reads it (`evaluation.metric`, `evaluation.metric_drop`
and FP32's `evaluation.reference_metric`, in the function's own direction): a run whose task metric dropped
otherwise read better on every row.
"""

from __future__ import annotations

import json
import math
from html import escape
from pathlib import Path

from qprep import jsonfile
from qprep.disk.reading import read_json
from qprep.errors import QprepError
from qprep.measure.metrics import OUTPUT_METRICS, higher_is_better
from qprep.report.float_nodes import float_count
from qprep.report.verdict import decided_by, judged_outputs, judged_set, verdict


LATENCY_MS = ("original_ms", "optimized_ms", "result_ms")  # at ORT's default level (evaluate.timed_latency)
USER_METRIC = ("metric", "metric_drop", "reference_metric")  # evaluation.metric's figures (user_metric.py)


def load_record(path: str) -> tuple[str, dict]:
    target = Path(path)
    for candidate in (target, target / "report.json", target / "summary.json"):
        if candidate.is_file():
            try:
                data = jsonfile.numbers(read_json(candidate))
            except (ValueError, OSError) as exc:  # not JSON, not UTF-8, not readable
                raise QprepError(f"compare: cannot read {candidate} as JSON ({_reason(exc)})") from None
            if not isinstance(data, dict):
                raise QprepError(f"compare: {candidate} holds {_describe(data)}, not a qprep report.json or "
                                 "summary.json; pass a run or batch directory qprep wrote")
            return ("summary" if "models" in data else "report"), data
    raise QprepError(f"compare: {path} holds no report.json or summary.json")


def _reason(exc: Exception) -> str:
    return getattr(exc, "strerror", None) or str(exc).splitlines()[0]


def _describe(data) -> str:
    return "null" if data is None else f"a JSON {type(data).__name__} ({json.dumps(data)[:40]})"


def read_metrics(path: str, kind: str, data: dict, reader=None):
    """`metrics_of` (or another `reader` of the file's numbers) for a file the user named: a file of another
    layout (hand-edited, another tool's JSON) is the user's to fix, so its shape errors become one line naming
    the file instead of an internal error."""
    try:
        return reader(data) if reader else metrics_of(kind, data)
    except (AttributeError, TypeError, KeyError, ValueError) as exc:
        raise QprepError(f"compare: {path} does not read as a qprep {kind} ({_reason(exc)}); pass a run or batch "
                         "directory qprep wrote") from None


def metrics_of(kind: str, data: dict) -> dict[str, float | None]:
    """Flat metric name → value; report outputs are `<output>.<metric>`, summaries `<model>.<metric>`."""
    flat: dict[str, float | None] = {}
    if kind == "summary":
        for row in data["models"]:
            for metric in ("cosine_mean", "agreement", "speedup", *LATENCY_MS):
                flat[f"{row['model']}.{metric}"] = _number(row.get(metric), f"{row['model']}.{metric}")
        return flat
    evaluation = data.get("evaluation") or {}
    for output, values in judged_outputs(evaluation).items():
        for metric in OUTPUT_METRICS:
            if metric in values:
                flat[f"{output}.{metric}"] = _number(values[metric], f"{output}.{metric}")
    figures = user_metric(evaluation)
    for metric in USER_METRIC if figures else ():
        flat[f"evaluation.{metric}"] = _number(figures.get(metric), f"evaluation.metric.{metric}")
    latency = evaluation.get("latency") or {}
    if "speedup" in latency:
        flat["latency.speedup"] = _number(latency["speedup"], "latency.speedup")
    for metric, label in zip(LATENCY_MS, ("reference", "optimized", "result")):
        if "median_ms" in (latency.get(label) or {}):
            flat[f"latency.{metric}"] = _number(latency[label]["median_ms"], f"latency.{label}.median_ms")
    result = data.get("result") or {}
    # a deployable other than model.onnx (RKNN's .rknn) has nodes of its own: model.onnx's count is not its
    flat["result.nodes"] = None if result.get("deployable") else _number(result.get("nodes"), "result.nodes")
    flat["result.int8_macs"] = _number(result.get("integer_share"), "result.integer_share")
    quantized = any(stage.get("name") == "quantize" for stage in data.get("stages") or [])
    count = float_count(data)  # the report's own count (RKNN: the float16 layers' nodes)
    flat["result.kept_float"] = (len(data.get("float_set") or []) if count is None else count) \
        if quantized and result else None
    return flat


def user_metric(evaluation: dict) -> dict | None:
    """The user's metric figures of the set the verdict judged (the held-out one when measured), or None."""
    split = judged_set(evaluation)[0]
    return (evaluation.get("heldout") if split == "held-out" else evaluation or {}).get("metric")


def facts_of(kind: str, data: dict) -> dict[str, str | None]:
    """The text rows above the figures: a report's status, verdict with the figure that decided it, the samples
    its figures are of, backend and deployed model; a summary's status and deciding figure per model."""
    if kind == "summary":
        facts: dict[str, str | None] = {}
        for row in data["models"]:
            facts[f"{row['model']}.status"] = _text(row.get("status"))
            facts[f"{row['model']}.decided_by"] = _text(row.get("decided_by"))
            facts[f"{row['model']}.judged_on"] = _text(row.get("judged_on"))
        return facts
    evaluation = data.get("evaluation") or {}
    figure = decided_by(evaluation)
    split, samples, _ = judged_set(evaluation)
    quantize = next((s for s in data.get("stages") or [] if s.get("name") == "quantize"), None)
    return {"status": _text(data.get("status")),
            "verdict": verdict_state(data) if data.get("status") else None,
            "decided by": figure["text"] if figure else None,
            "judged on": f"{split}, {samples.get('count', '?')} samples (`{samples.get('source', '?')}`)"
                         if evaluation else None,
            "backend": (quantize or {}).get("backend") or ("float (no quantize stage)" if data.get("stages") else None),
            "deployed model": deployed_text(data)}


def verdict_state(report: dict) -> str:
    """'met', 'missed', 'not measured', or 'met, but mostly float' as the report's verdict reads."""
    found = verdict(report)
    return f"{found.state}, but mostly float" if found.mostly_float else found.state


def deployed_text(report: dict) -> str | None:
    """The file to deploy and what is known of it: an ONNX result's nodes, a toolkit's file's size (its graph is
    the toolkit's: model.onnx's node count is the float model it was built from, not its own)."""
    result = report.get("result") or {}
    if not result.get("path"):
        return None
    deployable = result.get("deployable")
    if not deployable:
        return (f"{result['path']}, {_megabytes(result)} ({result.get('kind', '?')} ONNX, "
                f"{result.get('nodes', '?')} nodes)")
    target = (result.get("input_contract") or {}).get("target_platform")
    return (f"{deployable['path']}{f' for {target}' if target else ''}, {_megabytes(deployable)} (its node count "
            f"is not recorded; the {result.get('nodes', '?')} of {result['path']} are the float model it was built "
            "from)")


def _megabytes(file: dict) -> str:
    return "size not recorded" if file.get("bytes") is None else f"{file['bytes'] / 1e6:.2f} MB"


def _text(value) -> str | None:
    return None if value is None else str(value)


def _number(value, where: str) -> float | None:
    """A metric as read from JSON: a number (non-finite ones as jsonfile writes them) or null (not measured);
    anything else is not a qprep report."""
    value = jsonfile.number(value)
    if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
        return value
    raise ValueError(f"{where} is {value!r}, not a number")


def compare(paths: list[str], fail_on: dict[str, float]) -> dict:
    records = [(path, *load_record(path)) for path in paths]
    if len(records) == 1 and records[0][1] == "report":
        return _single(records[0][0], records[0][2])
    columns = [path for path, _, _ in records]
    values = [read_metrics(path, kind, data) for path, kind, data in records]
    lower = {"evaluation.metric" for _, kind, data in records if kind == "report"
             and (user_metric(data.get("evaluation") or {}) or {}).get("direction") == "lower"}
    known = {m for v in values for m in v} | {m.rsplit(".", 1)[-1] for v in values for m in v}
    for metric in fail_on:
        if _unjudged(metric):
            raise QprepError(f"--fail-on-regression {metric}: " + (
                "FP32's own evaluation.metric is the reference's figure, never a result's regression; use metric "
                "or metric_drop" if metric.endswith("reference_metric") else "the original model's latency is the "
                "input model timed again, never a result's regression; use result_ms or speedup"))
        if metric not in known:
            raise QprepError(f"--fail-on-regression {metric}: no run reports this metric "
                             f"(metrics: {', '.join(sorted(m for m in known if '.' not in m))})")
    facts = [read_metrics(path, kind, data, lambda d, k=kind: facts_of(k, d)) for path, kind, data in records]
    spreads = [read_metrics(path, kind, data, lambda d, k=kind: spreads_of(k, d)) for path, kind, data in records]
    rows, regressions = _fact_rows(facts), []
    for metric in dict.fromkeys(m for v in values for m in v):
        base = values[0].get(metric)
        cells = []
        for column, v, spread in zip(columns[1:], values[1:], spreads[1:]):
            value = v.get(metric)
            delta = None if value is None or base is None else (0.0 if value == base else value - base)  # inf = inf
            higher = _higher(metric) and metric not in lower
            worse = (delta is not None and (delta < 0 if higher else delta > 0) and not _unjudged(metric)
                     and _beyond_noise(spreads[0].get(metric), spread.get(metric), higher))
            cells.append({"value": value, "delta": delta, "worse": worse})
            threshold = _threshold(metric, fail_on)
            if worse and threshold is not None and abs(delta) > threshold:
                regressions.append({"metric": metric, "run": column, "base": base, "value": value,
                                    "delta": delta, "threshold": threshold})
        rows.append({"metric": metric, "base": base, "others": cells})
    return {"columns": columns, "rows": rows, "regressions": regressions,
            "notes": _set_notes(facts) + _machine_notes(columns, values, spreads, [
                _model_digest(kind, data) for _, kind, data in records])}


def spreads_of(kind: str, data: dict) -> dict[str, tuple[float, float]]:
    """Latency metric → (low, high) that one run's timing cannot tell apart from its median: its rounds' medians
    and the median's 95% interval (latency.interval); for a speed ratio its rounds' ratios (paired: the models
    timed in turn), both timings' intervals when it had one round. Why: two runs of the same model differ by
    timing noise; only a difference beyond both runs' spreads is the result's. A summary records no spread: its
    deltas stand as measured."""
    latency = (data.get("evaluation") or {}).get("latency") or {} if kind == "report" else {}
    spreads = {}
    for metric, label in zip(LATENCY_MS, ("reference", "optimized", "result")):
        timing = latency.get(label) or {}
        if jsonfile.number(timing.get("median_ms")) is not None:
            spreads[f"latency.{metric}"] = _timing_spread(timing)
    if jsonfile.number(latency.get("speedup")) is not None and "result" in latency and "reference" in latency:
        rounds = [jsonfile.number(r) for r in latency.get("speedup_rounds") or []]
        if len(latency["result"].get("round_ms") or []) < 2:  # timed in one round: the intervals say its noise
            (low_ref, high_ref), (low_res, high_res) = (_timing_spread(latency[s]) for s in ("reference", "result"))
            rounds += [low_ref / high_res, high_ref / low_res if low_res > 0 else math.inf]
        rounds = [r for r in rounds if r is not None] or [latency["speedup"]]
        spreads["latency.speedup"] = (min(rounds), max(rounds))
    return spreads


def _timing_spread(timing: dict) -> tuple[float, float]:
    median, share = timing["median_ms"], jsonfile.number(timing.get("interval")) or 0.0
    rounds = [r for r in map(jsonfile.number, timing.get("round_ms") or []) if r is not None]
    return min([*rounds, median * (1 - share)]), max([*rounds, median * (1 + share)])


def _beyond_noise(base: tuple | None, other: tuple | None, higher: bool) -> bool:
    """Is a difference outside both runs' spreads (their ranges apart)? Without a spread on either side (a
    summary, a report from before spreads were read) the difference counts as measured."""
    if base is None or other is None:
        return True
    return other[1] < base[0] if higher else other[0] > base[1]


def _unjudged(metric: str) -> bool:
    """The original model's latency (the same input model timed again) and FP32's own metric: never a result's
    regression."""
    return metric.rsplit(".", 1)[-1] in ("original_ms", "reference_metric")


STATUS_RANK = {"ok": 0, "gate missed": 1, "refused": 2, "failed": 2, "interrupted": 2, "running": 2}


def _fact_rows(facts: list[dict]) -> list[dict]:
    """One text row per fact; a status worse than the first run's is marked like a worse figure."""
    rows = []
    for name in dict.fromkeys(n for f in facts for n in f):
        base = facts[0].get(name)
        cells = []
        for f in facts[1:]:
            value = f.get(name)
            worse = (name.endswith("status") and base in STATUS_RANK and value in STATUS_RANK
                     and STATUS_RANK[value] > STATUS_RANK[base])
            cells.append({"value": value, "delta": None, "worse": worse})
        rows.append({"metric": name, "base": base, "others": cells})
    return rows


def _set_notes(facts: list[dict]) -> list[str]:
    """Runs judged on different samples: their figures' deltas compare different samples, not results."""
    sets = {f.get("judged on") for f in facts if f.get("judged on")}
    if len(sets) < 2:
        return []
    return ["the runs were judged on different samples (row 'judged on'): a delta between them is partly the "
            "samples'; give the runs the same evaluation (and held-out) samples to compare their results"]


def _model_digest(kind: str, data: dict) -> str | None:
    return ((data.get("model") or {}).get("sha256") or None) if kind == "report" else None


def _machine_notes(columns: list[str], values: list[dict], spreads: list[dict], models: list) -> list[str]:
    """The same input model timed beyond both runs' spreads apart: the machine's speed changed between the runs
    (load, clock, another machine), so their milliseconds do not compare; their speed-ups (each timed against
    its own reference, in turn) still do."""
    notes = []
    for metric in dict.fromkeys(m for v in values for m in v if m.endswith("original_ms")):
        base, spread = values[0].get(metric), spreads[0].get(metric)
        for column, v, timed, model in zip(columns[1:], values[1:], spreads[1:], models[1:]):
            other = timed.get(metric)
            if None in (base, v.get(metric), spread, other, model) or model != models[0] or not (other[1] < spread[0] or other[0] > spread[1]):
                continue
            notes.append(f"the same original model timed {base:.3g} ms in {columns[0]} and {v[metric]:.3g} ms in "
                         f"{column}, beyond both runs' timing spreads: the machine's speed changed between the runs, "
                         "so their milliseconds do not compare; their speed-ups (each against its own reference) do")
    return notes


def _higher(metric: str) -> bool:
    """higher_is_better, the share of multiply-adds run in int8 (more is the point of quantizing) and the user's
    metric (a lower-is-better one is told apart by its record's direction, in compare)."""
    return metric.endswith(("int8_macs", "evaluation.metric")) or higher_is_better(metric)


def _threshold(metric: str, fail_on: dict[str, float]) -> float | None:
    """`cosine_mean=0.01` applies to every output's cosine_mean; `logits.cosine_mean=…` to one."""
    if metric in fail_on:
        return fail_on[metric]
    return fail_on.get(metric.rsplit(".", 1)[-1])


def _single(path: str, report: dict) -> dict:
    if not report.get("evaluation"):
        raise QprepError(f"compare: {path} has no evaluation section; add `evaluation:` to its config to compare "
                         "the result with its FP32 reference")
    flat, reference_accuracy, latency_ms, size_bytes = read_metrics(path, "report", report, _single_values)
    facts = read_metrics(path, "report", report, lambda data: facts_of("report", data))
    reference = {"judged on": facts["judged on"],  # the reference ran on the same samples
                 "deployed model": f"{report['evaluation'].get('reference_model', '?')} (FP32 reference)"}
    rows = [{"metric": name, "base": reference.get(name), "others": [{"value": value, "delta": None, "worse": False}]}
            for name, value in facts.items()]
    nodes = (report.get("model") or {}).get("nodes")
    if flat.get("result.nodes") is not None and isinstance(nodes, int):
        rows.append({"metric": "result.nodes", "base": nodes, "others": [
            {"value": flat["result.nodes"], "delta": flat["result.nodes"] - nodes, "worse": False}]})
    for name, value in flat.items():
        metric = name.rsplit(".", 1)[-1]
        if metric in OUTPUT_METRICS:
            base = reference_accuracy.get(name) if metric == "top1_accuracy" else reference_score(metric)
            delta = None if value is None or base is None or not math.isfinite(base) else value - base
            rows.append({"metric": name, "base": base, "others": [{"value": value, "delta": delta, "worse": False}]})
    figures = user_metric(report["evaluation"])
    if figures and figures.get("metric") is not None:  # the user's metric: FP32's figure against the result's
        base = figures.get("reference_metric")
        rows.append({"metric": f"evaluation.metric ({figures.get('function', '?')})", "base": base, "others": [
            {"value": figures["metric"], "delta": None if base is None else figures["metric"] - base, "worse": False}]})
    for name, pair, scale in (*latency_ms, ("size.MB", size_bytes, 1e6)):
        if pair and None not in pair:
            reference, result = (v / scale for v in pair)
            rows.append({"metric": name, "base": reference,
                         "others": [{"value": result, "delta": result - reference, "worse": False}]})
    return {"columns": ["FP32 reference", f"result ({path})"], "rows": rows, "regressions": [], "notes": []}


def reference_score(metric: str) -> float:
    """What the FP32 reference scores against itself: no error (0) for lower-is-better metrics (max_abs, mse),
    infinite SQNR, full similarity and agreement (1). Accuracy against ground truth is not one of these: the
    reference's own accuracy is measured (`reference_top1_accuracy`)."""
    if metric in ("sqnr_db", "mean_sqnr_db"):
        return float("inf")
    return 1.0 if higher_is_better(metric) else 0.0


def _single_values(report: dict) -> tuple[dict, dict, list, tuple | None]:
    """What one run shows: its metrics, the reference's measured top-1 accuracy per output, the median latency
    rows (name, (reference, result or optimized float), 1) and (reference, result) size when measured."""
    evaluation = report["evaluation"]
    reference_accuracy = {f"{output}.top1_accuracy": _number(values.get("reference_top1_accuracy"), output)
                          for output, values in judged_outputs(evaluation).items()}
    latency = evaluation.get("latency") or {}
    sizes = evaluation.get("size_bytes") or {}
    latency_ms = [(name, tuple(_number(timed[side]["median_ms"], f"latency.{side}.median_ms")
                               for side in ("reference", label)), 1)
                  for name, timed, label in (("latency.median_ms", latency, "result"),
                                             ("latency.optimized_float_ms", latency, "optimized"),
                                             ("latency.optimized_float_ms (ORT_ENABLE_BASIC)",
                                              latency.get("basic") or {}, "optimized"))
                  if "median_ms" in (timed.get(label) or {}) and "median_ms" in (timed.get("reference") or {})]
    size_bytes = tuple(_number(sizes[side], f"size_bytes.{side}") for side in ("reference", "result")) if sizes else None
    return metrics_of("report", report), reference_accuracy, latency_ms, size_bytes


def _fmt(value) -> str:
    if value is None:
        return "–"
    if isinstance(value, str):  # a fact row: status, verdict, the deciding figure, backend, deployed model
        return value
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
    table = [[cell.replace("`", "") for cell in r] for r in table]  # the terminal: Markdown's code marks go
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)) for r in table]
    for reg in result["regressions"]:
        lines.append(f"REGRESSION {reg['metric']} in {reg['run']}: {_fmt(reg['base'])} → {_fmt(reg['value'])} "
                     f"(Δ {reg['delta']:+.4g}, allowed {reg['threshold']})")
    lines += [f"note: {note}" for note in result.get("notes", [])]
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
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    lines += [f"\nNote: {note}" for note in result.get("notes", [])]
    return "\n".join(lines) + "\n"


def _html(value) -> str:
    """A cell as HTML: Markdown's code marks (the deciding figure's) go, the rest is escaped."""
    return escape(_fmt(value).replace("`", ""))


def render_html(result: dict) -> str:
    header = ["metric", result["columns"][0]] + [f"{c} (Δ)" for c in result["columns"][1:]]
    rows = []
    for row in result["rows"]:
        cells = [f"<td>{escape(row['metric'])}</td><td>{_html(row['base'])}</td>"]
        for cell in row["others"]:
            delta = "" if cell["delta"] is None else f" ({cell['delta']:+.4g})"
            colour = " style='background:#f8d7da'" if cell["worse"] else ""
            cells.append(f"<td{colour}>{_html(cell['value'])}{delta}</td>")
        rows.append("<tr>" + "".join(cells) + "</tr>")
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    return ("<!doctype html><html><head><meta charset='utf-8'><title>qprep compare</title><style>table{border-collapse:"
            "collapse}td,th{border:1px solid #ccc;padding:3px 8px;font:13px system-ui}</style></head><body>"
            f"<h1>qprep compare</h1><table><tr>{head}</tr>{''.join(rows)}</table>"
            + "".join(f"<p>Note: {escape(note)}</p>" for note in result.get("notes", [])) + "</body></html>\n")
