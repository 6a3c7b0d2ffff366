"""Standard JSON in and out: the one encoder for every JSON file qprep writes and the one decoder for numbers
read back from them.

Why: Python's json writes `Infinity`/`NaN` for non-finite floats (an exact result's SQNR is infinite, an
agreement over zero samples is NaN), which strict parsers (JavaScript, jq, Go) reject. qprep writes them as
the strings "Infinity", "-Infinity" and "NaN" instead; readers turn those back into floats with `number`, or a
whole record read back (report.json, summary.json) with `numbers`: the views that read a record from disk (compare,
batch summaries, evaluate) then compute on it as the run did on the record in memory.
"""

from __future__ import annotations

import json
import math

NON_FINITE = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}


def dumps(data, indent: int | None = 2) -> str:
    """Standard JSON text (allow_nan=False proves it); arrays (numpy) become lists, sets sorted lists,
    anything else unknown its str()."""
    return json.dumps(_plain(data), indent=indent, allow_nan=False)


def _plain(value):
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, (str, int, bool)) or value is None:
        return value
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, (set, frozenset)):
        return [_plain(item) for item in sorted(value)]
    if hasattr(value, "tolist"):  # numpy arrays and scalars
        return _plain(value.tolist())
    return str(value)


def number(value):
    """A number as qprep wrote it: the strings "Infinity", "-Infinity", "NaN" become floats again; other
    values are returned as they are (the caller checks the type)."""
    if isinstance(value, str) and value in NON_FINITE:
        return NON_FINITE[value]
    return value


def numbers(data):
    """A record as qprep wrote it, with every value "Infinity", "-Infinity" or "NaN" a float again (keys and
    other strings as they are)."""
    if isinstance(data, dict):
        return {key: numbers(value) for key, value in data.items()}
    if isinstance(data, list):
        return [numbers(value) for value in data]
    return number(data)
