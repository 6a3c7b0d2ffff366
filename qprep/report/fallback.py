"""The accuracy-driven fallback as people read it: the verdict, the nodes kept float and why, every trial.

One table model (header + rows of plain text) rendered by report.md and report.html alike.
"""

from __future__ import annotations

from qprep.measure.metrics import higher_is_better
from qprep.measure.user_metric import KEYS

_KEPT = {"float": "float", "int16": "at 16 bits", "float16": "float16"}  # what the spread phase did (spread_tensors.as)


def _minimum(key: str, record: dict) -> bool:
    """Whether a target key is a minimum: the user's `metric` when higher is better (its direction is recorded
    with the search), `metric_drop` never, a report metric by its kind."""
    if key in KEYS:
        return key == "metric" and record.get("metric_direction", "higher") == "higher"
    return higher_is_better(key)


def fallback_tables(stage: dict, float_count: int | None = None) -> tuple[str, list[tuple[str, list[str],
                                                                                        list[list[str]]]]] | None:
    """(verdict line, [(title, header, rows)]) for a stage that ran the fallback, else None. `float_count`: the
    result's float nodes (report/float_nodes.py), said beside the ones the search chose."""
    record = stage.get("fallback")
    if not record:
        return None
    target = ", ".join(f"{k} {'≥' if _minimum(k, record) else '≤'} {v}" for k, v in record["target"].items())
    best, base = _numbers(record["best"]["metrics"]), _numbers(record["base"]["metrics"])
    chosen = len(record["float_nodes"])
    nodes = (f"{chosen} float node(s)" if float_count is None else
             f"{float_count} float node(s) in the result ({chosen} chosen by the search)")
    verdict = (f"Target {target}: **{'met' if record['passed'] else 'missed'}** with {nodes} — {best} (all quantized: {base}); {record['stopped']}, {record.get('rounds', 1)} round(s), "
               f"{record['rank_trials']} ranking trials on {record['ranked']} of {record['candidates']} candidates, "
               f"{record['seconds']:.0f} s.")
    split = record.get("samples") or {}
    unseen = record["best"].get("unseen")
    if split.get("kept_apart"):
        verdict += (f" Chosen on {split['chosen_on']} evaluation samples, accepted on {split['kept_apart']} others"
                    + (f" ({_numbers(unseen['metrics'])}{_margin(unseen)}: {'held' if unseen['passed'] else 'missed'})."
                       if unseen else " (never reached: the target was not met on the first)."))
    if any(key.endswith("_agreement") for key in record["target"]):
        verdict += (f" An agreement counts as met with one standard error to spare on the {split.get('chosen_on')} "
                    "samples chosen on: the search stops at the first float set that meets it, and one flip more "
                    "on the next samples would miss it.")
    spread = record.get("spread_tensors") or {}
    if len(spread.get("scores", {})) > 1:
        verdict += (f" Tensors whose channels spread too far for one int8 scale, kept "
                    f"{_KEPT.get(spread.get('as'), 'out of int8')} first: {spread['chosen']} kept ("
                    + ", ".join(f"{a} {v:.5f}" for a, v in spread["scores"].items()) + ").")
    if spread.get("over_max_float_nodes"):
        verdict += (f" Not tried, over max_float_nodes: {', '.join(spread['over_max_float_nodes'])} (they would "
                    "take more nodes out of int8 than the cap; raise it to let the search try them).")
    op_types = record.get("float_op_types") or {}
    if op_types.get("chosen"):
        verdict += (f" Op types left float first (re-rounding without compute): {', '.join(op_types['chosen'])} "
                    f"({op_types['nodes']} nodes).")
    for key, when in (("ranges", "measured first"), ("ranges_with_spread", "measured after them"),
                      ("weight_rounding", "measured after the ranges"),
                      ("ranges_after_search", "measured after the search")):
        ranges = record.get(key) or {}
        if len(ranges.get("scores", {})) > 1:
            verdict += (f" {ranges['setting']} {when}: {ranges['chosen']} kept ("
                        + ", ".join(f"{a} {v:.5f}" for a, v in ranges["scores"].items()) + ").")
    if record.get("why"):
        verdict += f" {record['why']}."
    tables = []
    if record["float_nodes"]:
        tables.append(("Kept float by the fallback", ["node", "op", "gain when ranked (its round)", "kept float for"],
                       [[n["node"], n["what"], "–" if n["gain"] is None else f"{n['gain']:+.5f}",
                         n.get("via") or "itself"] for n in record["float_nodes"]]))
    trials = [t for t in record["trials"] if t["phase"] == "promote"]
    if trials:
        tables.append(("Promotion trials (on the samples the search chooses on)",
                       ["added", "float nodes", "score", "metrics", "kept", "s"],
                       [[", ".join(t.get("added") or []), str(t["float_nodes"]), f"{t['score']:.5f}",
                         _numbers(t["metrics"]),
                         _kept(t), f"{t['seconds']:.1f}"] for t in trials]))
    ranking = record.get("ranking", [])[:15]
    if ranking:
        tables.append(("Most harmful nodes or edges (gain when kept float alone, first round)", ["candidate", "op", "gain"],
                       [[r["node"], r["what"], f"{r['gain']:+.5f}"] for r in ranking]))
    return verdict, tables


def _numbers(metrics: dict) -> str:
    return ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if isinstance(v, (int, float)))


def _kept(trial: dict) -> str:
    if trial["accepted"]:
        return "yes"
    if trial.get("margin"):  # met, but by less than its standard error (search.judge)
        return "no: met by less than its standard error (" + ", ".join(f"{k} ±{v:.4f}" for k, v in
                                                                     trial["margin"].items()) + ")"
    return "no"


def _margin(unseen: dict) -> str:
    """The standard error a cosine_mean on the samples kept apart had to spare (search.judge)."""
    errors = unseen.get("standard_error") or {}
    return f", with one standard error ({max(errors.values()):.5f}) to spare" if errors else ""
