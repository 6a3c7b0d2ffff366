"""One RKNN build's quantization ranges reused by later hybrid builds (or only its weight ranges: model_file.py's
`weight_rounding: mmse`).

Why: with `mmse` the toolkit searches every weight and activation range again inside each hybrid step2
(minutes), while a `normal` step2 takes the ranges it is given (a second). So the fallback can pay for one mmse
build, then build trials with `normal` on that build's ranges: measured with rknn-toolkit2 2.5.0 on PP-OCRv4 rec,
a normal step2 on an mmse build's ranges scores as that build does, its table equal to the mmse one on every
int8 tensor (reusing the activation min/max alone scores lower: `ori_min`/`ori_max` quantize the int8
conversion after a float16 layer). But mmse's ranges depend on the float16 set: a normal step2 on the
all-int8 build's ranges scores well below the mmse build of the set it is given. So the fallback reuses ranges
only for the trials of its budget's last quarter (FAST_SHARE in qprep/quantize/search/rounds.py).

Toolkit internals this relies on (private, so checked: anything unexpected raises ValueError and the caller
keeps building the slow way):
- a built RKNN object's table: `rknn_base.quantizer.quant_tab`, {tensor: {qmethod, dtype, min, max, scale,
  zero_point, ori_min, ori_max}};
- step1's `<stem>.data` is a pickled dict: `quant_tab` (the same entries, which step2 follows and checks the cfg
  against: an edited scale or ori_min is refused) and the range algorithm (`quantizer.param.qalgorithm`,
  `args.quantized_algorithm`) step2 runs again;
- the cfg lists the activations' entries; step2 takes them from there.
"""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path

import numpy as np

from qprep.quantize.rknn.names import CFG_KEY

_FIELD = re.compile(r"^        (\w+):")  # one of its fields
_ITEM = re.compile(r"^        -   ")  # an item of the field's list
_FIELDS = ("min", "max", "scale", "zero_point", "ori_min", "ori_max")


def table_of(rknn) -> dict[str, dict]:
    """The quantization table of a built RKNN object: {tensor: {"qmethod", "dtype", "min", "max", ...}}."""
    try:
        table = {name: dict(entry) for name, entry in rknn.rknn_base.quantizer.quant_tab.items()}
        for entry in table.values():
            entry["qmethod"], entry["dtype"], entry["min"], entry["max"]  # noqa: B018 (the fields used below)
    except (AttributeError, KeyError, TypeError) as exc:
        raise ValueError(f"no quantization table on the RKNN object ({type(exc).__name__}: {exc})") from None
    return table


def apply(stem: Path, cfg_text: str, table: dict[str, dict]) -> tuple[str, dict]:
    """Step1's outputs (`<stem>.data`, the cfg text) rewritten so step2 builds with `table`'s ranges and searches
    nothing: its entries and the `normal` algorithm into the data file, the activations' entries into the cfg.
    A table of weights only (model_file.py's mmse weight ranges) leaves step1's activation ranges as they are; the
    toolkit derives each bias's scale again from its weight's and input's (measured).
    Only entries of the same kind are taken (a layer float16 in the table's build has no int8 grid). Returns
    the new cfg text (the caller adds its float16 layers) and counts for the record."""
    data_path = Path(f"{stem}.data")
    with open(data_path, "rb") as f:
        data = pickle.load(f)
    try:
        entries = data["quant_tab"]
        param, args = data["quantizer.param"], data["args"]
        param["qalgorithm"], args.quantized_algorithm = "normal", "normal"
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"unexpected step1 data file {data_path.name} ({type(exc).__name__}: {exc})") from None
    taken = [name for name, entry in entries.items() if _same_kind(entry, table.get(name))]
    for name in taken:
        entries[name] = table[name]
    cfg_text, activations = with_entries(cfg_text, {name: table[name] for name in taken})
    weights = sum(entries[name]["qmethod"] == "channel" for name in taken)
    wanted = any(entry.get("qmethod") == "layer" for entry in table.values())  # mmse weight ranges hold none
    if (wanted and not activations) or not weights:
        raise ValueError(f"the table matches {activations} activations and {weights} weights of step1's outputs")
    with open(data_path, "wb") as f:
        pickle.dump(data, f)
    return cfg_text, {"activations": activations, "weights": weights}


def _same_kind(entry: dict, source: dict | None) -> bool:
    return source is not None and all(source.get(k) == entry.get(k) for k in ("qmethod", "dtype"))


def with_entries(cfg_text: str, table: dict[str, dict]) -> tuple[str, int]:
    """The cfg with the listed values of its int8 layer-wise tensors taken from `table`; only those lines change
    (a YAML dumper would rewrite every number's text)."""
    head, sep, block = cfg_text.partition("\nquantize_parameters:\n")
    if not sep:
        raise ValueError("unexpected .quantization.cfg layout (no quantize_parameters)")
    out: list[str] = []
    tensor, field, index, changed = None, None, 0, set()
    for line in block.split("\n"):
        if key := CFG_KEY.match(line):
            tensor, field = key.group(1), None
        elif name := _FIELD.match(line):
            field, index = name.group(1), 0
        elif _ITEM.match(line) and field in _FIELDS:
            source = table.get(tensor, {})
            values = numbers(source.get(field, [])) if source.get("qmethod") == "layer" else []
            if index < len(values):
                number = values[index]
                line = f"        -   {int(number) if field == 'zero_point' else _yaml_float(number)}"
                changed.add(tensor)
            index += 1
        out.append(line)
    return head + sep + "\n".join(out), len(changed)


def numbers(value) -> list[float]:
    """The toolkit keeps lists either as lists or as their text."""
    return [float(v) for v in (json.loads(value) if isinstance(value, str) else value)]


def _yaml_float(value: float) -> str:
    """Positional with a decimal point, the shortest text that reads back as the same float (YAML 1.1 reads
    `1e-05` as a string)."""
    return np.format_float_positional(float(value), unique=True, trim="0")
