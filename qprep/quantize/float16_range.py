"""Float16 range: a chain whose values overflow float16 scaled down by a power of two where it starts, and back
where it ends, so that it can run float16 on the RKNN NPU (which has no float32) instead of going int8.

Why: a log-mel front end fed 16-bit audio (openWakeWord's melspectrogram, the zoo's oww_melspectrogram) computes an
STFT of up to 1.3e6 and a power spectrum of up to 1.7e12 before its Log. float16 (max 65504) turns them into inf: the
toolkit's simulator warns "out of the float16" and the output misses by tens of dB where a frame overflowed, although
its cosine reads high on dB values far from zero. int8 cannot hold a power spectrum twelve decades wide in front of a
Log either (BENCHMARKS.md: "float16 range: an overflowing chain scaled"). The chain is homogeneous in its start: with
the STFT's weights times s, the power spectrum is s² times, and log(s²·x) = log x + 2·log s.

Pattern: every finite activation beyond float16's range; walking back from each through ops that carry a
scale, the nodes with a constant weight (Conv, MatMul, Gemm, Mul by a constant) that start its chain.
Forward from those, each tensor's degree (its values scale as s^degree): layout and pooling ops keep it, Mul
adds, Div subtracts, Pow multiplies, Add/Sub/Clip/Max/Min need one degree (their constants are scaled with
it). The chain ends where the degree goes back to 0: at a Log (an Add of -degree·log s after it), at a
LayerNormalization or InstanceNormalization (scale-free: its epsilon scaled by s^2·degree), at a Div of two
tensors of one degree; anywhere else a Mul by s^-degree restores the values (the node reading them, or an output).
Check: one power of two brings every tensor of the chain within float16 / HEADROOM on the calibration samples.
Replacement: the start nodes' weights and biases, the chain's constants and epsilons scaled, the Adds and Muls
above inserted. Verified in float32 on the calibration samples (exact up to rounding: s is a power of two); the
model is left as it was when its outputs change or no tensor came back within range.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from qprep.model.info import Links, unique_name
from qprep.model.runtime import intermediate_values, run_model
from qprep.quantize import nonfinite, rewrites
from qprep.quantize.backend import carried_float_set

log = logging.getLogger("qprep")

HEADROOM = 16.0  # the largest scaled value: float16's max / this (inputs louder than the calibration's)
BOUND = nonfinite.LIMIT / HEADROOM

# ops whose output scales as their first input does (their other inputs are shapes, indices, axes or slopes)
KEEPS = {"Transpose", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Identity", "Relu", "LeakyRelu", "PRelu",
         "MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool", "ReduceMax", "ReduceMin", "ReduceMean",
         "ReduceSum", "Slice", "Gather", "GatherElements", "Split", "Neg", "Abs", "DepthToSpace",
         "SpaceToDepth", "Expand", "Tile", "Resize"}
LINEAR = {"Conv", "ConvTranspose", "MatMul", "Gemm"}  # input 0 times input 1, plus a bias (input 2)
SAME_DEGREE = {"Add", "Sub", "Max", "Min", "Sum", "Concat", "Clip"}  # one degree for all: constants scaled to it
SCALE_FREE = {"LayerNormalization", "InstanceNormalization"}  # the same output for any scale of input 0
DEFAULT_EPSILON = 1e-5  # LayerNormalization's and InstanceNormalization's, when the node sets none
CARRIES = KEEPS | LINEAR | SAME_DEGREE | {"Mul", "Div", "Pow", "Sqrt", "Reciprocal"}


@dataclass
class Scaled:
    model: onnx.ModelProto
    record: dict = field(default_factory=dict)  # for the report; empty when nothing overflows
    float_nodes: dict[str, list[str]] = field(default_factory=dict)  # a node → it and the node added beside it
    chain: list[str] = field(default_factory=list)  # the nodes that compute the scaled chains

    def carried(self, float_set: set[str]) -> set[str]:
        """`float_set` with the added nodes beside float nodes (the Add after a float16 Log stays float16)."""
        return carried_float_set(float_set, self.float_nodes)


class _Unscalable(Exception):
    """The chain meets an op that cannot carry its scale: the model stays as it was."""


def scale(model: onnx.ModelProto, samples: list[dict], threads: int = 2) -> Scaled:
    """`model` with its float16-overflowing chains scaled into float16's range (see the module docstring), or
    the model itself, with the reason in `record`, when they cannot be or its outputs would change."""
    if not samples:
        return Scaled(model)
    found = nonfinite.find(model, samples, threads)
    over = [name for name, stats in found.tensors.items() if stats["kind"] == "activation" and not stats["nan"]
            and np.isfinite([stats["min"], stats["max"]]).all()]
    if not over:
        return Scaled(model)
    names = [node.name for node in model.graph.node]
    if "" in names or len(set(names)) < len(names):  # the pipeline names every node (model/prepare.py)
        return _left(model, over, "its nodes have no unique names")
    chain = _Chain(model)
    try:
        starts = chain.starts(over)
        degrees = chain.degrees(starts)
    except _Unscalable as exc:
        return _left(model, over, str(exc))
    largest = _largest(model, list(degrees), samples, threads)
    bounded = dict(degrees)
    for name, degree in chain.squared.items():  # a LayerNorm squares its input: the square must fit too
        bounded[f"{name} squared"], largest[f"{name} squared"] = 2 * degree, largest.get(name, 0.0) ** 2
    exponent = _exponent(bounded, largest)
    if exponent is None:
        return _left(model, over, "no power of two brings every tensor of its chain within float16")
    factor = 2.0 ** -exponent
    try:
        rewritten, added, plan = chain.rewrite(degrees, factor)
    except _Unscalable as exc:  # a constant it would scale is no tensor (a Constant's value_float)
        return _left(model, over, str(exc))
    mismatch = rewrites.exact("scaling a float16-overflowing chain", model, run_model(model, samples, threads),
                              rewritten, samples, threads)
    if mismatch:
        return _left(model, over, f"the outputs changed: {mismatch}")
    still = [name for name in over if name in nonfinite.find(rewritten, samples, threads).tensors]
    if len(still) == len(over):
        return _left(model, over, "no tensor came back within float16's range")
    peak = max(largest[name] * factor ** degree for name, degree in degrees.items())
    log.info("float16 range: %d overflowing tensors scaled by 2^-%d from %s (largest now %.4g)",
             len(over) - len(still), exponent, ", ".join(chain.started[:4]), peak)
    record = {"overflowing": len(over), "scaled": True, "scale": f"2^-{exponent}", "starts": chain.started,
              "largest_after": round(peak, 3), **plan, **({"still_overflowing": still} if still else {}),
              "verified_on": len(samples)}
    beside: dict[str, list[str]] = {}
    for new, node in added.items():
        beside.setdefault(node, [node]).append(new)
    return Scaled(rewritten, record, beside, chain.nodes)


def _left(model: onnx.ModelProto, over: list[str], reason: str) -> Scaled:
    log.info("float16 range: %d tensors overflow float16 and are left as they are: %s", len(over), reason)
    return Scaled(model, {"overflowing": len(over), "scaled": False, "reason": reason})


def _largest(model: onnx.ModelProto, names: list[str], samples: list[dict], threads: int) -> dict[str, float]:
    """Tensor → its largest finite |value| over `samples` (0 for a tensor the model does not compute)."""
    largest = dict.fromkeys(names, 0.0)
    for values in intermediate_values(model, names, samples, threads):
        for name, value in values.items():
            finite = np.abs(value[np.isfinite(value)]) if value.size else value
            if finite.size:
                largest[name] = max(largest[name], float(finite.max()))
    return largest


def _exponent(degrees: dict[str, float], largest: dict[str, float]) -> int | None:
    """The smallest k ≥ 1 that brings every tensor within BOUND at s = 2^-k (a tensor of negative degree grows
    as s shrinks: it bounds k from above); None when there is none."""
    low, high = 1, 1 << 10
    for name, degree in degrees.items():
        value = largest.get(name, 0.0)
        if value <= 0 or not degree:
            continue
        if degree > 0:
            low = max(low, math.ceil(math.log2(value / BOUND) / degree))
        else:
            high = min(high, math.floor(math.log2(BOUND / value) / -degree))
    return low if low <= high else None


class _Chain:
    """The model's producers, readers and constants, as the walks and the rewrite need them."""

    def __init__(self, model: onnx.ModelProto):
        self.model = model
        self.links = Links(model)
        self.constants = {t.name: t for t in model.graph.initializer}
        for node in model.graph.node:
            if node.op_type == "Constant":
                value = next((a.t for a in node.attribute if a.name == "value"), None)
                self.constants[node.output[0]] = value  # None: another form (value_float…), not scaled here
        self.exits: dict[str, float] = {}  # a chain tensor something outside the chain reads → its degree
        self.squared: dict[str, float] = {}  # a tensor a normalization reads → its degree (its square: twice)
        self.started: list[str] = []  # the start nodes whose input is not scaled already (their weights are)
        self.nodes: list[str] = []  # the nodes that compute the chain, in graph order (a Log at its end too)

    def is_constant(self, name: str) -> bool:
        return name in self.constants

    def array(self, name: str) -> np.ndarray:
        tensor = self.constants.get(name)
        if tensor is None:
            raise _Unscalable(f"constant '{name}' is not a tensor qprep can scale")
        return numpy_helper.to_array(tensor)

    def starts(self, overflowing: list[str]) -> set[str]:
        """The nodes with a constant weight that start the chains of the `overflowing` tensors, walking back
        through ops that carry a scale (each tensor once: a residual network's Adds fork every step)."""
        found: set[str] = set()
        seen: set[str] = set()
        for over in overflowing:
            stack = [over]
            while stack:
                name = stack.pop()
                if name in seen:
                    continue
                seen.add(name)
                node = self.links.producers.get(name)
                if node is None:
                    raise _Unscalable(f"'{over}' overflows float16 and its chain reaches the input '{name}' "
                                      f"before any node with a constant weight")
                if self.weighted(node):
                    found.add(node.name)
                    continue
                if node.op_type not in CARRIES:
                    raise _Unscalable(f"'{over}' overflows float16 and its chain meets {node.op_type} "
                                      f"'{node.name}', which cannot carry a scale")
                inputs = node.input[:1] if node.op_type in KEEPS | {"Pow"} else node.input
                stack.extend(i for i in inputs if i and not self.is_constant(i))
        return found

    def weighted(self, node: onnx.NodeProto) -> bool:
        """A Conv/MatMul/Gemm of an activation by a constant weight, or a Mul/Div of one by a constant."""
        inputs = list(node.input)
        if node.op_type in ("Conv", "ConvTranspose"):
            return len(inputs) > 1 and not self.is_constant(inputs[0]) and self.is_constant(inputs[1])
        if node.op_type == "Gemm" and len(inputs) > 2 and inputs[2] and not self.is_constant(inputs[2]):
            return False  # its bias C is an activation: C needs the scale as much as the product does
        if node.op_type in ("MatMul", "Gemm", "Mul", "Div"):  # W·x as well as x·W
            return len(inputs) > 1 and self.is_constant(inputs[0]) != self.is_constant(inputs[1])
        return False

    def degrees(self, starts: set[str]) -> dict[str, float]:
        """Tensor → degree (its values scale as s^degree) over the chains `starts` begin; the chain tensors that
        something outside the chain reads go to `exits`. Raises _Unscalable."""
        degrees: dict[str, float] = {}
        for node in self.model.graph.node:
            carried = [degrees.get(i, 0.0) for i in node.input]
            if node.name in starts and not any(carried):
                out = 1.0
                self.started.append(node.name)
            elif not any(carried):
                continue
            else:
                out = self.output_degree(node, carried)
            if out is None:  # the chain ends before this node: its scaled inputs are restored for it
                self.exits.update({i: d for i, d in zip(node.input, carried) if d})
                continue
            self.nodes.append(node.name)
            outputs = node.output[:1] if node.op_type == "MaxPool" else node.output  # its Indices: integers
            degrees.update({o: out for o in outputs if o and out})
            if node.op_type in SCALE_FREE and carried[0]:
                self.squared[node.input[0]] = carried[0]  # its variance: the input's square, in float16 too
        for name, degree in degrees.items():
            if name in self.links.outputs or name in self.links.in_subgraphs:
                self.exits[name] = degree
        return degrees

    def output_degree(self, node: onnx.NodeProto, carried: list[float]) -> float | None:
        """The degree of `node`'s outputs from its inputs' (0 for a constant or an unscaled input): the rules of
        the module docstring. 0 ends the chain inside the node; None before it (a Mul restores its input)."""
        op = node.op_type
        if op in KEEPS:
            if any(carried[1:]):
                raise _Unscalable(f"{op} '{node.name}' reads a scaled tensor as a shape, an index or a slope")
            return carried[0]
        if op in LINEAR:
            out = carried[0] + carried[1]
            if len(carried) > 2 and carried[2] != out and not self.is_constant(node.input[2]):
                raise _Unscalable(f"{op} '{node.name}' adds a bias of another scale")
            return out
        if op == "Mul":
            return carried[0] + carried[1]
        if op == "Div":
            return carried[0] - carried[1]
        if op == "Pow":
            if any(carried[1:]) or not self.is_constant(node.input[1]) or self.array(node.input[1]).size != 1:
                raise _Unscalable(f"Pow '{node.name}' has no constant scalar exponent")
            return carried[0] * float(self.array(node.input[1]).ravel()[0])
        if op == "Sqrt":
            return carried[0] / 2
        if op == "Reciprocal":
            return -carried[0]
        if op in SAME_DEGREE:
            scaled = {d for d, i in zip(carried, node.input) if i and not self.is_constant(i)}
            if op == "Clip":
                if any(a.name in ("min", "max") for a in node.attribute) or any(
                        i and not self.is_constant(i) for i in node.input[1:]):
                    raise _Unscalable(f"Clip '{node.name}' has bounds that are no constant tensors")
                scaled = {carried[0]}
            if len(scaled) > 1:
                raise _Unscalable(f"{op} '{node.name}' reads tensors of different scales")
            return scaled.pop()
        if op == "Log" or op in SCALE_FREE:
            if any(carried[1:]):
                raise _Unscalable(f"{op} '{node.name}' reads a scaled weight")
            return 0.0
        return None

    def rewrite(self, degrees: dict[str, float], factor: float
                ) -> tuple[onnx.ModelProto, dict[str, str], dict]:
        """The model with the chains scaled by `factor` (= s), the added nodes → the node each sits beside, and
        what was done (for the report)."""
        model = onnx.ModelProto()
        model.CopyFrom(self.model)
        graph = model.graph
        taken = {o for node in graph.node for o in node.output} | {t.name for t in graph.initializer} | {
            i.name for i in graph.input}
        node_names = {node.name for node in graph.node}
        plan: dict = {"log_offsets": {}, "epsilons": {}, "restored": {}}
        added: dict[str, str] = {}

        replaced: set[str] = set()

        def scaled_constant(name: str, power: float) -> str:
            """A copy of constant `name` times s^power (other readers keep it); itself when that changes
            nothing (inf, 0)."""
            original = self.array(name)
            scaled = (original.astype(np.float64) * factor ** power).astype(original.dtype)
            if np.array_equal(scaled, original):
                return name
            new = unique_name(f"{name}_scaled", taken)
            graph.initializer.append(numpy_helper.from_array(scaled, new))
            replaced.add(name)
            return new

        def constant(value: float, like: str) -> str:
            new = unique_name(like, taken)
            graph.initializer.append(numpy_helper.from_array(np.array(value, np.float32), new))
            return new

        readers, started = set(self.nodes), set(self.started)  # as degrees() found them
        renamed: dict[str, str] = {}  # an exit → the name it is computed under, scaled
        nodes = []
        for node in graph.node:
            carried = [degrees.get(i, 0.0) for i in node.input]
            out = degrees.get(node.output[0], 0.0) if node.output else 0.0
            if node.name in started:  # the chain's start: its weight (and bias) times s
                weight = next(k for k, i in enumerate(node.input[:2]) if self.is_constant(i))
                node.input[weight] = scaled_constant(node.input[weight], -1 if node.op_type == "Div" and weight else 1)
                if node.op_type in LINEAR and len(node.input) > 2 and node.input[2]:
                    node.input[2] = scaled_constant(node.input[2], 1)
            elif out and any(carried):  # constants read beside the scaled tensors take its degree
                if node.op_type in SAME_DEGREE:
                    for k, name in enumerate(node.input):
                        if name and self.is_constant(name) and self.array(name).dtype.kind == "f":
                            node.input[k] = scaled_constant(name, out)
                elif node.op_type in LINEAR and len(node.input) > 2 and self.is_constant(node.input[2]):
                    node.input[2] = scaled_constant(node.input[2], out)
            nodes.append(node)
            if node.op_type in SCALE_FREE and carried and carried[0]:
                epsilon = next((a for a in node.attribute if a.name == "epsilon"), None)
                if epsilon is None:
                    epsilon = helper.make_attribute("epsilon", DEFAULT_EPSILON)
                    node.attribute.append(epsilon)
                epsilon.f = float(epsilon.f * factor ** (2 * carried[0]))
                plan["epsilons"][node.name] = epsilon.f
            if node.op_type == "Log" and carried and carried[0]:  # log(s^d·x) - d·log s
                offset = -carried[0] * math.log(factor)
                scaled_log = unique_name(f"{node.output[0]}_scaled", taken)
                result, node.output[0] = node.output[0], scaled_log
                name = unique_name(f"{node.name}_unscaled", node_names)
                nodes.append(helper.make_node("Add", [scaled_log, constant(offset, f"{node.name}_offset")],
                                              [result], name=name))
                added[name] = node.name
                plan["log_offsets"][node.name] = round(offset, 6)
            for k, name in enumerate(node.output):
                if name in self.exits:  # computed scaled under another name, restored under its own
                    scaled_name = unique_name(f"{name}_scaled", taken)
                    node.output[k] = renamed[name] = scaled_name
                    restore = unique_name(f"{node.name}_restore", node_names)
                    nodes.append(helper.make_node(
                        "Mul", [scaled_name, constant(factor ** -self.exits[name], f"{restore}_factor")], [name],
                        name=restore))
                    if factor ** -self.exits[name] <= nonfinite.LIMIT:  # else float16 cannot hold the factor
                        added[restore] = node.name
                    plan["restored"][name] = self.exits[name]
        for node in nodes:  # chain readers read the scaled tensors; the others and the outputs the restored ones
            if node.name in readers:
                node.input[:] = [renamed.get(name, name) for name in node.input]
        del graph.node[:]
        graph.node.extend(nodes)
        still_read = {name for node in nodes for name in node.input} | self.links.in_subgraphs | self.links.outputs
        kept = [t for t in graph.initializer if t.name not in replaced or t.name in still_read]
        del graph.initializer[:]
        graph.initializer.extend(kept)
        for node in [n for n in nodes if n.op_type == "Constant" and n.output[0] in replaced - still_read]:
            graph.node.remove(node)
        return model, added, {key: value for key, value in plan.items() if value}
