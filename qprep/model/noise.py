"""Random ops measured on the same noise: each draw becomes a graph input for calibration and evaluation, the
same values are fed to the float model and the result, and the deployable gets its random op back.

Why: a VITS / Piper voice samples its prior with RandomNormalLike (scaled by an input the caller sets); the float
model and the quantized one then draw different noise on every call and no comparison can judge the result, so
such models were refused whole. Drawn once per sample from the op's own distribution (its mean/scale or
low/high, dtype and shape) and fed identically to both models, the noise is part of the sample, and the
comparison is fair. RandomNormal / RandomUniform (and their *Like forms) are handled, and Bernoulli(p) as
Cast(u < p) with u drawn uniform in [0, 1) like p (the same distribution; the deployable draws u with
RandomUniformLike). Multinomial(logits) becomes the inverse-CDF sampling of softmax(logits) on u[batch,
sample_size] drawn uniform in [0, 1) (the same distribution); the ONNX deployable gets the Multinomial itself
back, a .rknn takes u as an input. A random op inside an If/Loop/Scan body, a Multinomial below opset 12 and a
Dropout left in training mode stay refused (model.info.random_nodes). The draw of sample i is seeded by (noise
seed, i, the op's place), so a rerun draws the same noise.
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
         "RandomUniformLike": "uniform", "Bernoulli": "uniform",  # Bernoulli(p): 1 where u < p, u ~ U(0, 1)
         "Multinomial": "uniform"}  # Multinomial(logits): the inverse CDF of softmax(logits) at u ~ U(0, 1)
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
    columns: int | None = None  # a Multinomial's sample_size: the draw is [rows of `like`, columns]

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
        feedable = tuple(node.output) in main and node.op_type in DRAWS and node.domain in ("", "ai.onnx") and (
            node.op_type != "Multinomial" or _multinomial_fits(model, node))
        (fed if feedable else other).append((node, why))
    return [n for n, _ in fed], other


def _multinomial_fits(model: onnx.ModelProto, node: onnx.NodeProto) -> bool:
    """The inverse-CDF sampling needs LessOrEqual (opset 12) and logits of rank 2 (the op's own contract; a rank
    the graph states otherwise is not matched)."""
    known = _value_types(model).get(node.input[0])
    shape = known.tensor_type.shape if known is not None and known.tensor_type.HasField("shape") else None
    return _opset(model) >= 12 and (shape is None or len(shape.dim) == 2)


def _opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)


def as_inputs(model: onnx.ModelProto) -> tuple[onnx.ModelProto, tuple[NoiseSource, ...]]:
    """`model` with each random op it can feed removed and its output a graph input; the model itself when it has
    none. The random op's output keeps its name, so the values fed to it are the ones it would have drawn."""
    nodes, _ = drawn_ops(model)
    if not nodes:
        return model, ()
    result = onnx.ModelProto()
    result.CopyFrom(model)
    graph = result.graph
    reads_shape = ("Bernoulli", "Multinomial")  # like a *Like op, from their input
    types = _shaped_types(result, [n.input[0] if n.op_type.endswith("Like") or n.op_type in reads_shape
                                   else n.output[0] for n in nodes])
    sources = []
    taken = {o for n in graph.node for o in n.output} | {i.name for i in graph.input} | {
        t.name for t in graph.initializer}
    for node in nodes:
        index = next(i for i, n in enumerate(graph.node) if list(n.output) == list(node.output)
                     and n.op_type == node.op_type)
        del graph.node[index]
        if node.op_type == "Multinomial":
            source = _multinomial_as_uniform(graph, index, node, taken, _opset(result))
        elif node.op_type == "Bernoulli":
            source = replace(_source(_bernoulli_as_uniform(graph, index, node, types, taken), types),
                             stands_for="Bernoulli")
        else:
            source = _source(node, types)
        sources.append(source)
        known = types.get(source.like) if source.like else types.get(source.output)  # a *Like copies its shape
        dims = known.tensor_type.shape if known is not None and known.tensor_type.HasField("shape") else None
        value = helper.make_tensor_value_info(source.output, source.elem_type, None)
        if dims is not None and source.columns is not None:  # [rows of the logits, sample_size]
            value.type.tensor_type.shape.dim.add().CopyFrom(dims.dim[0])
            value.type.tensor_type.shape.dim.add().dim_value = source.columns
        elif dims is not None:
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
            if source.columns is not None:
                shape = (shape[0], source.columns)
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
        if source.node.op_type == "Multinomial":
            if not _multinomial_back(graph, source):
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


