"""What each output is, read from the graph first, then from the reference's values: it decides which metrics
judge it.

Why: one metric for every output misleads. A one-element output always has cosine 1, whatever its error
(BENCHMARKS.md: "metrics per output kind"); a state output fed back at the next call drifts step after step,
which its relative error shows; rows that NMS or TopK chose reorder when a score moves; the top-1 "agreement" of
an LSTM's hidden state or of three independent regression scores means nothing. What produces an output says
what it is better than its shape does. The rules, first match wins (an `evaluation.tasks` entry names the kind
instead):

1. rows chosen by NonMaxSuppression or TopK (reached going up through ops that only move, select or
   rescale values): `boxes` (detections) when each row holds 4 to 7 numbers whose first four read as boxes on
   every sample and the rows are not TopK's own values (its values output, moved but not combined), else
   `ranked_ids` (integers) or `ranked` (rows.py compares them as sets);
2. integer or boolean values → `integer`;
3. `state`: a float output with the dtype and shape of a float graph input whose name pairs with it once
   the words that mark a state's direction are dropped (state/stateN, h0/hn, h_in/h_out, cache/new_cache,
   past_key_values.0.key/present.0.key), or an RNN/GRU/LSTM's last hidden or cell state (Y_h, Y_c), whatever
   its name;
4. `regression`: a small head (at most SMALL_HEAD values per sample) a Gemm/MatMul computes, reached through
   moves and affine ops only (no Softmax, Sigmoid, ArgMax or norm after it), unless its name says class scores
   (logits, class, label): rated by absolute and relative error;
5. `binary`: two-class probabilities [N, 2] (or [N, ..., 2], one decision per position) from a Softmax, each
   pair summing to 1: a decision on class 1 at `evaluation.decision_threshold`, rated as `probability` on
   class 1's probability (a cosine of 0.999 let one class's probability move by 0.144; cosine and top-1 are
   still shown, judging nothing);
6. `probability`: values in [0, 1] on every sample, and one element per sample (a single logit's Sigmoid) or
   a Sigmoid's output with at most one axis longer than 1 (a multi-label vector, per-frame probabilities; a
   2-D probability map keeps its cosine, which means something over many pixels);
7. `scalar`: one element per sample (any range) that no regression head computes; judged as `regression` is;
8. `classification` / `sequence` / `tensor` from the shape and producer (metrics.output_task; x / ‖x‖ written
   out counts as LpNormalization: an embedding); a `sequence` over the model's character dictionary plus a blank
   is `ctc` (ctc.py: decoded to text).
"""

from __future__ import annotations

import re

import numpy as np
import onnx

from qprep.errors import ConfigError
from qprep.graph.verify import is_numeric
from qprep.measure import ctc
from qprep.measure.metrics import is_integer, output_task
from qprep.measure.rows import box_like

ROW_SELECTORS = {"NonMaxSuppression", "TopK"}
# ops that only move or select values: going up through them keeps the same values (probability, TopK values)
MOVES = {"Identity", "Cast", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Transpose", "Slice", "Gather",
         "GatherElements", "GatherND", "Concat", "Split", "Expand", "Tile"}
# and ops that rescale or combine them elementwise: boxes decoded from rows NMS chose pass through these
ELEMENTWISE = {"Add", "Sub", "Mul", "Div", "Clip", "Max", "Min", "Where", "Sigmoid", "Exp", "Sqrt", "Relu",
               "Round", "Floor", "Ceil", "Abs", "Neg", "Not", "Greater", "Less", "Equal", "And", "Or"}
RNNS = {"RNN", "GRU", "LSTM"}  # outputs 1 and 2: Y_h, Y_c, the state the next call starts from
HEADS = {"Gemm", "MatMul"}
AFFINE = {"Add", "Sub", "Mul", "Div"}  # a head's bias and rescaling (MOS = 4·x + 1)
SMALL_HEAD = 4  # values per sample: a few scores (MOS, a box); an 8-wide linear output is as likely an embedding or
# logits, and the search climbs its cosine (the relative error floors its score once it is large)
CLASS_WORDS = {"logit", "logits", "class", "classes", "cls", "label", "labels", "category", "categories"}
DIRECTION_WORDS = {"in", "out", "input", "output", "inputs", "outputs", "new", "next", "prev", "previous", "old",
                   "past", "present", "cur", "current", "updated", "n", "i", "o"}


