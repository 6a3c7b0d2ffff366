"""Random ops measured on the same noise: each draw becomes a graph input for calibration and evaluation, the
same values are fed to the float model and the result, and the deployable gets its random op back.

Why: a VITS / Piper voice samples its prior with RandomNormalLike (scaled by an input the caller sets); the float
model and the quantized one then draw different noise on every call and no comparison can judge the result, so
such models were refused whole. Drawn once per sample from the op's own distribution (its mean/scale or
low/high, dtype and shape) and fed identically to both models, the noise is part of the sample, and the
comparison is fair. RandomNormal / RandomUniform (and their *Like forms) are handled, and Bernoulli(p) as Cast(u < p) with u drawn
uniform in [0, 1) like p (the same distribution; the deployable draws u with RandomUniformLike); Multinomial and a
Dropout left in training mode stay refused (model.info.random_nodes).
The draw of sample i is seeded by (noise seed, i, the op's place), so a rerun draws the same noise.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import onnx
from onnx import helper

from qprep.model.info import random_nodes
from qprep.graph.rules import first_free
from qprep.model.io import inferred_shapes, reads
from qprep.model.runtime import Intermediates

DRAWS = {"RandomNormal": "normal", "RandomNormalLike": "normal", "RandomUniform": "uniform",
         "RandomUniformLike": "uniform", "Bernoulli": "uniform"}  # Bernoulli(p): 1 where u < p, u ~ U(0, 1)
SEED = 20261207  # the noise seed: the same noise on every run


@dataclass(frozen=True)
class NoiseSource:
    """One random op taken out of the graph; its output is the graph input the drawn values are fed to."""

    node: onnx.NodeProto
    output: str
    like: str | None  # the tensor whose shape (and dtype, unless given) the *Like op takes
    shape: tuple[int, ...] | None  # RandomNormal / RandomUniform's `shape` attribute
    elem_type: int
    distribution: str  # normal | uniform
    low_or_mean: float
    high_or_scale: float
    stands_for: str = ""  # the op this draw stands in for, when it is not the op itself (a Bernoulli's uniform)

    def describe(self) -> dict:
        first, second = ("mean", "scale") if self.distribution == "normal" else ("low", "high")
        return {"node": self.node.name or self.output, "op": self.stands_for or self.node.op_type,
                "input": self.output, first: self.low_or_mean, second: self.high_or_scale,
                "dtype": helper.tensor_dtype_to_np_dtype(self.elem_type).name}


@dataclass(frozen=True)
class Noise:
    """The random ops a run feeds: what it takes out (`as_inputs`), draws per sample and puts back at the end."""

    sources: tuple[NoiseSource, ...] = ()
    shapes: LikeShapes | None = None  # the shapes *Like draws copy, from the model with its random ops

    def samples(self, samples: list[dict]) -> list[dict]:
        return _drawn(samples, self.sources, self.shapes) if self.sources else samples

    def inputs(self) -> set[str]:
        return {s.output for s in self.sources}


def taken_out(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Noise]:
    """`as_inputs` with what the run needs to draw and restore: (model fed the noise, its Noise)."""
    fed, sources = as_inputs(model)
    return fed, Noise(sources, LikeShapes(model, sources) if sources else None)


def drawn_ops(model: onnx.ModelProto) -> tuple[list[onnx.NodeProto], list[tuple[onnx.NodeProto, str]]]:
    """(random ops of the main graph this module can feed, the other random nodes reaching the outputs)."""
    main = {tuple(n.output) for n in model.graph.node}  # (protobuf hands out new wrappers: no identity)
    fed, other = [], []
    for node, why in random_nodes(model):
        feedable = tuple(node.output) in main and node.op_type in DRAWS and node.domain in ("", "ai.onnx")
        (fed if feedable else other).append((node, why))
    return [n for n, _ in fed], other


def as_inputs(model: onnx.ModelProto) -> tuple[onnx.ModelProto, tuple[NoiseSource, ...]]:
    """`model` with each random op it can feed removed and its output a graph input; the model itself when it has
    none. The random op's output keeps its name, so the values fed to it are the ones it would have drawn."""
    nodes, _ = drawn_ops(model)
    if not nodes:
        return model, ()
    result = onnx.ModelProto()
    result.CopyFrom(model)
    graph = result.graph
    types = _shaped_types(result, [n.input[0] if n.op_type.endswith("Like") or n.op_type == "Bernoulli"
                                   else n.output[0] for n in nodes])
    sources = []
    taken = {o for n in graph.node for o in n.output} | {i.name for i in graph.input} | {
        t.name for t in graph.initializer}
    for node in nodes:
        index = next(i for i, n in enumerate(graph.node) if list(n.output) == list(node.output)
                     and n.op_type == node.op_type)
        del graph.node[index]
        stands_for = ""
        if node.op_type == "Bernoulli":
            node, stands_for = _bernoulli_as_uniform(graph, index, node, types, taken), "Bernoulli"
        source = replace(_source(node, types), stands_for=stands_for)
        sources.append(source)
        known = types.get(source.like) if source.like else types.get(source.output)  # a *Like copies its shape
        dims = known.tensor_type.shape if known is not None and known.tensor_type.HasField("shape") else None
        value = helper.make_tensor_value_info(source.output, source.elem_type, None)
        if dims is not None:
            value.type.tensor_type.shape.CopyFrom(dims)
        elif source.shape is not None:
            value.type.tensor_type.shape.CopyFrom(helper.make_tensor_type_proto(1, source.shape).tensor_type.shape)
        graph.input.append(value)
        _drop_value_info(graph, source.output)
    return result, tuple(sources)


