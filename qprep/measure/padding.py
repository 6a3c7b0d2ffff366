"""Padding positions: an output's rows at the positions the attention mask marks as padding are not judged.

Why: a sequence model fed padded inputs (BERT with 14 real tokens of 128) computes an output row for every
position, and every consumer drops the padded rows (mean pooling weighted by the mask, the [CLS] row, token
labels of real tokens). Those rows are most of the tensor, so they decide a whole-tensor cosine, below what the
real rows and the pooled embedding score (BENCHMARKS.md: "padding rows not judged").
An output whose leading axes are the mask's [batch, sequence] is judged on the rows the mask marks real; the
evaluation also gives its figure with the padding rows (`with_padding`), and `evaluation.padding: none` judges
every position.

The mask is found by structure and values, never by name: a graph input holding only 0 and 1 on the samples
(at least one 0) that reaches a Softmax (or one written out: Exp then ReduceSum), or an attention op, through
elementwise and shape ops alone — the additive mask of an attention. Token type ids are 0/1 too, but reach the
attention through an embedding Gather and the MatMuls. Found automatically only where the reading is sure: the
Hugging Face convention (numbers, 1 = a real token, the first position real on every sample — a boolean
`key_padding_mask` marks padding with True), one such input (an encoder-decoder's two masks could trim an output by
the wrong one), and an output whose sequence axis is not declared with another symbol than the mask's. Elsewhere
every position is judged, or `evaluation.padding: <input>` names the mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx

from qprep.errors import ConfigError

# ops a mask passes through on its way to the scores: casts, reshapes, arithmetic, comparisons, selection
MASK_PATH = {"Cast", "CastLike", "Identity", "Unsqueeze", "Squeeze", "Reshape", "Flatten", "Expand", "Tile",
             "Slice", "Concat", "Transpose", "Sub", "Mul", "Add", "Div", "Neg", "Min", "Max", "Clip", "Where", "Not",
             "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "And", "Or"}
# ops that select from their first input (the mask indexed by positions, as transformers' exports do); a tensor
# read as their indices instead becomes rows of a table (token type ids into their embedding): not a mask path
SELECTS = {"Gather", "GatherElements", "GatherND"}
# what a mask is for: the scores' Softmax, or an attention op that takes the mask itself; a Softmax written out
# (jax2tf: ReduceMax, Sub, Exp, ReduceSum, Div) is an Exp whose output a ReduceSum reads
MASKED = {"Softmax", "LogSoftmax", "Attention", "MultiHeadAttention", "GroupQueryAttention"}
NONE = "none"  # evaluation.padding: judge every position


@dataclass(frozen=True)
class Padding:
    """The input whose zeros mark padding positions, and the outputs laid out along its [batch, sequence]."""

    input: str
    outputs: frozenset[str]

    def rows(self, output: str, reference: np.ndarray, result: np.ndarray, sample: dict) -> tuple:
        """(reference, result) of `output` on `sample` without their padding rows ([real positions, ...]); both
        whole when either's layout differs from the mask's (another shape: compared as the metrics compare it)."""
        real = np.asarray(sample[self.input]) != 0
        if output not in self.outputs or any(np.ndim(v) < 2 or np.shape(v)[:2] != real.shape
                                             for v in (reference, result)):
            return reference, result
        return reference[real], result[real]

    def real_share(self, samples: list[dict]) -> tuple[int, int]:
        """(real positions, all positions) over `samples`."""
        masks = [np.asarray(s[self.input]) != 0 for s in samples]
        return int(sum(m.sum() for m in masks)), int(sum(m.size for m in masks))


def find(model: onnx.ModelProto, samples: list[dict], expected: list[dict], setting: str = "auto") -> Padding | None:
    """The padding of `model`'s outputs on `samples` (inputs) and `expected` (the reference's outputs):
    `setting` auto finds the mask input as the module doc says, `none` turns it off, an input's name names it
    (it must still hold 0/1 and match an output's leading axes)."""
    if setting == NONE or not samples:
        return None
    if setting != "auto":
        if setting not in samples[0]:
            raise ConfigError(f"evaluation.padding: '{setting}' is not an input of the model (inputs: "
                              f"{', '.join(samples[0])}); name the attention-mask input, or use auto or none")
        if not _zeros_and_ones(samples, setting):
            raise ConfigError(f"evaluation.padding: input '{setting}' is not [batch, sequence] with only 0 and 1 on "
                              "the evaluation samples: it is not a padding mask; use auto or none")
        if not _has_padding(samples, setting):
            return None  # no position to leave out on these samples
        candidates = [setting]
    else:
        candidates = [name for name in samples[0] if _zeros_and_ones(samples, name) and _has_padding(samples, name)
                      and _real_first(samples, name) and _reaches_masked(model, name)]
        if len(candidates) != 1:
            return None  # none, or several masks: which one an output follows is not read from the graph here
    for name in candidates:
        outputs = _laid_out(model, name, samples, expected)
        if outputs:
            return Padding(name, frozenset(outputs))
    if setting != "auto":
        raise ConfigError(f"evaluation.padding: no output has input '{setting}''s [batch, sequence] as its leading "
                          "axes; use auto or none")
    return None


def _zeros_and_ones(samples: list[dict], name: str) -> bool:
    """Rank 2 ([batch, sequence]), only 0 and 1 on every sample."""
    values = [np.asarray(s[name]) for s in samples]
    if any(v.ndim != 2 or v.dtype.kind not in "biuf" for v in values):
        return False
    return all(np.isin(v, (0, 1)).all() for v in values)


def _has_padding(samples: list[dict], name: str) -> bool:
    return any((np.asarray(s[name]) == 0).any() for s in samples)


def _real_first(samples: list[dict], name: str) -> bool:
    """The Hugging Face reading is sure: numbers (not a boolean key_padding_mask, where True is padding), 1 at the
    first position of every sample (right padding; a mask marking padding with 1 has 0 there)."""
    values = [np.asarray(s[name]) for s in samples]
    return all(v.dtype.kind != "b" and (v[:, 0] == 1).all() for v in values)


def _reaches_masked(model: onnx.ModelProto, name: str) -> bool:
    """Whether `name` reaches a Softmax or an attention op through MASK_PATH ops, or as the data SELECTS ops
    select from, only (the main graph)."""
    readers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for node in model.graph.node:
        for slot, tensor in enumerate(node.input):
            readers.setdefault(tensor, []).append((node, slot))
    seen, stack = set(), [name]
    while stack:
        for node, slot in readers.get(stack.pop(), ()):
            if node.op_type in MASKED or (node.op_type == "Exp" and any(
                    reader.op_type == "ReduceSum" for reader, _ in readers.get(node.output[0], ()))):
                return True
            passes = node.op_type in MASK_PATH or (node.op_type in SELECTS and slot == 0)
            if passes and id(node) not in seen:
                seen.add(id(node))
                stack.extend(node.output)
    return False


def _laid_out(model: onnx.ModelProto, mask: str, samples: list[dict], expected: list[dict]) -> list[str]:
    """Outputs whose leading axes are the mask's on every sample: rank ≥ 3 ([batch, sequence, features]), or
    rank 2 where the model declares the same symbolic sequence axis (a [batch, hidden] pooled output of a
    sequence as long as its hidden size is not taken for per-position scores)."""
    sequence = _dim_symbol(model.graph.input, mask)
    chosen = []
    for output in expected[0]:
        values = [np.asarray(e[output]) for e in expected]
        if not all(v.ndim >= 2 and v.shape[:2] == np.shape(s[mask]) for v, s in zip(values, samples)):
            continue
        symbol = _dim_symbol(model.graph.output, output)
        if sequence and symbol and symbol != sequence:
            continue  # declared along another sequence axis (a decoder's), the same length by chance
        if values[0].ndim >= 3 or (sequence and symbol == sequence):
            chosen.append(output)
    return chosen


def _dim_symbol(values, name: str) -> str | None:
    """The symbolic name of axis 1 of graph input/output `name`, if it has one."""
    for value in values:
        if value.name == name:
            dims = value.type.tensor_type.shape.dim
            return dims[1].dim_param or None if len(dims) >= 2 else None
    return None
