"""Which tensor of a quantized model computes which tensor of its float model, decided by the graphs alone.

Why not names: ONNX Runtime's QDQ quantizer removes a Relu/Clip after a quantized node and renames that node's
output to the activation's, so the result's tensor called like the float model's post-Relu tensor holds the
pre-Relu values (the Q/DQ pair's clamp applies the Relu); a per-layer view matched by name compared the two and
painted a model whose outputs agree at cosine 1.0000 red. Here each result tensor gets the float tensor it
computes (its *meaning*), propagated from the inputs in graph order:

    graph input       the float input of the same name
    constant          a constant, or computed from constants and shapes (weights may differ: rounded, GPTQ,
                      corrected, padded; a shape computation the result folded is a constant there)
    twin node         a node of the float model of the same name and op type whose inputs mean the node's
                      inputs (constants on both sides count as the same) computes the same outputs; a twin
                      output renamed to a float tensor further down means what the twin computes when only a
                      removed Relu/Clip lies between (the quantizer's absorbed activation), the tensor it was
                      renamed to when only a removed BatchNormalization/Identity/Dropout lies between (folded)
    structural twin   a node the result added (a rewrite moved a DequantizeLinear past it) with the op type,
                      attributes, input meanings and equal constants of one float node computes that node's outputs
    QuantizeLinear    holds its input's meaning as integers on its grid; when the float model applies a Relu/Clip
                      to it that the result removed, the activation's output, if the Q's range clamps where the
                      activation does (within one step), else nothing
    DequantizeLinear  on the grid its integers were quantized on: their meaning, in float again; on that grid
                      scaled by 1/c: the float model's removed division of that tensor by the scalar c
    data movement     Reshape, Transpose, MaxPool… on integers: the twin's output, as integers on the same grid
    merged reshape    a Reshape the result made of a chain of float Reshapes/Squeezes/Transposes that keep the
                      elements' order: the chain's tensor of its shape
    block maximum     ReduceMax over axes 3 and 5 of x reshaped to [N, C, H/kh, kh, W/kw, kw] (qprep's float
                      MaxPool, qdq/float_maxpool.py): the float MaxPool of x whose (kh, kw) windows tile it
    replacement       a tensor named as a float node's output, that node gone, computed by nodes without twins
                      from tensors meaning that node's inputs alone (ORT's dynamic MatMulInteger): that output

A float tensor is compared with a float result tensor that means it (a DequantizeLinear output first: the
rounding the quantizer added is part of the error), else with integers that mean it on a per-tensor grid, read
as (q - zero point) · scale, or left out with the reason. No value is looked at. Constants are equal where they
hold the same infinities at the same places and their finite values agree (an attention mask's -inf).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import numpy_helper

from qprep.measure.constants import (LARGE, SMALL, clamps_like, constant_value, element_count, op_attributes,
                                    q_grid, read_array, within_rounding)
from qprep.model.info import attribute, constant_tensors, tensor_shapes

ACTIVATIONS = ("Relu", "Clip")  # ORT's QDQRemovableActivation: removed after a quantized producer
FOLDED = ("BatchNormalization", "Identity", "Dropout")  # absorbed into the producer: same values, renamed
DATA_MOVEMENT = frozenset({"Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze", "MaxPool", "Slice",
                           "Concat", "Gather", "Split", "Expand", "Tile", "Identity", "Pad", "Resize",
                           "DepthToSpace", "SpaceToDepth", "GlobalMaxPool", "ReduceMax", "ReduceMin"})
SHAPES = ("Shape", "Size")  # their outputs count as constants: a shape computation is not a layer
# ops whose constants a quantizer may change while the output stays the same value: weights rounded, GPTQ,
# corrected biases, padded channels, a smoothed LayerNorm's scale moved in
WEIGHTED = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul", "MatMulInteger", "ConvInteger"})
# the rewrites qprep's ORT backend makes (quantize/rewrites.py) whose results the rules above follow: smoothed
# LayerNorms (a factor per channel), the float MaxPool (block maximum), padded channels (measure/layers.py cuts
# them off). A rewrite added there without a rule here would break the view at every tensor it touches.
FOLLOWED_REWRITES = frozenset({"smoothed_layernorms", "maxpool_float", "channel_padding"})

REMOVED = "removed by the quantizer, nothing in the result computes it"
INTEGERS = "held only as integers in the result"
DIFFERENT = "the result computes it from other inputs"
FUSED = "fused into the node after it, its own value not kept"
UNCLAMPED = "its activation was absorbed, but the Q/DQ range does not clamp where it did"
AFTER = "computed from a tensor left out"


@dataclass(frozen=True)
class Meaning:
    """What a result tensor computes: a float tensor's value (None: nothing provable), as integers or not."""

    tensor: str | None
    integer: bool = False
    constant: bool = False
    grid: tuple | None = None  # integers: the (scale, zero point) arrays' bytes and types they were quantized on
    factor: bytes | None = None  # float64 per last-axis channel: the float tensor is this one times it (smoothed)


