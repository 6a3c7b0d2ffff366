"""The line a report opens with: is the result good enough (met / missed / not measured), by which figure, on
which samples; then the task figure a user reads per output (agreement, accuracy), before any table.

Why: "status: ok" next to "cosine 0.97258" says the run finished, not whether the result is usable. The
verdict holds the result to the gate (evaluation.gate and quantize.fallback's target) or, with no gate, to
the accuracy floor (evaluation.floor, which only catches a collapse), on the set the gate judged: the
held-out samples when evaluation.heldout is set. The figure named is the one that decided: the worst miss,
or when every check passed the one closest to its threshold.

A met verdict also says what it cost: the share of multiply-adds on integers and the speed against FP32, since
a gate can be met by leaving most of a model float at no gain in speed; under `evaluation.min_integer_share` the
verdict reads "met, but mostly float". A speed whose timing rounds disagreed (latency's `unstable`) says so
with its range: one ratio would read as steady. A figure that was not measured (an
fp16 result, a compiled .rknn, latency off) is said to be, never guessed.
"""

from __future__ import annotations

from dataclasses import dataclass

MET, MISSED, NOT_MEASURED = "met", "missed", "not measured"
NEAR_TIE = 0.9  # a changed top-1 whose FP32 top two are nearer than on 90% of the rows is a near tie
INTERVAL_NOTE = ("95% intervals count samples, not steps or pixels: each sample's share of agreeing rows, steps "
                 "or elements is one observation (Wilson interval, n = samples).")


@dataclass
class Verdict:
    state: str  # MET, MISSED or NOT_MEASURED
    text: str  # Markdown inline: what the result was held to, the deciding figure, the samples
    cost: str = ""  # a met result's integer share and speed against FP32 (cost_text)
    mostly_float: bool = False  # met under evaluation.min_integer_share: a warning, not a pass to cheer


def verdict(report: dict) -> Verdict:
    evaluation = report.get("evaluation") or {}
    status = report.get("status")
    if status == "running":  # report.json as a stage began: the run was killed, or still goes on
        return Verdict(NOT_MEASURED, "the run did not finish (killed, or still running)")
    if status in ("failed", "interrupted"):
        return Verdict(NOT_MEASURED, f"the run {status}" + (f": {report['error']}" if report.get("error") else ""))
    if not evaluation:
        return Verdict(NOT_MEASURED, "the config has no `evaluation:` section, so nothing compared the result with "
                                     "the float model; add one (evaluation samples and a gate) to get a verdict")
    gate = evaluation.get("gate")
    if not gate:
        return Verdict(NOT_MEASURED, "no gate is set and the floor is off (`evaluation.floor: none`): set "
                                     "`evaluation.gate` (e.g. `cosine_mean: 0.99`) to have the result judged")
    if not gate.get("checks"):
        return Verdict(NOT_MEASURED, f"no output reports a metric of the {_against(gate)} "
                                     f"({sample_set(evaluation)})")
    check = deciding_check(gate["checks"])
    state = MET if gate["passed"] else MISSED
    hint = ("; the floor only catches a collapse: set `evaluation.gate` to your own bar"
            if gate.get("source") == "floor" and state == MET else "")
    step = next_step(report) if state == MISSED else ""
    text = f"{_against(gate)}: {check_text(check)}, on {sample_set(evaluation)}"
    if state == MISSED:
        return Verdict(state, text + hint + (f"; {step}" if step else ""))
    cost, floor = cost_text(report), mostly_float(report)
    if floor is not None:
        return Verdict(state, f"but mostly float ({cost}; under `evaluation.min_integer_share` {floor:.0%}): "
                              f"{text}{hint}", cost, True)
    return Verdict(state, f"{text}; cost: {cost}{hint}", cost)


def cost_text(report: dict) -> str:
    """'97% of the multiply-adds on integers, 1.80× FP32': what the result buys, each figure or why it is
    missing."""
    return f"{_share_text(report)}, {_speed_text(report)}"


def mostly_float(report: dict) -> float | None:
    """The floor (evaluation.min_integer_share, as the run resolved it) when the result's integer share is
    under it, else None. Only a measured share counts: a float or fp16 result never set out to be integer."""
    floor = (report.get("evaluation") or {}).get("min_integer_share")
    share = (report.get("result") or {}).get("integer_share")
    return floor if floor is not None and share is not None and share < floor else None


