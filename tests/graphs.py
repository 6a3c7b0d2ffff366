"""The one tiny-graph builder of the tests: value infos, initializers, opset and shape inference written once,
the tiny models several test files share, and helpers to apply a pass and compare with ONNX Runtime.

    make_model(nodes, inputs, outputs, initializers={}, opset=13, name="g", infer_shapes=True) → ModelProto
    make_graph(nodes, inputs, outputs, initializers={}, name="g") → GraphProto (If/Loop bodies, or a model
        whose opset list is unusual)
    value(name, shape=None, dtype=np.float32) → ValueInfoProto

inputs/outputs: names (unknown shape), (name, shape) or (name, shape, dtype) tuples (dtype a numpy dtype or a
TensorProto element type; float32 by default), or ready ValueInfoProtos. initializers: a name → array mapping
(the array's own dtype: np.float32(1), np.array([3], np.int64)) or a sequence of TensorProtos."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnx_ir as ir
from onnx import helper, numpy_helper

from qprep.optimize.passes import PassSettings
from qprep.model.runtime import run_model


def value(name: str, shape=None, dtype=np.float32) -> onnx.ValueInfoProto:
    """A tensor value info; `shape` None is an unknown shape, its entries ints or symbolic names."""
    elem = dtype if isinstance(dtype, int) else helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    return helper.make_tensor_value_info(name, elem, shape)


def _values(specs) -> list[onnx.ValueInfoProto]:
    out = []
    for spec in specs:
        if isinstance(spec, onnx.ValueInfoProto):
            out.append(spec)
        elif isinstance(spec, str):
            out.append(value(spec))
        else:
            out.append(value(*spec))
    return out


def _initializers(initializers) -> list[onnx.TensorProto]:
    if isinstance(initializers, dict):
        return [numpy_helper.from_array(np.asarray(v), k) for k, v in initializers.items()]
    return list(initializers)


def make_graph(nodes, inputs=(), outputs=(), initializers=(), name: str = "g") -> onnx.GraphProto:
    return helper.make_graph(list(nodes), name, _values(inputs), _values(outputs), _initializers(initializers))


def make_model(nodes, inputs, outputs, initializers=(), opset: int = 13, name: str = "g",
               infer_shapes: bool = True) -> onnx.ModelProto:
    """A model of the default domain at `opset`; with `infer_shapes`, onnx's shape inference has filled in the
    intermediate value infos (as qprep's own prepare step would)."""
    graph = make_graph(nodes, inputs, outputs, initializers, name)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    return onnx.shape_inference.infer_shapes(model) if infer_shapes else model


# the tiny models several test files share

def tiny_conv_model(batch="N", opset: int = 13) -> onnx.ModelProto:
    """x[N,3,8,8] → Conv(4, 3x3, pads 1) → Relu → y[N,4,8,8], unnamed nodes on purpose."""
    rng = np.random.default_rng(0)
    return make_model([helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
                       helper.make_node("Relu", ["c"], ["y"])],
                      [("x", [batch, 3, 8, 8])], [("y", [batch, 4, 8, 8])],
                      {"w": rng.standard_normal((4, 3, 3, 3)).astype(np.float32),
                       "b": rng.standard_normal(4).astype(np.float32)},
                      opset=opset, name="tiny", infer_shapes=False)


def two_input_model() -> onnx.ModelProto:
    """ids:int64[N,S], mask:float[N,S] → Gather(emb) * mask → y[N,S,4]: integer + float inputs."""
    return make_model([helper.make_node("Gather", ["emb", "ids"], ["g"]),
                       helper.make_node("Unsqueeze", ["mask", "axes"], ["m"]),
                       helper.make_node("Mul", ["g", "m"], ["y"])],
                      [("ids", ["N", "S"], np.int64), ("mask", ["N", "S"])], [("y", ["N", "S", 4])],
                      {"emb": np.arange(40, dtype=np.float32).reshape(10, 4), "axes": np.array([-1], np.int64)},
                      name="two", infer_shapes=False)


# applying a pass, comparing with ONNX Runtime

def apply_pass(graph_pass, model: onnx.ModelProto, settings: PassSettings | None = None):
    """(rewritten proto, outcome); the input proto is left untouched."""
    ir_model = ir.from_proto(model)
    outcome = graph_pass.apply(ir_model, settings or PassSettings())
    return ir.to_proto(ir_model), outcome


def ops(model: onnx.ModelProto) -> Counter:
    return Counter(n.op_type for n in model.graph.node)


def max_diff(a: onnx.ModelProto, b: onnx.ModelProto, feeds: dict) -> float:
    ra, rb = run_model(a, [feeds])[0], run_model(b, [feeds])[0]
    return max(float(np.abs(ra[k].astype(np.float64) - rb[k]).max()) for k in ra)


def rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def masked_attention_model(fill: float = -np.inf, style: str = "where", seq: int = 6, dim: int = 8,
                           layers: int = 1) -> onnx.ModelProto:
    """One attention head whose padding is masked additively, as real exports write it:
    style "where": torch's `Where(Not(mask), fill, 0)`; "scale": HF's `(1 - mask) * fill` (fill: finfo.min).
    x[1,seq,dim], mask[1,seq] (float 0/1: 1 = a real token) → y[1,seq,dim]. `layers` > 1: more heads after it,
    each reading the one before and the same mask, with queries 10× smaller (their scores rise less)."""
    rng = np.random.default_rng(0)
    if style == "where":
        masking = [helper.make_node("Cast", ["mask"], ["mask_bool"], to=onnx.TensorProto.BOOL, name="mask_cast"),
                   helper.make_node("Not", ["mask_bool"], ["padding"], name="mask_not"),
                   helper.make_node("Where", ["padding", "fill", "zero"], ["additive"], name="mask_where")]
        constants = {"fill": np.array(fill, np.float32), "zero": np.array(0.0, np.float32)}
    else:
        masking = [helper.make_node("Sub", ["one", "mask"], ["padding"], name="mask_invert"),
                   helper.make_node("Mul", ["padding", "fill"], ["additive"], name="mask_scale")]
        constants = {"fill": np.array(fill, np.float32), "one": np.array(1.0, np.float32)}
    weights = {f"w{n}": (rng.standard_normal((dim, dim)) / np.sqrt(dim)).astype(np.float32) for n in "qkv"}
    nodes = [helper.make_node("MatMul", ["x", "wq"], ["q"], name="q"),
             helper.make_node("MatMul", ["x", "wk"], ["k"], name="k"),
             helper.make_node("MatMul", ["x", "wv"], ["v"], name="v"),
             helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1], name="kt"),
             helper.make_node("MatMul", ["q", "kt"], ["scores"], name="scores"),
             *masking,
             helper.make_node("Unsqueeze", ["additive", "axis1"], ["additive_rows"], name="mask_rows"),
             helper.make_node("Add", ["scores", "additive_rows"], ["masked"], name="mask_add"),
             helper.make_node("Softmax", ["masked"], ["attention"], axis=-1, name="softmax"),
             helper.make_node("MatMul", ["attention", "v"], ["context"], name="context"),
             helper.make_node("Add", ["context", "x"], ["y"], name="residual")]
    for layer in range(2, layers + 1):
        x, y = "y" if layer == 2 else f"y_{layer - 1}", f"y_{layer}"
        weights.update({f"w{n}_{layer}": weights[f"w{n}"] * (0.1 if n == "q" else 1.0) for n in "qkv"})
        nodes += [helper.make_node("MatMul", [x, f"wq_{layer}"], [f"q_{layer}"], name=f"q_{layer}"),
                  helper.make_node("MatMul", [x, f"wk_{layer}"], [f"k_{layer}"], name=f"k_{layer}"),
                  helper.make_node("MatMul", [x, f"wv_{layer}"], [f"v_{layer}"], name=f"v_{layer}"),
                  helper.make_node("Transpose", [f"k_{layer}"], [f"kt_{layer}"], perm=[0, 2, 1], name=f"kt_{layer}"),
                  helper.make_node("MatMul", [f"q_{layer}", f"kt_{layer}"], [f"scores_{layer}"], name=f"scores_{layer}"),
                  helper.make_node("Add", [f"scores_{layer}", "additive_rows"], [f"masked_{layer}"],
                                   name=f"mask_add_{layer}"),
                  helper.make_node("Softmax", [f"masked_{layer}"], [f"attention_{layer}"], axis=-1,
                                   name=f"softmax_{layer}"),
                  helper.make_node("MatMul", [f"attention_{layer}", f"v_{layer}"], [f"context_{layer}"],
                                   name=f"context_{layer}"),
                  helper.make_node("Add", [f"context_{layer}", x], [y], name=f"residual_{layer}")]
    output = "y" if layers == 1 else f"y_{layers}"
    return make_model(nodes, [("x", [1, seq, dim]), ("mask", [1, seq])], [(output, [1, seq, dim])],
                      {**weights, **constants, "axis1": np.array([1], np.int64)}, name="masked_attention")