def output_kinds(model: onnx.ModelProto, expected: list[dict], tasks: dict) -> dict[str, tuple[str, str]]:
    """{output: (kind, why)} for the numeric outputs of `expected` (the reference's outputs per sample)."""
    producers = {o: n for n in model.graph.node for o in n.output}
    initializers = {t.name for t in model.graph.initializer}
    inputs = {i.name: i for i in model.graph.input if i.name not in initializers}
    kinds = {}
    symbols = ctc.dictionary(model)
    for name in expected[0]:
        values = [e[name] for e in expected]
        if not all(is_numeric(v) for v in values):
            continue  # strings, sequences, maps: not compared
        if name in tasks:
            width = min(np.asarray(v).shape[-1] if np.ndim(v) >= 2 else 1 for v in values)
            if tasks[name] == "boxes" and width < 4:
                raise ConfigError(f"evaluation.tasks.{name}: boxes needs rows of at least 4 numbers (the box, then "
                                  f"scores); this output's rows hold {width}: choose another kind")
            last = next((np.shape(v)[-1] if np.ndim(v) else 1 for v in values if np.shape(v)[-1:] != (2,)), 2)
            if tasks[name] == "binary" and last != 2:
                raise ConfigError(f"evaluation.tasks.{name}: binary needs two-class scores [..., 2] (the decision is "
                                  f"on class 1); this output's last axis holds {last}: choose probability for one "
                                  "value per decision, classification for more classes")
            kinds[name] = (tasks[name], "named in evaluation.tasks")
        else:
            kinds[name] = output_kind(name, values, producers, inputs)
            if kinds[name][0] == "sequence" and ctc.fits(symbols, values[0].shape[-1]):
                kinds[name] = ("ctc", f"per-step scores over the model's {len(symbols)}-symbol character dictionary "
                                      "(metadata `character`) and the CTC blank: decoded to text, rated by text "
                                      "agreement and character error rate")
    return kinds


def output_kind(name: str, values: list[np.ndarray], producers: dict, inputs: dict) -> tuple[str, str]:
    """(kind, why) of one output by the rules of the module doc."""
    integer = is_integer(values)
    selector = _reaches(name, producers, ROW_SELECTORS, MOVES | ELEMENTWISE)
    if selector is not None:
        return _rows_kind(name, values, producers, selector, integer)
    if integer:
        return "integer", "integer values (ids, labels, counts): rated by the share of equal elements"
    partner = state_input(name, values, inputs)
    if partner is not None:
        return "state", (f"a state: the next value of the input '{partner}' it pairs with by name (its dtype, its "
                         "shape or a cache one step longer); rated by relative error, which grows call after call "
                         "when the state is fed back")
    rnn = rnn_state(name, producers)
    if rnn is not None and values[0].dtype.kind == "f":
        return "state", (f"a state: {rnn}, which the next call starts from; rated by relative error, which grows "
                         "call after call when the state is fed back")
    head = regression_head(name, values, producers)
    if head is not None:
        return "regression", (f"{_per_sample(values)} value(s) per sample computed by {head.op_type} "
                              f"'{head.name}' with no Softmax, Sigmoid or ArgMax after it: a regression head, "
                              "rated by relative and absolute error (a top-1 of independent scores means nothing)")
    in_unit = all(v.size and np.all((v >= 0) & (v <= 1)) for v in values)
    softmax = _reaches(name, producers, {"Softmax"}, MOVES - {"Concat"}) if in_unit else None
    if softmax is not None and two_classes(values):
        return "binary", (f"two-class probabilities [..., 2] from Softmax '{softmax.name}': a decision on class 1 "
                          "at the threshold, rated by decision agreement and the absolute error of class 1's "
                          "probability (the cosine of a two-class Softmax stays near 1 while a class's probability "
                          "moves)")
    one = all(v.size == 1 for v in values)
    if in_unit and (one or (_reaches(name, producers, {"Sigmoid"}, MOVES) is not None
                            and max(sum(d > 1 for d in v.shape) for v in values) <= 1)):
        return "probability", ("one value in [0, 1] per sample" if one else "a Sigmoid's probabilities") + (
            ": rated by absolute error and decision agreement at the threshold; a cosine says nothing here")
    if one:
        return "scalar", ("one value per sample: rated by absolute error and by relative error over the samples "
                          "(the cosine of one element is always 1)")
    producer = producers.get(name)
    ending = "LpNormalization" if _divided_by_a_norm(producer, producers) else getattr(producer, "op_type", None)
    task = output_task(name, values[0].shape, ending)
    source = f" from a {ending}" if ending in ("Softmax", "LogSoftmax") else (
        f" ({_per_sample(values)} per sample, logits by their name)" if regression_head(
            name, values, producers, named=False) else "")
    return task, {"classification": f"class scores [N, C]{source}: cosine and top-1 agreement",
                  "sequence": "per-step scores [N, T, C] from a Softmax: cosine and per-step agreement",
                  "tensor": "a tensor of many values: cosine and SQNR"}[task]


