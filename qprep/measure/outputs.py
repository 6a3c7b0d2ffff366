"""The judged figures of each output over a sample set: the one comparison the evaluation, the fallback's trials
and `qprep evaluate` share, so every figure is computed the same way wherever it is read."""

from __future__ import annotations

from qprep.graph.verify import is_numeric
from qprep.measure.metrics import compare_output
from qprep.measure.padding import Padding


def output_metrics(expected: list[dict], actual: list[dict], kinds: dict[str, tuple[str, str]],
                   threshold: float = 0.5, padding: Padding | None = None, inputs: list[dict] | None = None) -> dict:
    """Per output of `kinds` (kinds.output_kinds, decided once on all evaluation samples, so the fallback's
    trials on fewer samples judge each output the same way): compare_output over the samples, and why.
    Outputs `padding` lays out along the attention mask are compared on the real positions of `inputs`."""
    outputs = {}
    for name, (kind, why) in kinds.items():
        values = [e[name] for e in expected]
        if not all(is_numeric(v) for v in values):
            continue  # strings, sequences, maps: no accuracy figure (evaluate() notes which)
        results = [a[name] for a in actual]
        if padding is not None and name in padding.outputs:
            pairs = [padding.rows(name, v, r, s) for v, r, s in zip(values, results, inputs)]
            values, results = [v for v, _ in pairs], [r for _, r in pairs]
            why += f"; judged on the positions '{padding.input}' marks real (padding rows are not used)"
        outputs[name] = {**compare_output(values, results, kind, threshold), "why": why}
    return outputs


def padding_included(expected: list[dict], actual: list[dict], kinds: dict[str, tuple[str, str]],
                     padding: Padding, inputs: list[dict], threshold: float) -> dict:
    """The judged figures of the outputs `padding` trims, over every position: what a whole-tensor comparison
    (another tool's, or `evaluation.padding: none`) reports, and how far the padding rows move it."""
    figures = {}
    for name in sorted(padding.outputs & set(kinds)):
        whole = compare_output([e[name] for e in expected], [a[name] for a in actual], kinds[name][0], threshold)
        figures[name] = {metric: whole[metric] for metric in whole["judged_by"] if whole[metric] is not None}
    real, every = padding.real_share(inputs)
    return {"input": padding.input, "real_positions": real, "positions": every, "outputs": figures}