NOTHING = Meaning(None)


@dataclass
class Correspondence:
    """pairs: (float tensor, result tensor, op type, float node) in float graph order; left_out: float tensor →
    the reason no result tensor is compared with it."""

    pairs: list[tuple[str, str, str, str]] = field(default_factory=list)
    left_out: dict[str, str] = field(default_factory=dict)
    grids: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)  # integer twin → (scale, zero)
    factors: dict[str, np.ndarray] = field(default_factory=dict)  # twin → per-channel factor to the float value


def correspond(float_model: onnx.ModelProto, result: onnx.ModelProto) -> Correspondence:
    """The result tensor to compare with each float node's first output (graph outputs, Constant and Shape
    outputs aside: the outputs are judged on their own), or the reason there is none."""
    graph = FloatGraph(float_model)
    meanings = Propagation(graph, result.graph).meanings
    found: dict[str, list[tuple[str, Meaning, str]]] = {}
    producers = {o: n for n in result.graph.node for o in n.output}
    for name, meaning in meanings.items():
        if meaning.tensor is not None and not meaning.constant:
            op = producers[name].op_type if name in producers else ""
            found.setdefault(meaning.tensor, []).append((name, meaning, op))
    outputs = {o.name for o in float_model.graph.output}
    result_nodes = {n.name: n for n in result.graph.node if n.name}
    out = Correspondence()
    for node in float_model.graph.node:
        if node.op_type in ("Constant", "Shape") or not node.output or not node.output[0]:
            continue
        tensor = node.output[0]
        if tensor in outputs or tensor in graph.constants:
            continue
        twins = [(name, op, m.factor) for name, m, op in found.get(tensor, []) if not m.integer]
        if twins:  # the rounded copy first: the error its Q/DQ adds is part of the result
            twin, _, factor = min(twins, key=lambda t: (t[1] != "DequantizeLinear", t[0] != tensor, t[0]))
            out.pairs.append((tensor, twin, node.op_type, node.name))
            if factor is not None:
                out.factors[twin] = _vector(factor)
        elif (grid := _integer_twin(found.get(tensor, []))) is not None:  # read as its DQ would: (q - z) * s
            out.pairs.append((tensor, grid[0], node.op_type, node.name))
            out.grids[grid[0]] = grid[1][:2]
            if grid[1][2] is not None:
                out.factors[grid[0]] = _vector(grid[1][2])
        elif tensor in found:
            out.left_out[tensor] = INTEGERS
        elif tensor in graph.unclamped:
            out.left_out[tensor] = UNCLAMPED
        elif node.name in result_nodes and tensor not in result_nodes[node.name].output and meanings.get(
                result_nodes[node.name].output[0], NOTHING).tensor not in (None, tensor):
            out.left_out[tensor] = FUSED
        elif any(out.left_out.get(i) not in (None, INTEGERS) for i in node.input):
            out.left_out[tensor] = AFTER  # nothing provable follows from a tensor the result does not compute
            # (one held as integers is computed: a node after it not proven is so for its own reason)
        else:
            out.left_out[tensor] = DIFFERENT if node.name in result_nodes else REMOVED
    return out


def _integer_twin(found: list[tuple[str, Meaning, str]]) -> tuple[str, tuple] | None:
    """An integer twin on a per-tensor grid, its (scale, zero point, factor): compared as the values it stands for."""
    for name, meaning, _ in sorted(found, key=lambda f: f[0]):
        if meaning.integer and meaning.grid is not None:
            scale, zero = (np.frombuffer(data, dtype).reshape(shape) for dtype, shape, data in meaning.grid)
            if scale.size == 1 and zero.size == 1:
                return name, (scale.astype(np.float64).reshape(()), zero.astype(np.float64).reshape(()),
                              meaning.factor)
    return None


