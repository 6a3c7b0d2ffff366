"""A derived model (derived_builds.py) run only from its first edit on, fed with the tensors of a model run
before it.

Why: a ranking trial makes one activation edge of the reference build float, yet ran the whole model on every
ranking sample, and a round runs one trial per candidate: the run can be most of a trial's time. The nodes
before the edit compute what they computed in the reference: their last QuantizeLinear outputs, kept from one
run of the reference, feed the rest (every output equal to the bit; BENCHMARKS.md: "a derived model run from its
first edit on"). A
promotion adds one candidate to the set the previous promotion ran with, so it runs from the tensors of that
previous promotion's run.

How:
- A model runs as deployed (ORT_ENABLE_ALL) with every QuantizeLinear output exposed. They are int8, a quarter
  of the float bytes. They are where ORT's fused integer ops (QLinearConv, …) end, so exposing them leaves the
  fusions, and the numbers, as they are.
- A derived model's node is *changed* when the model run before has no such node (op, inputs, outputs,
  attributes), or when other nodes read its outputs: ORT fuses a node with the QuantizeLinear after it only
  when nothing else reads its output.
- Every node downstream of a changed one runs, from the exposed tensors that nothing changed computes
  (io.computing stops there).
- Checked, not assumed: the first partial run on each sample set (ranking, all, kept apart) is also run whole.
  A single differing value and this search runs every model whole from then on.
- Not for graphs with subgraphs (If, Loop, Scan), nor past MAX_HELD_BYTES of exposed tensors (run whole).
"""

from __future__ import annotations

import logging

import numpy as np
import onnx

from qprep.model.io import computing
from qprep.model.runtime import run_model

log = logging.getLogger("qprep")

MAX_HELD_BYTES = 1 << 30  # per sample set (ranking, all, kept apart: at most three); beyond, that set runs whole
# (room for a CNN's search samples: BENCHMARKS.md, "derived runs' held tensors capped at 1 GiB")


class DerivedRuns:
    """Runs of the models derived from one reference build at a time (a round of the search). `run` →
    per-sample outputs, as `run_model(derived, samples, threads, optimize=True)` gives them."""

    def __init__(self, threads: int):
        self.threads = threads
        self.trusted = True  # until a partial run differs from the whole one
        self.key = None  # the reference build the held tensors belong to
        self.sets: dict[tuple, dict] = {}  # (first sample's id, count) → {"reference"/"last": _Held | None}
        self.checked: set[tuple] = set()  # the sample sets a partial run was checked on

    def run(self, reference_key, reference: onnx.ModelProto, derived: onnx.ModelProto, samples: list[dict],
            from_last: bool = False) -> list[dict[str, np.ndarray]]:
        """`derived` on `samples`, from the reference's tensors (a ranking trial: the reference plus one
        candidate), or with `from_last` from the tensors of the model run last on these samples (a promotion:
        the last one plus a block)."""
        if not self.trusted or not samples or _has_subgraphs(derived):
            return run_model(derived, samples, self.threads, optimize=True)
        if reference_key != self.key:
            self.key, self.sets = reference_key, {}
        set_key = (id(samples[0]), len(samples))
        state = self.sets.setdefault(set_key, {})
        if from_last:
            base = state.get("last")
        else:
            if "reference" not in state:
                state["reference"] = _Held.run(reference, samples, self.threads)[1]
            base = state["reference"]
        ran = base.run_derived(derived, samples, self.threads, keep=from_last) if base is not None else None
        if ran is None:  # nothing held, or the edits start at the inputs
            outputs, held = (_Held.run(derived, samples, self.threads) if from_last else
                             (run_model(derived, samples, self.threads, optimize=True), None))
        else:
            outputs, held = ran
            if set_key not in self.checked:  # the first on these samples: the whole model must agree
                self.checked.add(set_key)
                whole = run_model(derived, samples, self.threads, optimize=True)
                if not _same(whole, outputs):
                    log.info("fallback: a model run from the tensors of the one before differed from its whole "
                             "run: whole runs from here")
                    self.trusted, self.sets = False, {}
                    return whole
        if from_last:
            state["last"] = held
        return outputs


