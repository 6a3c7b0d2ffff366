"""CTC text outputs (OCR recognizers): per-step class scores [N, T, C] read as text, as the recognizer's users
read them.

Why: per-step agreement counts the 40 steps of a text line, most of them blank, as if each mattered alone; a
user asks whether the line reads the same. Greedy CTC decoding (argmax per step, repeats collapsed, blank
dropped) turns both sides into symbol ids: `text_agreement` is the share of samples whose text is identical,
`char_error_rate` the edit distance to the reference's text over its length. An output is `ctc` when
`evaluation.tasks` names it so, or when it is a per-step Softmax whose class count is the model's character
dictionary (metadata `character`, as PaddleOCR/RapidOCR models carry it) plus the blank (and a space).
The dictionary spells the worst samples' texts in the report; without one they show as ids.
"""

from __future__ import annotations

import numpy as np
import onnx

BLANK = 0  # the CTC blank is class 0 (PaddleOCR, CRNN exports)
DICTIONARY_KEY = "character"


def dictionary(model: onnx.ModelProto) -> list[str] | None:
    """The model's character dictionary (metadata `character`, one symbol per line), or None."""
    for prop in model.metadata_props:
        if prop.key == DICTIONARY_KEY and prop.value:
            return prop.value.split("\n")
    return None


def fits(symbols: list[str] | None, classes: int) -> bool:
    """Blank + the symbols (+ a trailing space class, PaddleOCR's use_space_char) make the output's classes."""
    return symbols is not None and classes in (len(symbols) + 1, len(symbols) + 2)


def decode(scores: np.ndarray) -> tuple[tuple[int, ...], ...]:
    """Greedy CTC decoding of each row of [.., T, C] scores: per-step argmax, repeats collapsed, blank dropped."""
    rows = np.asarray(scores).reshape(-1, *np.shape(scores)[-2:]).argmax(-1)
    texts = []
    for steps in rows:
        keep = np.ones(len(steps), bool)
        keep[1:] = steps[1:] != steps[:-1]
        texts.append(tuple(int(s) for s in steps[keep] if s != BLANK))
    return tuple(texts)


def spell(ids: tuple[int, ...], symbols: list[str] | None) -> str:
    """Symbol ids as text: class i is symbols[i - 1], the class after the last symbol a space."""
    if symbols is None:
        return " ".join(f"#{i}" for i in ids)
    return "".join(symbols[i - 1] if i <= len(symbols) else " " for i in ids)


def edit_distance(a: tuple, b: tuple) -> int:
    """Levenshtein distance (insertions, deletions, substitutions)."""
    previous = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        current = [i]
        for j, y in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (x != y)))
        previous = current
    return previous[-1]


def text_metrics(reference: list[np.ndarray], result: list[np.ndarray]) -> dict:
    """Per sample: which of its rows read the same, and its character error rate against the reference;
    `texts`: both sides' decoded ids of each sample's first row, to show the worst samples."""
    texts = [(decode(a), decode(b)) for a, b in zip(reference, result)]
    same = [np.array([x == y for x, y in zip(ref, res)]) for ref, res in texts]
    edits = [sum(edit_distance(x, y) for x, y in zip(ref, res)) for ref, res in texts]
    lengths = [sum(len(x) for x in ref) for ref, _ in texts]
    rates = [e / max(n, 1) for e, n in zip(edits, lengths)]
    return {"same": same, "char_error_rate": sum(edits) / max(sum(lengths), 1), "per_sample_rates": rates,
            "texts": [(ref[0], res[0]) if ref else ((), ()) for ref, res in texts]}


def spell_worst(outputs: dict, symbols: list[str] | None) -> None:
    """The worst samples' decoded ids (evaluate.worst_samples) as the texts each side reads, in place."""
    for metrics in outputs.values():
        for row in metrics.get("worst_samples", []):
            if "reference_ids" in row:
                row["reference_text"] = spell(tuple(row.pop("reference_ids")), symbols)
                row["result_text"] = spell(tuple(row.pop("result_ids")), symbols)
