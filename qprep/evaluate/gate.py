"""The accuracy gate: report metric names → thresholds; a miss makes the run exit 1 (after the report).

`cosine_mean: 0.99` applies to every output that has the metric (the worst one decides);
`<output name>.cosine_mean: 0.99` to one output. Similarities are minimums, errors maximums.
"""

from __future__ import annotations

import math

from qprep.evaluate.metrics import higher_is_better


def check_gate(gate: dict[str, float], outputs: dict[str, dict]) -> dict:
    checks = []
    for key, threshold in gate.items():
        output, _, metric = key.rpartition(".")
        targets = [output] if output else [name for name, m in outputs.items() if metric in m]
        if not targets or any(t not in outputs or metric not in outputs[t] for t in targets):
            checks.append({"metric": key, "threshold": threshold, "value": None, "passed": False,
                           "reason": f"no output reports '{metric}'"})
            continue
        values = [outputs[t][metric] for t in targets]
        minimum = higher_is_better(metric)
        value = min(values) if minimum else max(values)
        if any(math.isnan(v) for v in values):  # no sample to rate: min/max would skip a NaN, the gate must not
            value = float("nan")
        passed = value >= threshold if minimum else value <= threshold
        checks.append({"metric": key, "threshold": threshold, "value": value, "passed": passed,
                       "kind": "minimum" if minimum else "maximum"})
    return {"passed": all(c["passed"] for c in checks), "checks": checks}