def _share_text(report: dict) -> str:
    result = report.get("result") or {}
    if result.get("integer_share") is not None:
        return f"{result['integer_share']:.0%} of the multiply-adds on integers"
    quantize = next((s for s in report.get("stages", []) if s.get("name") == "quantize"), None)
    if quantize is not None and quantize.get("backend") == "fp16":
        return "an fp16 result (no integer multiply-adds)"
    if result.get("deployable"):
        return f"integer share of `{result['deployable']['path']}` not measured (the toolkit's own graph)"
    if result.get("kind") == "float" and (quantize is None or quantize.get("status") != "ok"):
        return "a float result (nothing quantized)"
    if quantize is None:
        return "integer share not measured (the input model came quantized)"
    return "integer share not measured (no Conv, MatMul or Gemm of known shape)"


def _speed_text(report: dict) -> str:
    evaluation = report.get("evaluation") or {}
    latency = evaluation.get("latency")
    float_reference = (report.get("model") or {}).get("kind") == "float" or "reference_model" in report
    if latency and latency.get("speedup") is not None:
        text = f"{latency['speedup']:.2f}× " + ("FP32" if float_reference else "the input model's speed")
        rounds = latency.get("speedup_rounds")
        if latency.get("unstable"):  # the report's note says why; the cost line must not read as a steady figure
            text += (f", unsteady: {min(rounds):.2f}×–{max(rounds):.2f}× across timing rounds" if rounds
                     else ", unsteady across timing rounds")
        return text
    if latency is None:
        return "speed not measured (`evaluation.latency.runs: 0`)"
    if latency.get("status", "").startswith("not measured"):
        return "speed not measured off the board"
    return "speed not measured"


def closing_line(report: dict) -> str | None:
    """A met run's verdict as the terminal's closing line, plain text ("warning: met, but mostly float ..."
    under the floor); None otherwise: a missed gate has its own lines."""
    gate = (report.get("evaluation") or {}).get("gate") or {}
    if report.get("status") != "ok" or not gate.get("passed"):
        return None
    found = verdict(report)
    if found.state != MET:
        return None
    return f"{'warning: met, ' if found.mostly_float else 'met: '}{found.text.replace('`', '')}"


def missed_text(evaluation: dict) -> str:
    """The terminal's account of a missed gate: each missed check with what its threshold needs and, as the
    report says them, "too few to decide" and how many of the changed top-1s were FP32's near ties (a miss by
    a near-tie flip or two says little about the quantization)."""
    gate = evaluation.get("gate") or {}
    missed = [c for c in gate.get("checks", []) if not c["passed"]]
    parts = []
    for c in missed:
        value = "n/a" if c["value"] is None else f"{c['value']:.4g}"
        undecided = f"; too few to decide: {c['undecided']}" if c.get("undecided") else ""
        parts.append(f"{c['metric']} {value} (needs {'<=' if c.get('kind') == 'maximum' else '>='} "
                     f"{c['threshold']:.4g}{undecided})")
    if any(c["metric"].endswith("_agreement") for c in missed):
        parts += tie_notes(evaluation)
    return "; ".join(parts)


def tie_notes(evaluation: dict) -> list[str]:
    """'top-1 of probabilities changed on 1 of 80 held-out samples, 1 among FP32's 10% nearest ties', per output
    of the judged set whose top-1 changed."""
    split, _, outputs = judged_set(evaluation)
    notes = []
    for name, m in outputs.items():
        changed = m.get("top1_changed") or []
        if changed:
            near = sum(c["closer_than"] >= NEAR_TIE for c in changed)
            notes.append(f"top-1 of {name} changed on {len(changed)} of {m.get('samples', '?')} {split} samples, "
                         f"{near} among FP32's {100 * (1 - NEAR_TIE):.0f}% nearest ties")
    return notes


