#!/usr/bin/env python3
"""Two report.json files, compared on what a change that should not touch results must leave as it was: the
status, each stage's record and the evaluation — with what depends on the clock or the machine left out
(seconds, latencies, speeds, budgets spent, paths, versions). Prints each difference (path: base → head).

Usage: python scripts/same_report.py BASE/report.json HEAD/report.json   (exit 1 when they differ)
"""

from __future__ import annotations

import json
import re
import sys

# Keys whose values are the clock's or the machine's, not the result's.
TIMED = re.compile(r"(^|_)(seconds|s|ms|elapsed|latency|speedup|speedups|speed|time|times|started|ended|budget"
                   r"|spent|run_dir|path|paths|pid|versions|command|run_id|threads|took)($|_)|^interval",
                   re.IGNORECASE)


# Figures in the report's sentences that are the clock's: a speed ratio (0.82×), a duration (12.3 s, 45 ms).
TIMED_FIGURE = re.compile(r"\d+(?:\.\d+)?\s*(?:×|ms\b|s\b)")


# same_outputs.sh writes the two runs to <work>/base/NAME and <work>/head/NAME: paths into them name their side.
SIDE = re.compile(r"/(?:base|head)/")


def pruned(value):
    if isinstance(value, str):
        return SIDE.sub("/<side>/", TIMED_FIGURE.sub("<timed>", value))
    if isinstance(value, dict):
        return {key: pruned(item) for key, item in value.items() if not TIMED.search(str(key))}
    if isinstance(value, list):
        return [pruned(item) for item in value]
    if isinstance(value, float):
        return round(value, 9)
    return value


def differences(base, head, where: str = "") -> list[str]:
    if isinstance(base, dict) and isinstance(head, dict):
        found = []
        for key in sorted(set(base) | set(head), key=str):
            if key not in head:
                found.append(f"{where}.{key}: only in base")
            elif key not in base:
                found.append(f"{where}.{key}: only in head")
            else:
                found += differences(base[key], head[key], f"{where}.{key}")
        return found
    if isinstance(base, list) and isinstance(head, list) and len(base) == len(head):
        return [d for i, (b, h) in enumerate(zip(base, head)) for d in differences(b, h, f"{where}[{i}]")]
    return [] if base == head else [f"{where}: {json.dumps(base)[:200]} → {json.dumps(head)[:200]}"]


def main(argv: list[str]) -> int:
    base, head = (json.load(open(path)) for path in argv[1:3])
    parts = ("status", "stages", "evaluation", "warnings")
    found = differences(pruned({k: base.get(k) for k in parts}), pruned({k: head.get(k) for k in parts}))
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