def two_classes(values: list[np.ndarray]) -> bool:
    """Float pairs along the last axis that sum to 1 on every sample (rule 5): a two-class Softmax's output,
    not two columns sliced from a wider one."""
    return all(v.dtype.kind == "f" and v.ndim >= 1 and v.shape[-1] == 2 and v.size
               and np.allclose(v.sum(axis=-1), 1.0, atol=1e-3) for v in values)


def _rows_kind(name: str, values: list[np.ndarray], producers: dict, selector, integer: bool) -> tuple[str, str]:
    """Rows NMS or TopK chose: detections when they hold a box and its score/class (rule 1), else ranked values
    or ids. TopK's own values stay `ranked`; rows that combine them with boxes (a Concat) are detections."""
    own = _reaches(name, producers, ROW_SELECTORS, MOVES - {"Concat"})
    width = values[0].shape[-1] if values[0].ndim >= 2 else 1
    if not integer and 4 <= width <= 7 and not (own is not None and own.op_type == "TopK") and box_like(values):
        return "boxes", (f"detections: rows chosen by {selector.op_type} '{selector.name}' with {width} columns (a "
                         "box, then score/class): float and result rows matched by class and IoU ≥ 0.5, rated by "
                         "the share of float detections found and of extra ones")
    return ("ranked_ids" if integer else "ranked"), (
        f"rows chosen by {selector.op_type} '{selector.name}': their order moves with the scores, so they are "
        "compared as " + ("sets" if integer else "sorted values"))


def rnn_state(name: str, producers: dict) -> str | None:
    """"the Y_c (cell state) of LSTM 'lstm'" when `name` is an RNN/GRU/LSTM's Y_h or Y_c, moved only (Squeeze,
    Transpose...): the state the next call takes as initial_h / initial_c."""
    tensor = name
    while (node := producers.get(tensor)) is not None:
        if node.op_type in RNNS:
            index = list(node.output).index(tensor)
            what = ("", "Y_h (last hidden state)", "Y_c (cell state)")[index] if index < 3 else ""
            return f"the {what} of {node.op_type} '{node.name}'" if what else None
        if node.op_type not in MOVES or node.op_type == "Concat" or not node.input:
            return None
        tensor = node.input[0]
    return None


def regression_head(name: str, values: list[np.ndarray], producers: dict, named: bool = True):
    """The Gemm/MatMul computing `name` when it is a small regression head (rule 4), else None; with
    `named` False, also when its name says class scores."""
    if values[0].dtype.kind != "f" or _per_sample(values) > SMALL_HEAD or not all(v.size for v in values):
        return None
    if named and CLASS_WORDS & set(re.findall(r"[a-z]+", re.sub(r"([a-z])([A-Z])", r"\1 \2", name).lower())):
        return None
    if _divided_by_a_norm(producers.get(name), producers):
        return None
    return _reaches(name, producers, HEADS, MOVES | AFFINE)