def next_step(report: dict) -> str:
    """What to do about a missed gate or floor when the quantize stage ran without the fallback: let it search
    the layers to keep float, aiming at the gate as configured (the floor's collapse: at cosine 0.99).
    A model that misses the floor all int8 can meet the gate with a few tensors kept float (BENCHMARKS.md, the
    zoo: resemblyzer_encoder on RKNN). Empty when the fallback ran, nothing was quantized, or the backend has
    nothing to search (fp16)."""
    quantize = next((s for s in report.get("stages", []) if s.get("name") == "quantize"), None)
    if (quantize is None or quantize.get("status") != "ok" or quantize.get("fallback")
            or quantize.get("backend") == "fp16"):
        return ""
    gate = (report.get("evaluation") or {}).get("gate") or {}
    target = {"cosine_mean": 0.99} if gate.get("source") == "floor" else gate.get("target") or {"cosine_mean": 0.99}
    if len(target) == 1:
        (key, value), = target.items()
        setting = f"--set pipeline.quantize.fallback.target.{key}={value:g}"
    else:
        setting = ("--set 'pipeline.quantize.fallback.target={"
                   + ", ".join(f"{key}: {value:g}" for key, value in target.items()) + "}'")
    return (f"to have qprep search which layers to keep float, run again with `{setting}` (or `fallback:` under "
            "the quantize stage in the config)")


def deciding_check(checks: list[dict]) -> dict:
    """The check that decided the verdict: the worst miss (an unmeasured figure first), else the passed check
    with the smallest margin relative to its threshold."""
    return min(checks, key=lambda c: (c["passed"], _margin(c)))


def _margin(check: dict) -> float:
    if check["value"] is None or check["value"] != check["value"]:  # not measured, NaN
        return float("-inf")
    over = check["value"] - check["threshold"]
    if check.get("kind") == "maximum":
        over = -over
    return over / max(abs(check["threshold"]), 1e-12)


def check_text(check: dict) -> str:
    """'`metric` of `output` value ≥ threshold' (and the cosine key it stands for)."""
    output, _, metric = check["metric"].rpartition(".")
    output = output or check.get("worst_output")
    value = "not measured" if check["value"] is None else distinct(check["value"], check["threshold"])
    maximum = check.get("kind") == "maximum"
    holds = check["value"] is not None and (check["value"] <= check["threshold"] if maximum
                                            else check["value"] >= check["threshold"])
    sign = ("≤" if maximum else "≥") if holds else (">" if maximum else "<")
    if check["value"] is None:
        sign = "needs ≤" if maximum else "needs ≥"
    stands = f" (for {check['stands_for']})" if check.get("stands_for") else ""
    where = f" of `{output}`" if output else ""
    undecided = f" (too few to decide: {check['undecided']})" if check.get("undecided") else ""
    # a value that holds but a check that missed: some outputs were not measured (the reason says so)
    reason = f", but {check['reason']}" if check.get("reason") and check["value"] is not None else ""
    return f"`{metric}`{where} {value} {sign} {check['threshold']:.4g}{stands}{undecided}{reason}"


def distinct(value: float, threshold: float) -> str:
    """`value` with enough digits that it does not read as the threshold (0.99996 against 1: not "1")."""
    for digits in range(4, 10):
        text = f"{value:.{digits}g}"
        if value == threshold or text != f"{threshold:.{digits}g}":
            return text
    return text


def _against(gate: dict) -> str:
    return "accuracy floor (no gate set)" if gate.get("source") == "floor" else "gate"


def judged_set(evaluation: dict) -> tuple[str, dict, dict]:
    """('held-out' or 'evaluation', that set's samples record, its outputs): the set the verdict speaks for,
    held-out when measured (evaluate.py judges the gate on it then). Every view that shows a deciding figure —
    the verdict, compare, batch summaries, `qprep evaluate`, the report's worst samples — reads the set here."""
    heldout = evaluation.get("heldout") or {}
    if heldout.get("outputs"):
        return "held-out", heldout.get("samples") or {}, heldout["outputs"]
    return "evaluation", evaluation.get("samples") or {}, evaluation.get("outputs") or {}


def sample_set(evaluation: dict) -> str:
    """'128 held-out samples (`path`)': the set the gate judged."""
    split, samples, _ = judged_set(evaluation)
    return f"{samples.get('count', '?')} {split} samples (`{samples.get('source', '?')}`)"


def judged_outputs(evaluation: dict) -> dict:
    """The outputs of the set the verdict speaks for (judged_set)."""
    return judged_set(evaluation)[2]


