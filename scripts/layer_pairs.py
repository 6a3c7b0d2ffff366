"""Count a run's per-layer pairs for BENCHMARKS.md: tensors compared, how many red, how many left out and why.

    python3 scripts/layer_pairs.py RUN_DIR [RUN_DIR ...]

One markdown row per run directory, read from its report.json (`evaluation.layers`, `evaluation.layers_left_out`),
with the same colour bands the report's chart paints (qprep/report/layer_chart.py), so the table and the chart
cannot disagree on what "red" means.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qprep import jsonfile  # noqa: E402
from qprep.report.layer_chart import band, layer_error  # noqa: E402


def row(run_dir: Path) -> str:
    report = jsonfile.numbers(json.loads((run_dir / "report.json").read_text()))
    evaluation = report.get("evaluation") or {}
    layers = evaluation.get("layers") or []
    left_out = evaluation.get("layers_left_out") or {}
    red = sum(band(layer_error(layer)) == "red" for layer in layers)
    cosines = [m["cosine_mean"] for m in (evaluation.get("outputs") or {}).values()
               if isinstance(m, dict) and m.get("cosine_mean") is not None]
    output = "—" if not cosines else "NaN" if any(c != c for c in cosines) else f"{min(cosines):.5f}"
    why = ", ".join(f"{count}: {reason}" for reason, count in sorted(left_out.items(), key=lambda r: -r[1]))
    return (f"| {Path(report.get('model', {}).get('path', run_dir.name)).stem} | {output} | {len(layers)} / {red} "
            f"| {sum(left_out.values())}{f' ({why})' if why else ''} |")


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    print("| model | output cosine (worst output) | compared / red | left out |")
    print("|---|---|---|---|")
    for run_dir in argv:
        print(row(Path(run_dir)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