def _multinomial_back(graph: onnx.GraphProto, source: NoiseSource) -> bool:
    """The Multinomial in place of the node computing its output, and what only that node's inputs fed (the
    inverse-CDF sampling, with any quantization the result put on it) removed with the uniform input; False,
    the graph untouched, when the result no longer computes the Multinomial's output."""
    out = source.node.output[0]
    at = next((i for i, n in enumerate(graph.node) if out in n.output), None)
    if at is None:
        return False
    cone = set(reads(graph.node[at]))
    back = onnx.NodeProto()
    back.CopyFrom(source.node)
    graph.node.insert(at, back)
    del graph.node[at + 1]
    if any(source.like in n.output for n in graph.node[at + 1:]):  # a result that computes the logits later
        _topological(graph)
    kept_outputs = {o.name for o in graph.output}
    while True:
        read = {name for node in graph.node for name in reads(node)} | kept_outputs
        dead = [i for i, n in enumerate(graph.node) if set(n.output) & cone and not set(n.output) & read]
        if not dead:
            break
        for i in reversed(dead):
            cone |= set(reads(graph.node[i]))
            del graph.node[i]
    read = {name for node in graph.node for name in reads(node)} | kept_outputs
    for field in (graph.initializer, graph.input):
        kept = [t for t in field if t.name in read or t.name not in cone | {source.output}]
        del field[:]
        field.extend(kept)
    return True


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


def _multinomial_as_uniform(graph: onnx.GraphProto, index: int, node: onnx.NodeProto, taken: set[str],
                            opset: int) -> NoiseSource:
    """Multinomial(logits) at `index` → its inverse-CDF sampling there, on u[batch, sample_size] ~ U(0, 1) fed as
    an input: a sample's index is the number of classes whose exclusive cumulative softmax probability is <= u,
    minus one (class k when P(< k) <= u < P(<= k): the same distribution; never past the last class, no clip).
    In double, through ops ONNX Runtime's quantizer leaves alone (it quantizes CumSum/Unsqueeze of float tensors,
    and fails on a double Softmax: Exp(LogSoftmax) instead), so the result samples as the float model does, and a
    large vocabulary's small probabilities keep their digits. restore puts the Multinomial back."""
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    size, dtype = int(attributes.get("sample_size", 1)), int(attributes.get("dtype", onnx.TensorProto.INT32))
    logits, out, name = node.input[0], node.output[0], node.name or node.output[0]
    names = {}
    for part in ("uniform", "wide", "log", "probs", "axis", "before", "rows", "u_wide", "cols", "passed", "counted",
                 "count", "one", "rows_axes", "cols_axes", "sum_axes"):
        names[part] = first_free(f"{out}_{part}", taken)
        taken.add(names[part])
    n = names
    double = onnx.TensorProto.DOUBLE

    def constant(key: str, values, elem=onnx.TensorProto.INT64):
        array = np.array(values, dtype=helper.tensor_dtype_to_np_dtype(elem))
        return helper.make_node("Constant", [], [n[key]], name=f"{name}_{key}",
                                value=helper.make_tensor(n[key], elem, array.shape, array.ravel().tolist()))

    def over(op: str, data: str, axes: list[int], output: str, key: str, **attrs):
        if opset >= 13:
            return [constant(key, axes), helper.make_node(op, [data, n[key]], [output], name=f"{name}_{output}",
                                                          **attrs)]
        return [helper.make_node(op, [data], [output], name=f"{name}_{output}", axes=axes, **attrs)]

    nodes = [helper.make_node("Cast", [logits], [n["wide"]], name=f"{name}_wide", to=double),
             helper.make_node("LogSoftmax", [n["wide"]], [n["log"]], name=f"{name}_log_softmax", axis=1),
             helper.make_node("Exp", [n["log"]], [n["probs"]], name=f"{name}_softmax"),
             constant("axis", 1),
             helper.make_node("CumSum", [n["probs"], n["axis"]], [n["before"]], name=f"{name}_cumsum",
                              exclusive=1),
             *over("Unsqueeze", n["before"], [1], n["rows"], "rows_axes"),  # [batch, 1, classes]
             helper.make_node("Cast", [n["uniform"]], [n["u_wide"]], name=f"{name}_u_wide", to=double),
             *over("Unsqueeze", n["u_wide"], [2], n["cols"], "cols_axes"),  # [batch, sample_size, 1]
             helper.make_node("LessOrEqual", [n["rows"], n["cols"]], [n["passed"]], name=f"{name}_passed"),
             helper.make_node("Cast", [n["passed"]], [n["counted"]], name=f"{name}_counted", to=dtype),
             *over("ReduceSum", n["counted"], [2], n["count"], "sum_axes", keepdims=0),
             constant("one", 1, dtype),
             helper.make_node("Sub", [n["count"], n["one"]], [out], name=f"{name}_index")]
    for offset, new in enumerate(nodes):
        graph.node.insert(index + offset, new)
    return NoiseSource(node=node, output=n["uniform"], like=logits, shape=None, elem_type=onnx.TensorProto.FLOAT,
                       distribution="uniform", low_or_mean=0.0, high_or_scale=1.0, stands_for="Multinomial",
                       columns=size)


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