class FloatGraph:
    """The float model's producers, consumers, node names and constant values."""

    def __init__(self, model: onnx.ModelProto):
        graph = model.graph
        self.nodes = {n.name: n for n in graph.node if n.name}
        self.producer = {o: n for n in graph.node for o in n.output if o}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for node in graph.node:
            for name in set(node.input):
                self.consumers.setdefault(name, []).append(node)
        self.inputs = {v.name for v in graph.input}
        self.values = constant_tensors(graph)
        self.constants = set(self.values)
        for node in graph.node:  # computed from constants and shapes alone: not a layer, fixed once dims are
            if node.op_type in SHAPES or (node.input and all(not i or i in self.constants for i in node.input)):
                self.constants.update(o for o in node.output if o)
        self.unclamped: set[str] = set()  # absorbed activations' outputs whose Q range did not reproduce them
        self.model, self._shapes = model, None

    def shapes(self) -> dict[str, list[int | None]]:
        """Static dims by tensor (shape inference, once, only when a rule needs them)."""
        if self._shapes is None:
            self._shapes = {name: dims for name, (_, dims) in tensor_shapes(self.model).items()}
        return self._shapes


class Propagation:
    """Each result tensor's Meaning, node by node in graph order (see the module doc for the rules)."""

    def __init__(self, graph: FloatGraph, result: onnx.GraphProto):
        self.graph, self.values = graph, constant_tensors(result)
        self.present = {n.name for n in result.node if n.name}
        self.meanings = {name: Meaning(name if name in graph.constants else None, constant=True)
                         for name in self.values}
        for value in result.input:
            self.meanings.setdefault(value.name, Meaning(value.name) if value.name in graph.inputs else NOTHING)
        self.producer = {o: n for n in result.node for o in n.output if o}
        for node in _in_order(result):
            self.meanings.update((name, meaning) for name, meaning in zip(node.output, self.outputs(node)) if name)

    def meaning(self, name: str) -> Meaning:
        return self.meanings.get(name, NOTHING) if name else Meaning("", constant=True)

    def outputs(self, node: onnx.NodeProto) -> list[Meaning]:
        inputs = [self.meaning(i) for i in node.input]
        if node.op_type in SHAPES or (node.input and all(m.constant for m in inputs)):
            return [Meaning(None, constant=True)] * len(node.output)
        twin = self.graph.nodes.get(node.name)
        if twin is not None and twin.op_type == node.op_type and twin.domain == node.domain:
            return self.twin_outputs(node, twin, inputs)
        found = [NOTHING] * len(node.output)
        if node.op_type == "QuantizeLinear" and node.domain in ("", "ai.onnx"):
            found[0] = self.quantized(node, inputs[0])
        elif node.op_type == "DequantizeLinear" and node.domain in ("", "ai.onnx"):
            found[0] = self.dequantized(node, inputs[0])
        elif (twin := self.structural_twin(node, inputs)) is not None:
            found = self.twin_outputs(node, twin, inputs)
        elif node.op_type == "Mul" and len(node.input) == 2 and inputs[0].factor and inputs[1].constant:
            factor, wanted = self.constant(node.input[1]), _vector(inputs[0].factor)  # a smoothing undone
            found[0] = Meaning(inputs[0].tensor) if factor is not None and factor[0].size == wanted.size and \
                within_rounding(factor[0].reshape(-1), wanted) else NOTHING
        elif node.op_type == "Reshape" and inputs[0].tensor is not None:
            found[0] = self.reshaped(node, inputs[0])
        elif node.op_type == "ReduceMax" and node.domain in ("", "ai.onnx"):
            found[0] = self.block_max(node)
        if all(m.tensor is None for m in found):
            found = [self.replacing(name) for name in node.output]
        return found

    def reshaped(self, node: onnx.NodeProto, source: Meaning) -> Meaning:
        """A Reshape the result made of a chain of float nodes that keep the elements' order (Reshape, Flatten,
        Squeeze, Unsqueeze, a Transpose moving only axes of size 1): the chain's tensor of the Reshape's shape."""
        shape = read_array(self.values, node.input[1]) if len(node.input) > 1 else None
        if shape is None or shape.ndim != 1 or not (shape > 0).all() or source.factor is not None:
            return NOTHING
        shapes, found, tensor = self.graph.shapes(), None, source.tensor
        while True:
            readers = self.graph.consumers.get(tensor, [])
            if len(readers) != 1 or readers[0].name in self.present or not _keeps_order(readers[0], shapes):
                break
            tensor = readers[0].output[0]
            if shapes.get(tensor) == [int(d) for d in shape]:
                found = tensor
        return NOTHING if found is None else Meaning(found, source.integer, grid=source.grid)

    def block_max(self, node: onnx.NodeProto) -> Meaning:
        """qprep's float MaxPool (qdq/float_maxpool.py): ReduceMax(Reshape(x, [N, C, H/kh, kh, W/kw, kw]), axes
        [3, 5], keepdims 0) is the float model's MaxPool of x with kernel = strides = (kh, kw), no padding or
        dilation: the same maximum over the same windows."""
        reshape = self.producer.get(node.input[0])
        if reshape is None or reshape.op_type != "Reshape" or len(reshape.input) < 2:
            return NOTHING
        source, view = self.meaning(reshape.input[0]), read_array(self.values, reshape.input[1])
        axes = read_array(self.values, node.input[1]) if len(node.input) > 1 and node.input[1] else \
            attribute(node, "axes")
        dims = self.graph.shapes().get(source.tensor) if source.tensor is not None else None
        if (source.constant or source.factor is not None or view is None or view.shape != (6,) or axes is None
                or attribute(node, "keepdims", 1) != 0 or sorted(int(a) % 6 for a in np.ravel(axes)) != [3, 5]
                or not dims or len(dims) != 4 or None in dims):
            return NOTHING
        kernel = [int(view[3]), int(view[5])]
        if min(kernel) < 1 or dims[2] % kernel[0] or dims[3] % kernel[1] or [int(v) for v in view] != [
                dims[0], dims[1], dims[2] // kernel[0], kernel[0], dims[3] // kernel[1], kernel[1]]:
            return NOTHING
        pools = [c for c in self.graph.consumers.get(source.tensor, []) if c.op_type == "MaxPool" and c.domain in
                 ("", "ai.onnx") and (c.name == node.name or c.name not in self.present) and _block_pool(c) == kernel]
        return Meaning(pools[0].output[0], source.integer, grid=source.grid) if len(pools) == 1 else NOTHING

    def replacing(self, name: str) -> Meaning:
        """A result tensor named as a float node's output, that node gone from the result, and computed by
        nodes no float node twins from tensors that mean that node's inputs (or constants) alone: the
        quantizer's replacement of the node (dynamic MatMulInteger, an integer op) writing its output. From a
        smoothed input, only a MatMulInteger whose weights carry the factor (`smoothed_weights`)."""
        replaced = self.graph.producer.get(name)
        if replaced is None or replaced.name in self.present:
            return NOTHING
        allowed, seen, stack, factors, nodes = set(replaced.input) - {""}, set(), [name], set(), []
        while stack:
            tensor = stack.pop()
            meaning = self.meaning(tensor)
            if meaning.constant or (meaning.tensor in allowed and not meaning.integer) or tensor in seen:
                factors.add(meaning.factor)
                continue
            producer = self.producer.get(tensor)
            if meaning.tensor is not None and tensor != name or producer is None or len(seen) > 64:
                return NOTHING
            seen.add(tensor)
            nodes.append(producer)
            stack.extend(i for i in producer.input if i)
        factors.discard(None)
        if factors and (len(factors) > 1 or not self.smoothed_weights(nodes, replaced, _vector(factors.pop()))):
            return NOTHING
        return Meaning(name)

    def smoothed_weights(self, nodes: list[onnx.NodeProto], replaced: onnx.NodeProto, factor: np.ndarray) -> bool:
        """ORT's dynamic MatMul (DynamicQuantizeLinear → MatMulInteger(x, B) → Cast → Mul by x's scale times
        B's): B dequantized is the float weight with its rows times `factor`, within half a step."""
        integer = [n for n in nodes if n.op_type == "MatMulInteger"]
        scales = [i for n in nodes if n.op_type == "Mul" for i in n.input if i in self.values]
        weight = read_array(self.graph.values, replaced.input[1], LARGE) if replaced.op_type == "MatMul" else None
        if len(integer) != 1 or len(scales) != 1 or weight is None or weight.ndim != 2:
            return False
        b = read_array(self.values, integer[0].input[1], LARGE)
        zero = read_array(self.values, integer[0].input[3], LARGE) if len(integer[0].input) > 3 else np.zeros(())
        scale = read_array(self.values, scales[0], LARGE)
        if b is None or zero is None or scale is None or b.shape != weight.shape:
            return False
        dequantized = (b.astype(np.float64) - zero.astype(np.float64)) * scale.astype(np.float64)
        return factor.size == weight.shape[0] and within_rounding(dequantized, factor[:, None] * weight, scale / 2)

    def twin_outputs(self, node: onnx.NodeProto, twin: onnx.NodeProto, inputs: list[Meaning]) -> list[Meaning]:
        """The twin's outputs, if every input means the twin's (or both are constants)."""
        data = [m for m in inputs if not m.constant]
        if len(node.input) != len(twin.input) or any(
                not _same_input(m, name, self.graph) for m, name in zip(inputs, twin.input)):
            return [NOTHING] * len(node.output)
        factor = self.scaling(node, twin, inputs)
        if factor is False:
            return [NOTHING] * len(node.output)
        integer = any(m.integer for m in data)
        if integer and (node.op_type not in DATA_MOVEMENT or not all(m.integer for m in data)):
            return [NOTHING] * len(node.output)
        if len(node.output) != len(twin.output):
            return [NOTHING] * len(node.output)
        grids = {m.grid for m in data if m.integer}
        if len(grids) > 1:  # integers on different grids moved together (a Concat): no one grid reads them
            return [NOTHING] * len(node.output)
        grid = grids.pop() if grids else None
        return [Meaning(self.renamed(float_name, name) if name != float_name else name, integer, grid=grid,
                        factor=factor) for name, float_name in zip(node.output, twin.output)]

    def scaling(self, node: onnx.NodeProto, twin: onnx.NodeProto, inputs: list[Meaning]) -> bytes | None | bool:
        """The output's per-channel factor (None: the float value itself), False if the constants differ beyond
        rounding in a way no rule explains. A smoothed LayerNorm (qprep's smooth_layernorm) divides gamma and
        beta by a factor per channel and multiplies the next MatMul's rows by it: the LayerNorm (or its Mul and
        Add) means the float tensor times 1/factor, the MatMul the float tensor itself."""
        factors = [_vector(m.factor) for m in inputs if not m.constant and m.factor is not None]
        pairs = [(ours, theirs) for ours, theirs, m in zip(node.input, twin.input, inputs)
                 if m.constant and ours and theirs]
        if node.op_type in ("QuantizeLinear", "DequantizeLinear"):
            return next((m.factor for m in inputs if m.factor is not None), None)
        if node.op_type in WEIGHTED:  # a MatMul whose rows carry the factor: the float value itself
            weight = self.constant(node.input[1]) if node.op_type == "MatMul" and len(pairs) == 1 else None
            other = read_array(self.graph.values, twin.input[1], LARGE)
            return None if not factors or (weight is not None and other is not None and inputs[0].factor
                                           and weight[0].shape == other.shape and other.ndim == 2  # GPTQ: a step
                                           and within_rounding(weight[0], factors[0][:, None] * other, weight[1])) \
                else False
        factor, close = factors[0] if factors else None, all(self.close_constant(o, t) for o, t in pairs)
        if factor is None and close:
            return None
        if len(factors) > 1 or not pairs or node.op_type not in ("Mul", "Add", "LayerNormalization"):
            return False
        if node.op_type == "Mul" and close:
            return _bytes(factor)
        values = [((self.constant(o) or (None,))[0], read_array(self.graph.values, t, LARGE)) for o, t in pairs]
        if any(v is None or w is None or v.size != w.size for v, w in values):
            return False
        (ours, theirs), *rest = [(v.reshape(-1).astype(np.float64), w.reshape(-1).astype(np.float64))
                                 for v, w in values]
        if node.op_type == "Add":  # x·f + theirs = (x + ours)·f
            return _bytes(factor) if factor is not None and len(pairs) == 1 and within_rounding(factor * ours, theirs) \
                else False
        if factor is not None and node.op_type == "LayerNormalization":
            return False
        ratio = np.where(ours == 0, 1.0, theirs / np.where(ours == 0, 1.0, ours))
        if not within_rounding(ours * ratio, theirs) or any(not within_rounding(ratio * v, w) for v, w in rest):
            return False  # (a LayerNormalization's beta scaled as its gamma)
        return _bytes(ratio * (factor if factor is not None else 1.0))

    def renamed(self, computed: str, name: str) -> str | None:
        """A twin's output renamed to the float tensor `name`: what it holds, from the float nodes the result
        removed between `computed` and `name` (module doc); a name the float model lacks: the twin's value."""
        if name not in self.graph.producer:
            return computed
        chain, tensor = [], computed
        while tensor != name:
            readers = self.graph.consumers.get(tensor, [])
            if len(readers) != 1 or readers[0].name in self.present or not readers[0].output:
                return None
            chain.append(readers[0])
            tensor = readers[0].output[0]
        kinds = {n.op_type for n in chain}
        if kinds <= set(FOLDED):
            return name
        if len(chain) == 1 and kinds <= set(ACTIVATIONS):
            return computed  # the Q/DQ that follows applies the activation (quantized below)
        return None

    def quantized(self, node: onnx.NodeProto, source: Meaning) -> Meaning:
        """A QuantizeLinear's output: its input's meaning as integers, or a removed activation's output."""
        if source.tensor is None or source.integer or source.constant:
            return NOTHING
        readers = self.graph.consumers.get(source.tensor, [])
        grid = q_grid(self.values, node)
        if source.factor is not None:
            return Meaning(source.tensor, integer=True, grid=grid, factor=source.factor)
        if len(readers) != 1 or readers[0].op_type not in ACTIVATIONS or readers[0].name in self.present:
            return Meaning(source.tensor, integer=True, grid=grid)
        activation = readers[0]
        if clamps_like(node, activation, self.values, self.graph.values):
            return Meaning(activation.output[0], integer=True, grid=grid)
        self.graph.unclamped.add(activation.output[0])
        return NOTHING

    def dequantized(self, node: onnx.NodeProto, source: Meaning) -> Meaning:
        """Integers read on the grid they were quantized on mean what they meant. On a grid whose scale is the
        quantizing one times 1/c (the zero point the same), they mean the float model's division by the scalar
        c (or multiplication by 1/c) of that tensor, where the result removed it (qprep's scaled round trip)."""
        grid = q_grid(self.values, node)
        if not source.integer or grid is None or source.grid is None:
            return NOTHING
        if grid == source.grid:
            return Meaning(source.tensor, factor=source.factor)
        if source.factor is not None:
            return NOTHING
        if grid[1] != source.grid[1] or grid[0][1] != () and grid[0][1] != (1,) or source.grid[0][1] not in ((), (1,)):
            return NOTHING
        ratio = float(np.frombuffer(grid[0][2], grid[0][0])[0]) / float(
            np.frombuffer(source.grid[0][2], source.grid[0][0])[0])
        readers = self.graph.consumers.get(source.tensor, [])
        if len(readers) != 1 or readers[0].op_type not in ("Mul", "Div") or readers[0].name in self.present:
            return NOTHING
        scaling = readers[0]
        other = [i for i in scaling.input if i != source.tensor]
        constant = read_array(self.graph.values, other[0]) if len(other) == 1 else None
        if constant is None or constant.size != 1 or (scaling.op_type == "Div" and scaling.input[0] != source.tensor):
            return NOTHING
        factor = float(constant.reshape(-1)[0])
        if factor == 0 or not np.isfinite(factor):  # a scaling by 0 (or inf) undoes no grid
            return NOTHING
        factor = 1 / factor if scaling.op_type == "Div" else factor
        return Meaning(scaling.output[0]) if abs(ratio / factor - 1) < 1e-4 else NOTHING

    def structural_twin(self, node: onnx.NodeProto, inputs: list[Meaning]) -> onnx.NodeProto | None:
        """The one float node of the same op type and attributes reading the same meanings, whose constant
        inputs equal the node's: a node the result added in place of it."""
        first = next((m for m in inputs if not m.constant), None)
        if first is None or first.tensor is None:
            return None
        attributes = op_attributes(node)
        found = [c for c in self.graph.consumers.get(first.tensor, [])
                 if c.op_type == node.op_type and c.domain == node.domain and c.name not in self.present
                 and len(c.input) == len(node.input)
                 and op_attributes(c) == attributes
                 and all(self.same_constant(name, m, theirs) if m.constant else m.tensor == theirs
                         for name, m, theirs in zip(node.input, inputs, c.input))]
        return found[0] if len(found) == 1 else None

    def close_constant(self, name: str, theirs: str) -> bool:
        """The result's constant is the float model's up to its rounding (half its grid step; channels a
        padding added beyond the float model's cut off). A constant either side computes (a shape), or one too
        large to read, is taken as the same. Smoothing a LayerNorm into the next MatMul scales its gamma and
        beta: that LayerNorm's output is not the float model's."""
        found, other = self.constant(name), read_array(self.graph.values, theirs, LARGE)
        if found is None or other is None:
            return True
        ours, step = found[0], np.broadcast_to(found[1], found[0].shape)
        if ours.ndim == other.ndim and all(a >= b for a, b in zip(ours.shape, other.shape)):
            ours, step = (a[tuple(slice(0, b) for b in other.shape)] for a in (ours, step))
        if ours.size != other.size:
            return False
        if other.dtype.kind != "f":
            return np.array_equal(ours.reshape(other.shape), other)
        ours, other, step = ours.astype(np.float64).reshape(-1), other.astype(np.float64).reshape(-1), step.reshape(-1)
        finite = np.isfinite(other)  # a mask's -inf: the same at the same places, never a difference (inf - inf)
        if not np.array_equal(finite, np.isfinite(ours)) or not np.array_equal(ours[~finite], other[~finite],
                                                                                equal_nan=True):
            return False
        return within_rounding(ours[finite], other[finite], step[finite] / 2)

    def constant(self, name: str) -> tuple[np.ndarray, np.ndarray] | None:
        return constant_value(self.values, self.producer, name)

    def same_constant(self, name: str, meaning: Meaning, theirs: str) -> bool:
        if name == theirs or (not name and not theirs):
            return True
        ours, other = self.values.get(name), self.graph.values.get(theirs)
        if other is None and theirs in self.graph.constants:
            return True  # computed from shapes in the float model, folded into the result
        if ours is None or other is None or element_count(ours) > SMALL or element_count(other) > SMALL:
            return False
        a, b = numpy_helper.to_array(ours), numpy_helper.to_array(other)
        return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)