def with_noise(samples: list[dict], sources: tuple[NoiseSource, ...], model: onnx.ModelProto) -> list[dict]:
    """Each sample with the values its random ops draw (seeded by the sample's index and the op's place); `model`
    (the one with the random ops) gives the shapes a *Like op copies from a tensor the sample computes."""
    return _drawn(samples, sources, LikeShapes(model, sources)) if sources else samples


def _drawn(samples: list[dict], sources: tuple[NoiseSource, ...], shapes: LikeShapes) -> list[dict]:
    drawn = []
    for index, sample in enumerate(samples):
        like = shapes.of(sample)
        sample = dict(sample)
        for place, source in enumerate(sources):
            shape = source.shape if source.like is None else like[source.like]
            sample[source.output] = draw(source, shape, np.random.default_rng([SEED, index, place]))
        drawn.append(sample)
    return drawn


def draw(source: NoiseSource, shape, rng: np.random.Generator) -> np.ndarray:
    dtype = helper.tensor_dtype_to_np_dtype(source.elem_type)
    if source.distribution == "normal":
        values = rng.normal(source.low_or_mean, source.high_or_scale, size=tuple(shape))
    else:
        values = rng.uniform(source.low_or_mean, source.high_or_scale, size=tuple(shape))
    return values.astype(dtype)


def restore(model: onnx.ModelProto, sources: tuple[NoiseSource, ...]) -> tuple[onnx.ModelProto, list[str]]:
    """The deployable: each noise input drawn by its random op again, placed before its first reader → (model,
    the noise inputs left as inputs: a *Like op whose shape tensor the result no longer computes)."""
    if not sources:
        return model, []
    result = onnx.ModelProto()
    result.CopyFrom(model)
    graph = result.graph
    available = {i.name for i in graph.input} | {t.name for t in graph.initializer} | {
        o for n in graph.node for o in n.output}
    left, unordered = [], False
    for source in sources:
        if source.output not in {i.name for i in graph.input}:
            continue  # the result does not read this noise (folded away)
        if source.like is not None and source.like not in available:
            left.append(source.output)
            continue
        readers = [i for i, n in enumerate(graph.node) if source.output in reads(n)]
        after = max((i for i, n in enumerate(graph.node) if source.like in n.output), default=-1)
        first = min(readers, default=len(graph.node))
        node = onnx.NodeProto()
        node.CopyFrom(source.node)
        graph.node.insert(first if after < first else len(graph.node), node)
        unordered = unordered or after >= first
        kept = [i for i in graph.input if i.name != source.output]
        del graph.input[:]
        graph.input.extend(kept)
    if unordered:  # a reader the quantizer placed before the tensor the *Like op copies: graph order again
        _topological(graph)
    return result, left


def _bernoulli_as_uniform(graph: onnx.GraphProto, index: int, node: onnx.NodeProto, types: dict,
                          taken: set[str]) -> onnx.NodeProto:
    """Bernoulli(p) at `index` → Cast(Less(u, p)) there, u a new value; returns the RandomUniformLike(p) → u that
    draws u (the source fed now, and put back in the deployable)."""
    p, out = node.input[0], node.output[0]
    u = first_free(f"{out}_uniform", taken)
    taken.add(u)
    below = first_free(f"{out}_drawn", taken)
    taken.add(below)
    like_type = types.get(p)
    elem = like_type.tensor_type.elem_type if like_type is not None else onnx.TensorProto.FLOAT
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    name = node.name or out
    graph.node.insert(index, helper.make_node("Cast", [below], [out], name=f"{name}_cast",
                                              to=int(attributes.get("dtype", elem))))
    graph.node.insert(index, helper.make_node("Less", [u, p], [below], name=f"{name}_less"))
    return helper.make_node("RandomUniformLike", [p], [u], name=name, dtype=int(elem))