def _per_sample(values: list[np.ndarray]) -> int:
    """The most values one sample's output holds (a leading batch axis of several samples divided out)."""
    return max(v.size // v.shape[0] if v.ndim >= 2 and v.shape[0] else v.size for v in values)


def state_input(output: str, values: list[np.ndarray], inputs: dict) -> str | None:
    """The float graph input this output is the next value of: same dtype and shape (symbolic dims match any
    size), and names equal once direction words and digits marking a step are dropped."""
    key = state_key(output)
    if not key or values[0].dtype.kind != "f":
        return None
    for name, info in inputs.items():
        if name == output:  # the input passed straight through: the same tensor, not its next value
            continue
        tensor = info.type.tensor_type
        if tensor.elem_type != onnx.helper.np_dtype_to_tensor_dtype(values[0].dtype) or state_key(name) != key:
            continue
        dims = [d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim]
        if all(len(dims) == v.ndim and _same_or_one_axis_longer(dims, v.shape) for v in values):
            return name
    return None


def _same_or_one_axis_longer(dims: list, shape: tuple) -> bool:
    """The input's shape (symbolic dims match any size), or longer on one axis only: a key/value cache comes out
    with this step's positions appended to the `past` it was given, and is fed back as the next call's past."""
    longer = [d is not None and s > d for d, s in zip(dims, shape)]
    return sum(longer) <= 1 and all(d is None or d == s or grew for d, s, grew in zip(dims, shape, longer))


def state_key(name: str) -> tuple[str, ...]:
    """A name without the words that mark a state's direction: state/stateN → (state,), h0/hn/h_out → (h,),
    past_key_values.0.key/present.0.key → (0, key). Empty for plain names (input/output never pair)."""
    spaced = re.sub(r"([a-z])([A-Z])", r"\1 \2", name).lower().replace("past_key_values", "past")
    tokens = re.findall(r"[a-z]+|\d+", spaced)
    if tokens and tokens[-1] == "0":  # h0, state_0: the initial value
        tokens = tokens[:-1]
    tokens = [t[0] if len(t) == 2 and t[1] in "no" and t not in DIRECTION_WORDS else t for t in tokens]  # hn, co
    return tuple(t for t in tokens if t not in DIRECTION_WORDS)


NORMS = {"ReduceL2", "LpNormalization"}  # ‖x‖
NORM_GUARDS = {"Clip", "Max", "Add", "Expand", "Unsqueeze", "Reshape", "Identity", "Cast"}  # eps, clamp, broadcast


def _divided_by_a_norm(node, producers: dict) -> bool:
    """x / ‖x‖ as exporters write a unit-length embedding (torch's `x / x.norm(dim=1, keepdim=True)`:
    Div by a ReduceL2; F.normalize: Div by Expand(Clip(ReduceL2)); Sqrt(ReduceSum(x·x))), which the
    LpNormalization op stands for: Resemblyzer's speaker embedding was judged as class scores. The norm must
    be the numerator's own: a cosine classifier's x·W / (‖x‖·‖W‖) stays class scores."""
    if node is None or node.op_type != "Div" or len(node.input) < 2:
        return False
    x = node.input[0]
    norm = _reaches(node.input[1], producers, NORMS | {"Sqrt"}, NORM_GUARDS)
    if norm is None:
        return False
    if norm.op_type != "Sqrt":
        return norm.input[0] == x
    total = _reaches(norm.input[0], producers, {"ReduceSum", "ReduceSumSquare"}, NORM_GUARDS)
    if total is None:
        return False
    if total.op_type == "ReduceSumSquare":
        return total.input[0] == x
    square = producers.get(total.input[0])
    return square is not None and ((square.op_type == "Mul" and list(square.input) == [x, x])
                                   or (square.op_type == "Pow" and square.input[0] == x))


def _reaches(tensor: str, producers: dict, targets: set[str], through: set[str]):
    """The first node of an op type in `targets` found going up from `tensor` through `through` ops only."""
    seen, stack = set(), [tensor]
    while stack:
        node = producers.get(stack.pop())
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if node.op_type in targets:
            return node
        if node.op_type in through:
            stack.extend(i for i in node.input if i)
    return None