def _keeps_order(node: onnx.NodeProto, shapes: dict) -> bool:
    """The node only regroups its input's elements, in their order."""
    if node.op_type in ("Reshape", "Flatten", "Squeeze", "Unsqueeze"):
        return True
    dims = shapes.get(node.input[0]) if node.op_type == "Transpose" else None
    if not dims or None in dims:
        return False
    perm = attribute(node, "perm", list(range(len(dims)))[::-1])
    moved = [axis for axis in perm if dims[axis] != 1]
    return moved == sorted(moved)


def _block_pool(node: onnx.NodeProto) -> list[int] | None:
    """A 2-D MaxPool's kernel if its windows tile the input (kernel = strides, no padding, dilation, ceil mode
    or Indices output), else None."""
    kernel = [int(k) for k in attribute(node, "kernel_shape", [])]
    if (len(kernel) != 2 or len([o for o in node.output if o]) != 1
            or [int(s) for s in attribute(node, "strides", [1, 1])] != kernel
            or any(attribute(node, "pads", [0] * 4)) or any(d != 1 for d in attribute(node, "dilations", [1, 1]))
            or attribute(node, "ceil_mode", 0) or attribute(node, "auto_pad", b"NOTSET") not in (b"NOTSET", b"VALID")):
        return None
    return kernel


def _same_input(meaning: Meaning, float_name: str, graph: FloatGraph) -> bool:
    if meaning.constant:
        return not float_name or float_name in graph.constants
    return meaning.tensor is not None and meaning.tensor == float_name


def _vector(factor: bytes) -> np.ndarray:
    return np.frombuffer(factor, np.float64)


def _bytes(factor: np.ndarray) -> bytes | None:
    return None if np.allclose(factor, 1.0, rtol=1e-3) else np.asarray(factor, np.float64).tobytes()


def _in_order(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """The nodes with every producer before its readers: one pass over the file's order where it is one (ONNX
    asks for it), more passes where not; what never gets ready (a cycle, an outer scope's input) comes last."""
    known, ordered, pending = {v.name for v in graph.input} | set(constant_tensors(graph)) | {""}, [], list(graph.node)
    while pending:
        left = []
        for node in pending:
            if all(i in known for i in node.input):
                ordered.append(node)
                known.update(node.output)
            else:
                left.append(node)
        if len(left) == len(pending):
            return ordered + left
        pending = left
    return ordered