def _source(node: onnx.NodeProto, types: dict) -> NoiseSource:
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    distribution = DRAWS[node.op_type]
    first, second = ("mean", "scale") if distribution == "normal" else ("low", "high")
    defaults = (0.0, 1.0)
    like = node.input[0] if node.op_type.endswith("Like") else None
    elem_type = attributes.get("dtype")
    if elem_type is None:
        like_type = types.get(like) if like else None
        elem_type = like_type.tensor_type.elem_type if like_type is not None else onnx.TensorProto.FLOAT
    return NoiseSource(node=node, output=node.output[0], like=like,
                       shape=tuple(int(d) for d in attributes["shape"]) if "shape" in attributes else None,
                       elem_type=int(elem_type), distribution=distribution,
                       low_or_mean=float(attributes.get(first, defaults[0])),
                       high_or_scale=float(attributes.get(second, defaults[1])))


def _value_types(model: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    graph = model.graph
    types = {v.name: v.type for v in [*graph.value_info, *graph.input, *graph.output]}
    for tensor in graph.initializer:
        types.setdefault(tensor.name, helper.make_tensor_type_proto(tensor.data_type, list(tensor.dims)))
    return types


def _shaped_types(model: onnx.ModelProto, names: list[str]) -> dict[str, onnx.TypeProto]:
    """_value_types, with ONNX shape inference (at any size) when one of `names` has no shape in the graph."""
    types = _value_types(model)
    if all(name in types and types[name].tensor_type.HasField("shape") for name in names):
        return types
    try:
        inferred = _value_types(inferred_shapes(model, shapes_only=True))
    except Exception:  # noqa: BLE001 - inference is a help here; the shapes stay unknown without it
        return types
    return {**inferred, **{k: v for k, v in types.items() if v.tensor_type.HasField("shape")}}


def _drop_value_info(graph: onnx.GraphProto, name: str) -> None:
    kept = [v for v in graph.value_info if v.name != name]
    del graph.value_info[:]
    graph.value_info.extend(kept)


class LikeShapes:
    """The shapes of the tensors *Like ops copy: read from the graph where it states a fixed shape, else computed
    per sample by one ONNX Runtime session exposing them (runtime.Intermediates, built once for every sample set)."""

    def __init__(self, model: onnx.ModelProto, sources: tuple[NoiseSource, ...]):
        wanted = sorted({s.like for s in sources if s.like is not None})
        types = _value_types(model)
        self.fixed = {}
        for name in wanted:
            known = types.get(name)
            dims = [d.dim_value if d.HasField("dim_value") else None for d in known.tensor_type.shape.dim] \
                if known is not None and known.tensor_type.HasField("shape") else None
            if dims is not None and all(d is not None for d in dims):
                self.fixed[name] = tuple(dims)
        computed = [name for name in wanted if name not in self.fixed]
        self.tap = Intermediates(model, computed) if computed else None

    def of(self, sample: dict) -> dict[str, tuple[int, ...]]:
        values = self.tap.values(sample) if self.tap is not None else {}
        return {**self.fixed, **{name: tuple(np.shape(v)) for name, v in values.items()}}


def _topological(graph: onnx.GraphProto) -> None:
    """Graph order again, each node as early as its inputs allow and otherwise in the order it had."""
    import heapq

    produced_by = {o: i for i, n in enumerate(graph.node) for o in n.output}
    waiting = [0] * len(graph.node)
    readers: dict[int, list[int]] = {}
    for i, node in enumerate(graph.node):
        producers = {produced_by[name] for name in reads(node) if name in produced_by}
        waiting[i] = len(producers)
        for producer in producers:
            readers.setdefault(producer, []).append(i)
    ready = [i for i, count in enumerate(waiting) if count == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for reader in readers.get(i, []):
            waiting[reader] -= 1
            if waiting[reader] == 0:
                heapq.heappush(ready, reader)
    order += [i for i in range(len(graph.node)) if i not in set(order)]  # a cycle: left as it was
    nodes = [graph.node[i] for i in order]
    copies = []
    for node in nodes:
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        copies.append(copy)
    del graph.node[:]
    graph.node.extend(copies)