def masked_attention_samples(count: int, seq: int = 6, dim: int = 8) -> list[dict]:
    """Samples whose mask really masks: 2..seq real tokens, the rest padding."""
    rng = np.random.default_rng(1)
    samples = []
    for i in range(count):
        mask = np.zeros((1, seq), np.float32)
        mask[0, : 2 + i % (seq - 1)] = 1
        samples.append({"x": rng.standard_normal((1, seq, dim)).astype(np.float32), "mask": mask})
    return samples


def gated_model(shape=(1, 1), x="x.1"):
    """openWakeWord's verifier gate: p = Sigmoid(mean(x)); If p >= 0.5 then a second model reading the graph
    input `x` from the outer scope (with a branch initializer), else p itself."""
    size, rng = int(np.prod(shape)), np.random.default_rng(0)
    then = make_graph([helper.make_node("Flatten", [x], ["f"], name="flatten"),
                       helper.make_node("MatMul", ["f", "w"], ["m"], name="matmul"),
                       helper.make_node("Sigmoid", ["m"], ["p2"], name="sigmoid")],
                      outputs=[("p2", list(shape))], initializers={"w": rng.standard_normal((8, size)).astype(np.float32)})
    other = make_graph([helper.make_node("Identity", ["p1"], ["p"], name="identity")], outputs=[("p", list(shape))])
    nodes = [helper.make_node("ReduceMean", [x], ["mean"], axes=[2], keepdims=0, name="mean"),
             helper.make_node("Flatten", ["mean"], ["flat"], name="flat"),
             helper.make_node("MatMul", ["flat", "v"], ["logit"], name="head"),
             helper.make_node("Sigmoid", ["logit"], ["p1"], name="p1"),
             helper.make_node("ReduceMax", ["p1"], ["top"], keepdims=1, name="top"),
             helper.make_node("GreaterOrEqual", ["top", "half"], ["gate"], name="gate"),
             helper.make_node("If", ["gate"], ["y"], then_branch=then, else_branch=other, name="if")]
    return make_model(nodes, [(x, [1, 2, 4])], [("y", list(shape))],
                      {"v": rng.standard_normal((2, size)).astype(np.float32), "half": np.float32(0.5)})