def decided_by(evaluation: dict | None, split: str | None = None) -> dict | None:
    """The figure that decided the verdict (deciding_check over the gate's checks) and the samples it was
    measured on, as compare, batch summaries and `qprep evaluate` show it: one derivation, so none of them shows
    another figure than the verdict's. `split` names the set when the caller knows it better (`evaluate
    --samples DIR`). None when nothing was judged (no evaluation, no gate, no check)."""
    gate = (evaluation or {}).get("gate") or {}
    if not gate.get("checks"):
        return None
    check = deciding_check(gate["checks"])
    name, samples, _ = judged_set(evaluation)
    count = samples.get("count")
    where = f"{split or name}, {count if count is not None else '?'} samples"
    against = "floor" if gate.get("source") == "floor" else "gate"
    return {"metric": check["metric"], "value": check["value"], "threshold": check["threshold"],
            "passed": bool(gate["passed"]), "against": against, "split": split or name, "samples": count,
            "source": samples.get("source"), "text": f"{against}: {check_text(check)} ({where})"}


def task_lines(evaluation: dict | None) -> list[str]:
    """Per output, the figure a user of the task reads: agreement of the decisions the output drives (top-1
    and top-5 class, per-step symbol, decision at the threshold, ids, boxes), accuracy against labels, and
    for plain tensors their similarity."""
    if not evaluation:
        return []
    return [f"`{name}` ({m.get('kind', 'tensor')}): {task_text(m)}" for name, m in judged_outputs(evaluation).items()]


def task_text(m: dict) -> str:
    if m.get("not_measured"):
        return f"not measured ({m['not_measured']})"
    kind = m.get("kind", "tensor")
    parts = [agreement_text(m, prefix) for prefix in ("top1", "top5", "text", "step", "decision", "element")
             if f"{prefix}_agreement" in m and not (kind == "binary" and prefix == "top1")]  # its decision says it
    if "char_error_rate" in m:
        parts.insert(1, f"character error rate {_pct(m['char_error_rate'])}")
    if "top1_accuracy" in m:
        parts.append(f"accuracy against labels: FP32 {100 * m['reference_top1_accuracy']:.1f}% → result "
                     f"{100 * m['top1_accuracy']:.1f}% ({m['labelled_samples']} labelled)")
    if kind == "boxes":
        parts.append(f"boxes matched {_pct(m.get('match_rate'))}, mean IoU {num(m.get('mean_iou'), '.3f')}"
                     + (f"; float detections found {_pct(m['detections_found'])}, extra "
                        f"{_pct(m.get('detections_extra'))}" if "detections_found" in m else ""))
    elif kind == "ranked_ids":
        parts.append(f"same ids {_pct(m.get('set_agreement'))}")
    elif kind in ("state", "scalar", "regression", "ranked"):
        parts.append(f"relative error {num(m.get('rel_error'), '.3g')}")
    elif kind in ("probability", "binary") and m.get("mean_abs_error") is not None:
        of = f" of class {m.get('positive_class', 1)}'s probability" if kind == "binary" else ""
        parts.append(f"mean abs error {m['mean_abs_error']:.3g}{of}"
                     + (f" (largest {m['max_abs']:.3g})" if m.get("max_abs") is not None else ""))
    if kind in ("classification", "sequence", "tensor") or not parts:
        parts.append(f"cosine {num(m.get('cosine_mean'), '.4f')} (worst sample {num(m.get('cosine_min'), '.4f')})"
                     + (f", SQNR {m['sqnr_db']:.1f} dB" if m.get("sqnr_db") is not None else ""))
    if "with_padding" in m:  # measure/padding.py: judged on real positions; the whole-tensor figure beside it
        parts[-1] += " on the real positions; with the padding rows " + ", ".join(
            f"{metric} {value:.4f}" for metric, value in m["with_padding"].items())
    return "; ".join(parts)


def agreement_text(m: dict, prefix: str) -> str:
    """'top1 agreement 98.4% (95% CI 95.1–99.5%, n=128)'."""
    if m.get(f"{prefix}_agreement") is None:
        return f"{prefix} agreement not measured"
    low, high = m[f"{prefix}_agreement_ci95"]
    threshold = f" at {m['decision_threshold']:g}" if prefix == "decision" and "decision_threshold" in m else ""
    return (f"{prefix} agreement{threshold} {100 * m[f'{prefix}_agreement']:.1f}% (95% CI {100 * low:.1f}–"
            f"{100 * high:.1f}%, n={m[f'{prefix}_count']})")


def num(value, spec: str, missing: str = "–") -> str:
    return missing if value is None else format(value, spec)


def _pct(value) -> str:
    return "–" if value is None else f"{100 * value:.1f}%"