class _Held:
    """A model's exposed QuantizeLinear outputs on one sample set, and what its nodes look like."""

    def __init__(self, model: onnx.ModelProto, values: list[dict[str, np.ndarray]],
                 nodes: set[bytes] | None = None, readers: dict | None = None):
        """`nodes` (each node serialized) and `readers` (_readers): the model's, when the caller has them."""
        self.values = values
        self.nodes = nodes if nodes is not None else {node.SerializeToString() for node in model.graph.node}
        self.readers = readers if readers is not None else _readers(model)
        self.types = {name: onnx.helper.np_dtype_to_tensor_dtype(value.dtype) for name, value in values[0].items()}

    @classmethod
    def run(cls, model: onnx.ModelProto, samples: list[dict], threads: int) -> tuple[list[dict], "_Held | None"]:
        """(the outputs of `model`, its tensors held; None past MAX_HELD_BYTES or with nothing to expose)."""
        exposed = _quantized(model, model.graph.node)
        values = run_model(model, samples, threads, optimize=True, extra_outputs=exposed,
                           max_extra_bytes=MAX_HELD_BYTES)
        held = bool(exposed) and all(name in values[-1] for name in exposed)
        return _declared(model, values), cls(model, [{name: v[name] for name in exposed} for v in values]) if held \
            else None

    def run_derived(self, derived: onnx.ModelProto, samples: list[dict], threads: int,
                    keep: bool) -> tuple[list[dict], "_Held | None"] | None:
        """(the outputs of `derived` run from these tensors, with `keep` its own tensors held), or None when its
        edits leave nothing to skip."""
        readers, serialized = _readers(derived), [node.SerializeToString() for node in derived.graph.node]
        changed = [node for node, text in zip(derived.graph.node, serialized) if text not in self.nodes
                   or any(readers.get(o, set()) != self.readers.get(o, set()) for o in node.output if o)]
        downstream = _downstream(derived, changed)
        produced = {o for node in derived.graph.node for o in node.output}  # (a Q/DQ pair an edit removed: gone)
        given = {name: kind for name, kind in self.types.items() if name in produced and name not in downstream}
        part = computing(derived, [o.name for o in derived.graph.output], given)
        if len(part.graph.node) == len(derived.graph.node):
            return None
        exposed = _quantized(derived, part.graph.node) if keep else []
        values = run_model(part, [{**sample, **self.values[index]} for index, sample in enumerate(samples)],
                           threads, optimize=True, extra_outputs=exposed)
        held = None
        if keep:
            values_held = [{**{name: old[name] for name in given}, **{name: new[name] for name in exposed}}
                           for old, new in zip(self.values, values)]
            held = _Held(derived, values_held, set(serialized), readers)
        return _declared(derived, values), held


def _quantized(model: onnx.ModelProto, nodes) -> list[str]:
    """The QuantizeLinear outputs among `nodes` that are not graph outputs of `model`."""
    declared = {o.name for o in model.graph.output}
    return [node.output[0] for node in nodes if node.op_type == "QuantizeLinear" and node.output[0] not in declared]


def _declared(model: onnx.ModelProto, values: list[dict]) -> list[dict]:
    names = [o.name for o in model.graph.output]
    return [{name: value[name] for name in names} for value in values]


def _readers(model: onnx.ModelProto) -> dict[str, set[tuple]]:
    readers: dict[str, set[tuple]] = {}
    for node in model.graph.node:
        for name in node.input:
            readers.setdefault(name, set()).add((node.op_type, tuple(node.output)))
    return readers


def _downstream(model: onnx.ModelProto, changed: list[onnx.NodeProto]) -> set[str]:
    """The tensors `changed` nodes write, and every tensor computed from them."""
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    tensors = {o for node in changed for o in node.output if o}
    stack = list(tensors)
    while stack:
        for node in readers.get(stack.pop(), []):
            for output in node.output:
                if output and output not in tensors:
                    tensors.add(output)
                    stack.append(output)
    return tensors


def _has_subgraphs(model: onnx.ModelProto) -> bool:
    return any(attribute.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
               for node in model.graph.node for attribute in node.attribute)


def _same(a: list[dict[str, np.ndarray]], b: list[dict[str, np.ndarray]]) -> bool:
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(np.array_equal(x[k], y[k], equal_nan=x[k].dtype.kind in "fc") for k in x)
        for x, y in zip(a, b))
