"""Storing ONNX models safely: sizes, external data, weightless skeletons, atomic saves.

Why one module: a model is written atomically (temp folder + rename: a killed run leaves no half-written
model; other files: qprep/disk/atomic.py), models above protobuf's 2 GB limit need external data on every path
(load, save, ORT session), and the input model must never be written to.
"""

from __future__ import annotations

import copy
import hashlib
import os
import tempfile
from pathlib import Path

import onnx

from qprep.disk.reading import require_regular_file

# Above this a ModelProto cannot be serialized in one piece: use external data.
PROTOBUF_LIMIT = 2**31 - 2**24

def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(require_regular_file(path, "file"), "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def content_key(model: onnx.ModelProto) -> bytes | None:
    """A digest of the model's bytes, for measuring one model once however often it is asked for; None for a
    model over protobuf's limit (it cannot be serialized, and a copy of its bytes would double a big model's
    memory): such a model is measured again."""
    if is_large(model):
        return None
    return hashlib.blake2b(model.SerializeToString(deterministic=True), digest_size=20).digest()


def is_large(model: onnx.ModelProto) -> bool:
    """Over protobuf's limit? Decided from the tensors' dims where that is clear: ByteSize() walks the whole
    message, seconds on a big model, and qprep asks before every ONNX Runtime session (BENCHMARKS.md: "a heavy
    model's weights never serialized")."""
    payload = weights_bytes(model)
    if payload > PROTOBUF_LIMIT:
        return True
    # what else a model holds (nodes, names, shapes) is a few hundred bytes per entry
    entries = len(model.graph.node) + len(model.graph.initializer) + len(model.graph.value_info)
    if payload + 1024 * entries + (16 << 20) < PROTOBUF_LIMIT:
        return False
    return model.ByteSize() > PROTOBUF_LIMIT


def weights_bytes(model: onnx.ModelProto) -> int:
    """The bytes of every initializer and Constant value held in the proto (subgraphs included)."""
    return sum(tensor_bytes(t) for t in _tensors(model.graph))


def is_heavy(model: onnx.ModelProto) -> bool:
    """Initializers heavy enough that serializing them costs more than handing them over as arrays (BENCHMARKS.md:
    "a heavy model's weights never serialized"): shape inference, the checker and ONNX Runtime sessions then work
    on the weightless skeleton. Counted as
    weightless() strips them (the main graph's initializers), so a heavy model's skeleton is light."""
    return sum(tensor_bytes(t) for t in model.graph.initializer) > HEAVY_BYTES


HEAVY_BYTES = 16 << 20


def tensor_bytes(tensor: onnx.TensorProto) -> int:
    """The bytes a tensor's values take in the proto (0 for values still in an external file), from its dims and
    element type: reading `raw_data` to measure it would copy it."""
    if tensor.data_location == onnx.TensorProto.EXTERNAL:
        return 0
    if tensor.data_type == onnx.TensorProto.STRING:
        return tensor.ByteSize()
    count = 1
    for dim in tensor.dims:
        count *= dim
    try:
        itemsize = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
    except (KeyError, TypeError, ValueError):
        itemsize = 1
    return count * itemsize


def _tensors(graph: onnx.GraphProto):
    """Initializers and Constant values of `graph` and its subgraphs."""
    yield from graph.initializer
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.TENSOR:
                yield attribute.t
            for subgraph in subgraphs(attribute):
                yield from _tensors(subgraph)


def subgraphs(attribute: onnx.AttributeProto) -> list[onnx.GraphProto]:
    """The graphs an attribute holds (If branches, Loop/Scan bodies)."""
    if attribute.type == onnx.AttributeProto.GRAPH:
        return [attribute.g]
    return list(attribute.graphs) if attribute.type == onnx.AttributeProto.GRAPHS else []


def inferred_shapes(model: onnx.ModelProto, data_prop: bool = False, shapes_only: bool = False) -> onnx.ModelProto:
    """ONNX shape inference at any size (raises what onnx raises). Why not onnx's alone: over 2 GB it returns an
    *empty* model without a word (no inputs, no nodes: the run then refused its own samples), and below it serializes
    every weight (BENCHMARKS.md: "a heavy model's weights never serialized"). A heavy model is inferred on its
    weightless skeleton, and the result's nodes, value_info and outputs are moved into `model` itself (changed and
    returned: no copy of the weights); with `shapes_only` the inferred skeleton is returned instead, whatever the
    model's size (for a caller that only reads shapes: serializing the weights is a large part of an inference's
    time)."""
    if not is_heavy(model) and not shapes_only:
        return onnx.shape_inference.infer_shapes(model, data_prop=data_prop)
    done = onnx.shape_inference.infer_shapes(weightless(model)[0], data_prop=data_prop)
    if shapes_only:
        return done
    for name in ("node", "value_info", "output"):
        model.graph.ClearField(name)
        getattr(model.graph, name).extend(getattr(done.graph, name))
    return model


def weightless(model: onnx.ModelProto, placeholder: str = "external") -> tuple[onnx.ModelProto, list[onnx.TensorProto]]:
    """(a copy of `model` whose initializers over SMALL_TENSOR carry only name, type, dims and a placeholder,
    those initializers): what shape inference, the checker and an ONNX Runtime session can take from a heavy
    model without serializing its weights. Small ones stay whole (data propagation reads shapes). Placeholder
    "external": an external-data entry (ORT takes the values from memory); "empty": the same rank with a first
    dim of 0 (the checker looks for the external file, and newer onnx checks raw_data against the dims)."""
    skeleton, big = onnx.ModelProto(), []
    _copy_fields(model, skeleton, skip=("graph",))
    _copy_fields(model.graph, skeleton.graph, skip=("initializer",))
    for tensor in model.graph.initializer:
        if tensor_bytes(tensor) <= SMALL_TENSOR:
            skeleton.graph.initializer.append(tensor)
            continue
        big.append(tensor)
        stub = onnx.TensorProto(name=tensor.name, data_type=tensor.data_type, dims=tensor.dims)
        if placeholder == "empty":
            stub.dims[0] = 0
        else:
            stub.data_location = onnx.TensorProto.EXTERNAL
            for key, value in (("location", "qprep-in-memory"), ("offset", "0"),
                               ("length", str(tensor_bytes(tensor)))):
                stub.external_data.add(key=key, value=value)
        skeleton.graph.initializer.append(stub)
    return skeleton, big


def computing(model: onnx.ModelProto, outputs: list[str], given: dict[str, int] | None = None) -> onnx.ModelProto:
    """A copy of the part of `model` that computes `outputs`, which become its only graph outputs. Why: ONNX
    Runtime runs every node of a graph whatever a run fetches, so an early tensor costs a whole run from the whole
    graph (BENCHMARKS.md: "a part of the model for its early tensors"); bias correction reads each layer's output
    in turn.
    `given` ({tensor: ONNX element type}) are tensors the caller feeds: the walk stops there and the part reads
    them as inputs. A node with subgraphs (If, Loop, Scan) needs the outer tensors its bodies read too."""
    nodes = model.graph.node
    given = given or {}
    producer = {o: index for index, node in enumerate(nodes) for o in node.output}
    keep, stack = set(), [name for name in outputs if name not in given]
    while stack:
        index = producer.get(stack.pop())
        if index is not None and index not in keep:
            keep.add(index)
            stack.extend(name for name in reads(nodes[index]) if name not in given)
    kept = [node for index, node in enumerate(nodes) if index in keep]
    read = {name for node in kept for name in reads(node)} | {i.name for i in model.graph.input} | set(outputs)
    part = onnx.ModelProto()
    _copy_fields(model, part, skip=("graph",))
    _copy_fields(model.graph, part.graph, skip=("node", "initializer", "output", "input"))
    part.graph.input.extend(i for i in model.graph.input if i.name not in given)
    part.graph.input.extend(onnx.helper.make_tensor_value_info(name, given[name], None) for name in given
                            if name in read)
    part.graph.node.extend(kept)
    part.graph.initializer.extend(t for t in model.graph.initializer if t.name in read and t.name not in given)
    declared = {o.name: o for o in model.graph.output}
    part.graph.output.extend(declared.get(name) or onnx.ValueInfoProto(name=name) for name in outputs)
    return part


def reads(node: onnx.NodeProto) -> list[str]:
    """The tensors `node` reads: its inputs, and the outer-scope tensors its subgraphs' nodes read."""
    names = [name for name in node.input if name]
    for attribute in node.attribute:
        for graph in subgraphs(attribute):
            names += _outer_reads(graph)
    return names


def _outer_reads(graph: onnx.GraphProto) -> list[str]:
    defined = ({i.name for i in graph.input} | {t.name for t in graph.initializer}
               | {t.values.name for t in graph.sparse_initializer})
    names = []
    for node in graph.node:
        names += [name for name in reads(node) if name not in defined]
        defined.update(node.output)
    return names


def _copy_fields(source, target, skip: tuple[str, ...]) -> None:
    """Every set field of protobuf message `source` but `skip` into `target`. Told apart by the value, not the
    descriptor: `FieldDescriptor.label` is gone from newer protobuf releases."""
    for field, value in source.ListFields():
        if field.name in skip:
            continue
        if hasattr(value, "extend"):  # a repeated field
            getattr(target, field.name).extend(value)
        elif hasattr(value, "CopyFrom"):  # a message
            getattr(target, field.name).CopyFrom(value)
        else:
            setattr(target, field.name, value)


SMALL_TENSOR = 1 << 16  # bytes: initializers kept whole in the weightless skeleton of a heavy model


def compacted(model: onnx.ModelProto) -> onnx.ModelProto:
    """A fresh copy of a model edited in place, to hold instead of it. Why: protobuf keeps the bytes of a field
    removed or replaced until the whole message is freed, and ORT's quantizer removes every float weight it
    quantizes: the int8 BERT-base carried 0.35 GB of float MatMul weights to the end of the run."""
    fresh = onnx.ModelProto()
    fresh.CopyFrom(model)
    return fresh


def save_model(model: onnx.ModelProto, path: str | os.PathLike) -> int:
    """Write a model atomically; models over 2 GB go to `<name>.data` beside it. Returns the bytes written (the
    model's size on disk: ByteSize() would serialize the whole proto once more)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".qprep-tmp-") as tmp:
        tmp_model = Path(tmp) / path.name
        if is_large(model):
            data_name = path.name + ".data"
            # save_model(save_as_external_data=True) rewrites the proto in place: save a copy.
            onnx.save_model(copy.deepcopy(model), str(tmp_model), save_as_external_data=True,
                            all_tensors_to_one_file=True, location=data_name, size_threshold=1024)
            written = (Path(tmp) / data_name).stat().st_size
            os.replace(Path(tmp) / data_name, path.parent / data_name)
        else:
            written = 0
            tmp_model.write_bytes(model.SerializeToString())
        written += tmp_model.stat().st_size
        os.replace(tmp_model, path)
    return written