def gated_samples(count=16, x="x.1"):
    """Samples that take both branches of gated_model."""
    return [{x: np.random.default_rng(i).standard_normal((1, 2, 4)).astype(np.float32) * 3} for i in range(count)]


def runtime_batchnorm_model(rank=3):
    """tf2onnx's Keras LayerNormalization: BatchNormalization over statistics computed from x."""
    shape, rng = ([1, 4, 8] if rank == 3 else [2, 4]), np.random.default_rng(0)
    axes = [0, 2] if rank == 3 else [0]
    nodes = [helper.make_node("ReduceMean", ["x"], ["mean"], axes=axes, keepdims=0, name="mean"),
             helper.make_node("ReduceMax", ["x"], ["top"], axes=axes, keepdims=0, name="top"),
             helper.make_node("Abs", ["top"], ["var"], name="var"),
             helper.make_node("BatchNormalization", ["x", "scale", "bias", "mean", "var"], ["y"], epsilon=1e-3,
                              name="bn")]
    return make_model(nodes, [("x", shape)], [("y", shape)],
                      {"scale": rng.standard_normal(4).astype(np.float32),
                       "bias": rng.standard_normal(4).astype(np.float32)})


def last_state_lstm_model(steps: int = 6, features: int = 5, hidden: int = 8, **attributes) -> onnx.ModelProto:
    """torch's LSTM export when only the last hidden state is used (Resemblyzer's speaker encoder): the sequence
    output Y left out ('' as output 0), Y_h → Gemm → y[1, 4]. `attributes` go on the LSTM (dynamo: layout=0)."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Transpose", ["x"], ["x_tbf"], perm=[1, 0, 2], name="to_time_major"),
             helper.make_node("LSTM", ["x_tbf", "w", "r", "b"], ["", "h_last"], hidden_size=hidden, name="lstm",
                              **attributes),
             helper.make_node("Squeeze", ["h_last", "zero"], ["h"], name="squeeze"),
             helper.make_node("Gemm", ["h", "head", "head_bias"], ["y"], transB=1, name="head")]
    weights = {"w": rng.standard_normal((1, 4 * hidden, features)) * 0.4,
               "r": rng.standard_normal((1, 4 * hidden, hidden)) * 0.4,
               "b": rng.standard_normal((1, 8 * hidden)) * 0.1,
               "head": rng.standard_normal((4, hidden)), "head_bias": rng.standard_normal(4)}
    initializers = {k: v.astype(np.float32) for k, v in weights.items()}
    initializers["zero"] = np.array([0], np.int64)
    return make_model(nodes, [("x", [1, steps, features])], [("y", [1, 4])], initializers,
                      opset=14 if "layout" in attributes else 13)  # (layout came in opset 14)


def log_power_model(with_mask: bool = False) -> onnx.ModelProto:
    """y = 10·log(Clip(x, 1e-10, +inf)) on a power x up to 1e7 (a log-mel front end), and with `with_mask` a
    Softmax over scores plus a -inf mask beside it."""
    nodes = [helper.make_node("Clip", ["x", "floor", "ceiling"], ["clamped"], name="clamp"),
             helper.make_node("Log", ["clamped"], ["log"], name="log"),
             helper.make_node("Mul", ["log", "ten"], ["y"], name="decibels")]
    constants = {"floor": np.array(1e-10, np.float32), "ceiling": np.array(np.inf, np.float32),
                 "ten": np.array(10.0, np.float32)}
    inputs, outputs = [("x", [1, 64])], [("y", [1, 64])]
    if with_mask:
        nodes += [helper.make_node("Add", ["scores", "fill"], ["masked"], name="mask_add"),
                  helper.make_node("Softmax", ["masked"], ["p"], name="softmax", axis=-1)]
        constants["fill"] = np.array([[0, 0, 0, -np.inf]], np.float32)
        inputs.append(("scores", [1, 4]))
        outputs.append(("p", [1, 4]))
    return make_model(nodes, inputs, outputs, constants)


def power_samples(count: int, seed: int = 0, with_mask: bool = False) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"x": (10.0 ** rng.uniform(2, 7, (1, 64))).astype(np.float32),
             **({"scores": rng.standard_normal((1, 4)).astype(np.float32)} if with_mask else {})}
            for _ in range(count)]


def outlier_model() -> onnx.ModelProto:
    """x[1,16] → MatMul → Mul(one channel × 1000) → MatMul → y: one per-tensor range for all channels, so the
    all-int8 result is far from FP32 and the fallback has nodes to keep float (nodes first, outlier, second)."""
    rng = np.random.default_rng(0)
    scale = np.ones(16, np.float32)
    scale[3] = 1000.0
    inits = {"w1": rng.standard_normal((16, 16)).astype(np.float32), "s": scale,
             "w2": (rng.standard_normal((16, 8)) / np.where(scale > 1, 1000, 1)[:, None]).astype(np.float32)}
    return make_model([helper.make_node("MatMul", ["x", "w1"], ["h"], name="first"),
                       helper.make_node("Mul", ["h", "s"], ["m"], name="outlier"),
                       helper.make_node("MatMul", ["m", "w2"], ["y"], name="second")],
                      [("x", [1, 16])], [("y", [1, 8])], inits, name="outlier", infer_shapes=False)
