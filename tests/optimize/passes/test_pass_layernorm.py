"""fuse_layernorm: every exported LayerNorm form fuses with the numbers kept; every broken precondition refuses.

Tiny graphs are built with onnx.helper the way each exporter writes them; ONNX Runtime checks the outputs
before/after. The real-model tests pin the counts on MiniLM (PyTorch, opset 14) and PP-OCRv4 rec (Paddle).
"""

from __future__ import annotations

from collections import Counter

import cv2
import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import CALIBRATION, demo_model
from graphs import make_model, value
from qprep.optimize.passes import PassSettings
from qprep.optimize.passes.layernorm import PASS, count_decomposed_layernorms
from qprep.graph.verify import cosine
from qprep.model.runtime import ort_session

SHAPE = [2, 8, 16]  # [batch, sequence, hidden]
RNG = np.random.default_rng(0)
GAMMA = RNG.uniform(0.5, 1.5, 16).astype(np.float32)
BETA = RNG.uniform(-0.5, 0.5, 16).astype(np.float32)


class Graph:
    """A tiny onnx.helper graph: `g.op("Add", a, b)` returns the output name; nodes are named '<scope>/<Op>_<i>'."""

    def __init__(self, opset: int = 17, scope: str = "/encoder/LayerNorm", dtype=TensorProto.FLOAT,
                 swap: bool = False):
        self.opset, self.scope, self.dtype, self.swap = opset, scope, dtype, swap
        self.nodes, self.initializers, self.inputs = [], [], []
        self.count = 0

    def _name(self, op_type: str) -> str:
        self.count += 1
        return f"{self.scope}/{op_type}_{self.count}"

    def input(self, name: str = "x", shape=SHAPE, dtype=None) -> str:
        self.inputs.append(value(name, shape, dtype or self.dtype))
        return name

    def init(self, value, dtype=np.float32) -> str:
        name = self._name("init")
        self.initializers.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def const(self, value, dtype=np.float32) -> str:
        """A Constant node, as paddle2onnx writes parameters."""
        name = self._name("Constant")
        self.nodes.append(helper.make_node("Constant", [], [name], name=name,
                                           value=numpy_helper.from_array(np.asarray(value, dtype=dtype))))
        return name

    def op(self, op_type: str, *inputs: str, **attrs) -> str:
        name = self._name(op_type)
        self.nodes.append(helper.make_node(op_type, list(inputs), [name], name=name, **attrs))
        return name

    def commutative(self, op_type: str, a: str, b: str) -> str:
        """Add/Mul/Max in the exporter's order, or the other one when the graph is built with swap=True."""
        return self.op(op_type, *((b, a) if self.swap else (a, b)))

    def mean(self, t: str, axes=(-1,), keepdims=None) -> str:
        """ReduceMean with axes as attribute (opset < 18) or input (18+), keepdims omitted unless given."""
        attrs = {} if keepdims is None else {"keepdims": keepdims}
        if self.opset >= 18:
            return self.op("ReduceMean", t, self.init(list(axes), np.int64), **attrs)
        return self.op("ReduceMean", t, axes=list(axes), **attrs)

    def model(self, output: str, extra_outputs=()) -> onnx.ModelProto:
        return make_model(self.nodes, self.inputs, [(o, None, self.dtype) for o in (output, *extra_outputs)],
                          self.initializers, opset=self.opset, name="ln")  # shapes inferred: the stage does it


def pytorch_ln(g: Graph, x: str, *, axes=(-1,), eps=1e-5, gamma=GAMMA, beta=BETA, square="Pow", exponent=2.0,
               normalize="Div", keepdims=None, param=None) -> str:
    """TorchScript's decomposition; `param` makes gamma/beta/eps/exponent (init | const); a parameter given
    as a name (a graph input) is used as it is."""
    make = param or g.init

    def param(v):
        return v if isinstance(v, str) else make(v)

    mean = g.mean(x, axes, keepdims)
    d = g.op("Sub", x, mean)
    sq = g.op("Pow", d, param(exponent)) if square == "Pow" else g.op("Mul", d, d)
    var = g.mean(sq, axes, keepdims)
    e = param(eps)
    std = g.op("Sqrt", g.commutative("Add", var, e))
    y = g.op("Div", d, std) if normalize == "Div" else g.commutative("Mul", d, g.op("Reciprocal", std))
    if gamma is not None:
        y = g.commutative("Mul", y, param(gamma))
    if beta is not None:
        y = g.commutative("Add", y, param(beta))
    return y


def tf_ln(g: Graph, x: str, *, eps=1e-3, gamma=GAMMA, beta=BETA, square="Mul") -> str:
    """tf.nn.batch_normalization through tf2onnx: x * s + (beta - mean * s), s = gamma * rsqrt(var + eps)."""
    mean = g.mean(x)
    d = g.op("Sub", x, mean)
    var = g.mean(g.op("Mul", d, d) if square == "Mul" else g.op("Pow", d, g.init(2.0)))
    s = g.op("Reciprocal", g.op("Sqrt", g.commutative("Add", var, g.init(eps))))
    if gamma is not None:
        s = g.commutative("Mul", s, g.init(gamma))
    scaled_mean = g.commutative("Mul", mean, s)
    shift = g.op("Sub", g.init(beta), scaled_mean) if beta is not None else g.op("Neg", scaled_mean)
    return g.commutative("Add", g.commutative("Mul", x, s), shift)


def jax_ln(g: Graph, x: str, *, eps=1e-6, gamma=GAMMA, beta=BETA, count=16, divide=False, zero=0.0) -> str:
    """Flax through jax2tf + tf2onnx: means as ReduceSum scaled by 1/N, var = max(0, E[x²] - E[x]²)."""
    def mean(t):
        total = g.op("ReduceSum", t, g.init([-1], np.int64))
        if divide:
            return g.op("Div", total, g.init(float(count)))
        return g.commutative("Mul", total, g.init(1.0 / count))

    m = mean(x)
    var = g.commutative("Max", g.init(zero), g.op("Sub", mean(g.op("Mul", x, x)), g.op("Mul", m, m)))
    multiplier = g.op("Reciprocal", g.op("Sqrt", g.commutative("Add", var, g.init(eps))))
    if gamma is not None:
        multiplier = g.commutative("Mul", multiplier, g.init(gamma))
    y = g.commutative("Mul", g.op("Sub", x, m), multiplier)
    return g.commutative("Add", y, g.init(beta)) if beta is not None else y


def fuse(proto: onnx.ModelProto, settings: PassSettings = PassSettings()):
    model = ir.from_proto(proto)
    outcome = PASS.apply(model, settings)
    return outcome, ir.to_proto(model)


def ops(model: onnx.ModelProto) -> Counter:
    return Counter(n.op_type for n in model.graph.node)


def layernorm_node(model: onnx.ModelProto) -> onnx.NodeProto:
    (node,) = [n for n in model.graph.node if n.op_type == "LayerNormalization"]
    return node


def attr(node: onnx.NodeProto, name: str):
    return next(helper.get_attribute_value(a) for a in node.attribute if a.name == name)


def feeds_for(model: onnx.ModelProto) -> dict:
    rng = np.random.default_rng(1)
    return {i.name: (rng.standard_normal(SHAPE) * 3 + 1).astype(np.float32) for i in model.graph.input}


def assert_same_outputs(before: onnx.ModelProto, after: onnx.ModelProto, feeds: dict, atol: float = 1e-5):
    reference = ort_session(before).run(None, feeds)
    result = ort_session(after).run(None, feeds)
    for a, b in zip(reference, result):
        assert np.abs(a.astype(np.float64) - b).max() <= atol
        assert cosine(a, b) > 0.999999


def assert_fused(proto, *, epsilon, axis=-1, form="pytorch", settings=PassSettings()) -> onnx.ModelProto:
    """One LayerNormalization with the graph's epsilon (as float32) and axis, no reduction or dead Constant left,
    a valid model, the same outputs."""
    outcome, fused = fuse(proto, settings)
    assert outcome.matches == 1, outcome.details
    assert outcome.details["forms"] == {form: 1}
    counts = ops(fused)
    assert counts["LayerNormalization"] == 1
    assert counts["ReduceMean"] == counts["ReduceSum"] == 0
    used = {i for n in fused.graph.node for i in n.input}
    assert all(n.output[0] in used for n in fused.graph.node if n.op_type == "Constant")  # eps/2.0 removed
    node = layernorm_node(fused)
    assert attr(node, "epsilon") == float(np.float32(epsilon))  # the graph's float32, bit for bit
    assert attr(node, "axis") == axis
    assert outcome.details["axes"] == [axis]
    onnx.checker.check_model(fused, full_check=True)
    assert fused.opset_import[0].version >= 17
    assert_same_outputs(proto, fused, feeds_for(proto))
    return fused


def assert_refused(proto, reason: str | None = None, settings=PassSettings()):
    """Nothing fused, the model byte-identical, and (when the check refused) the reason in the record."""
    model = ir.from_proto(proto)
    before = ir.to_proto(model).SerializeToString()
    outcome = PASS.apply(model, settings)
    assert outcome.matches == 0
    assert ir.to_proto(model).SerializeToString() == before
    if reason is not None:  # the one LayerNorm is refused once, for this reason
        (recorded,) = outcome.details["refused"].items()
        assert reason in recorded[0] and recorded[1] == 1, outcome.details
    return outcome


# --- PyTorch / Paddle form ---------------------------------------------------------------------------------


@pytest.mark.parametrize("opset, keepdims", [(14, None), (14, 1), (18, None), (18, 1)])
def test_pytorch_form_axes_attribute_or_input_keepdims_default_or_explicit(opset, keepdims):
    g = Graph(opset=opset)
    proto = g.model(pytorch_ln(g, g.input(), keepdims=keepdims))
    fused = assert_fused(proto, epsilon=1e-5)
    node = layernorm_node(fused)
    assert node.name == "/encoder/LayerNorm/LayerNormalization"
    assert node.output[0] == proto.graph.output[0].name  # the graph output keeps its name


def test_two_layernorms_in_one_scope_get_unique_names():
    g = Graph()
    proto = g.model(pytorch_ln(g, g.op("Relu", pytorch_ln(g, g.input(), eps=1e-6))))
    outcome, fused = fuse(proto)
    assert outcome.matches == 2 and outcome.details["epsilons"] == [1e-6, 1e-5]
    names = [n.name for n in fused.graph.node if n.op_type == "LayerNormalization"]
    assert names == ["/encoder/LayerNorm/LayerNormalization", "/encoder/LayerNorm/LayerNormalization_1"]
    assert_same_outputs(proto, fused, feeds_for(proto))


def test_below_opset_17_upgrades_and_records_it():
    g = Graph(opset=14)
    outcome, fused = fuse(g.model(pytorch_ln(g, g.input())))
    assert outcome.details["opset_upgraded_from"] == 14
    assert fused.opset_import[0].version == 17


def test_max_opset_below_17_forbids_the_upgrade():
    g = Graph(opset=14)
    outcome = assert_refused(g.model(pytorch_ln(g, g.input())), settings=PassSettings(max_opset=16))
    assert outcome.details["skipped"] == "opset 14 < 17 and max_opset 16 forbids the upgrade"


@pytest.mark.parametrize("eps", [1e-3, 1e-12])
def test_mul_square_and_reciprocal_carry_a_non_default_epsilon(eps):
    g = Graph()
    proto = g.model(pytorch_ln(g, g.input(), eps=eps, square="Mul", normalize="Reciprocal"))
    assert_fused(proto, epsilon=eps)


@pytest.mark.parametrize("affine", [dict(), dict(beta=None), dict(gamma=None), dict(gamma=None, beta=None)])
def test_every_commutative_node_in_the_other_operand_order(affine):
    g = Graph(swap=True)
    assert_fused(g.model(pytorch_ln(g, g.input(), normalize="Reciprocal", **affine)), epsilon=1e-5)


@pytest.mark.parametrize("normalize", ["Div", "Reciprocal"])
def test_without_affine_creates_unit_scale_and_zero_bias_with_unique_names(normalize):
    g = Graph()
    x = g.input()
    g.initializers.append(numpy_helper.from_array(GAMMA, "/encoder/LayerNorm/LayerNormalization.scale"))
    y = g.op("Add", pytorch_ln(g, x, gamma=None, beta=None, normalize=normalize), g.op("Relu", x))
    fused = assert_fused(g.model(y), epsilon=1e-5)
    scale, bias = layernorm_node(fused).input[1:]
    assert scale == "/encoder/LayerNorm/LayerNormalization.scale_1"  # the taken name was not reused
    assert bias == "/encoder/LayerNorm/LayerNormalization.bias"
    arrays = {t.name: numpy_helper.to_array(t) for t in fused.graph.initializer}
    np.testing.assert_array_equal(arrays[scale], np.ones(16, np.float32))
    np.testing.assert_array_equal(arrays[bias], np.zeros(16, np.float32))


def test_gamma_only():
    g = Graph()
    fused = assert_fused(g.model(pytorch_ln(g, g.input(), beta=None)), epsilon=1e-5)
    assert numpy_helper.to_array(fused.graph.initializer[-1]).tolist() == [0.0] * 16


def test_paddle_constant_nodes_for_gamma_beta_and_eps():
    g = Graph(opset=12, scope="p2o")
    proto = g.model(pytorch_ln(g, g.input(), eps=1e-6, param=g.const))
    fused = assert_fused(proto, epsilon=1e-6)
    assert layernorm_node(fused).name == "p2o/LayerNormalization"
    assert ops(fused)["Constant"] == 2  # gamma and beta, now inputs of the LayerNormalization


def test_two_trailing_axes_and_positive_axes():
    g = Graph()
    gamma = RNG.uniform(0.5, 1.5, (8, 16)).astype(np.float32)
    assert_fused(g.model(pytorch_ln(g, g.input(), axes=(-2, -1), gamma=gamma, beta=gamma - 1)), epsilon=1e-5,
                 axis=-2)
    g = Graph()
    assert_fused(g.model(pytorch_ln(g, g.input(), axes=(2,))), epsilon=1e-5)


def test_broadcast_gamma_is_materialized_to_the_normalized_shape():
    g = Graph()
    fused = assert_fused(g.model(pytorch_ln(g, g.input(), gamma=GAMMA.reshape(1, 1, 16), beta=np.float32(0.25))),
                         epsilon=1e-5)
    scale, bias = layernorm_node(fused).input[1:]
    arrays = {t.name: numpy_helper.to_array(t) for t in fused.graph.initializer}
    assert arrays[scale].shape == arrays[bias].shape == (16,)


@pytest.mark.parametrize("dtype, np_dtype, atol", [(TensorProto.DOUBLE, np.float64, 1e-11),
                                                   (TensorProto.FLOAT16, np.float16, 1e-2)])
def test_double_and_float16_inputs(dtype, np_dtype, atol):
    """double stays double (1e-11: a float32 compute would miss by ~1e-7); float16 was computed in float16
    before and in float32 now (stash_type 1): closer to exact, not equal."""
    g = Graph(dtype=dtype)
    proto = g.model(pytorch_ln(g, g.input(), param=lambda v: g.init(v, np_dtype)))
    outcome, fused = fuse(proto)
    assert outcome.matches == 1
    node = layernorm_node(fused)
    assert attr(node, "stash_type") == 1
    onnx.checker.check_model(fused, full_check=True)
    x = np.random.default_rng(1).standard_normal(SHAPE).astype(np_dtype)
    assert_same_outputs(proto, fused, {"x": x}, atol=atol)


def test_untyped_input_gets_shape_inference_inside_the_pass():
    g = Graph()
    proto = g.model(pytorch_ln(g, g.op("Identity", g.input())))
    del proto.graph.value_info[:]
    outcome, _ = fuse(proto)
    assert outcome.matches == 1
    assert "shape_inference" in outcome.details


# --- TF/Keras and JAX forms ---------------------------------------------------------------------------------


@pytest.mark.parametrize("square, swap", [("Mul", False), ("Pow", False), ("Mul", True)])
def test_tf_folded_scale_form(square, swap):
    g = Graph(opset=13, swap=swap)
    assert_fused(g.model(tf_ln(g, g.input(), square=square)), epsilon=1e-3, form="tf")


def test_tf_form_without_gamma_and_center():
    g = Graph()
    assert_fused(g.model(tf_ln(g, g.input(), gamma=None, beta=None)), epsilon=1e-3, form="tf")


@pytest.mark.parametrize("swap", [False, True])
def test_jax_moments_form(swap):
    g = Graph(opset=13, swap=swap)
    assert_fused(g.model(jax_ln(g, g.input())), epsilon=1e-6, form="jax")


@pytest.mark.parametrize("swap", [False, True])
def test_jax_form_dividing_by_n_without_affine(swap):
    g = Graph(swap=swap)
    assert_fused(g.model(jax_ln(g, g.input(), divide=True, gamma=None, beta=None)), epsilon=1e-6, form="jax")


def jax2tf_ln(g: Graph, x: str, *, eps=1e-12, restore="Reshape+Expand", folded=False, mean_op="ReduceSum",
              inverse="Reciprocal", target=None) -> str:
    """Flax LayerNorm through jax2tf + tf2onnx as the zoo's export writes it (zoo_build/PATTERNS.md): keepdims=0
    reductions, each statistic brought back by Reshape + Expand (BroadcastTo) before it meets x, Max(0, ·) with
    the 0 first, gamma [1, 1, D] folded into the multiplier. `restore`: Reshape+Expand | Reshape | Unsqueeze |
    none; `folded`: the affine as x * s + (beta - mean * s); `target`: the Reshape target (default [B, S, 1])."""
    rows = SHAPE[:-1]
    target = target if target is not None else rows + [1]

    def mean(t):
        if mean_op == "ReduceMean":
            return g.op("ReduceMean", t, axes=[-1], keepdims=0)
        return g.op("Mul", g.op("ReduceSum", t, g.init([-1], np.int64), keepdims=0), g.init(1.0 / SHAPE[-1]))

    def back(stat):
        if restore == "none":
            return stat
        if restore == "Unsqueeze":
            return g.op("Unsqueeze", stat, g.init([-1], np.int64))
        reshaped = g.op("Reshape", stat, g.init(target, np.int64))
        return g.op("Expand", reshaped, g.init(target, np.int64)) if restore == "Reshape+Expand" else reshaped

    m = mean(x)
    var = g.op("Max", g.init(0.0), g.op("Sub", mean(g.op("Mul", x, x)), g.op("Mul", m, m)))
    var_eps = g.op("Add", back(var), g.init(eps))
    if inverse == "Reciprocal":
        rstd = g.op("Reciprocal", g.op("Sqrt", var_eps))
    elif inverse == "Pow":
        rstd = g.op("Pow", var_eps, g.init(-0.5))
    else:
        rstd = g.op("Div", g.init(1.0), g.op("Sqrt", var_eps))
    scale = g.op("Mul", rstd, g.init(GAMMA.reshape(1, 1, 16)))
    if folded:
        shift = g.op("Sub", g.init(BETA.reshape(1, 1, 16)), g.op("Mul", back(m), scale))
        return g.op("Add", g.op("Mul", x, scale), shift)
    return g.op("Add", g.op("Mul", g.op("Sub", x, back(m)), scale), g.init(BETA.reshape(1, 1, 16)))


@pytest.mark.parametrize("restore", ["Reshape+Expand", "Reshape", "Unsqueeze"])
def test_jax2tf_keepdims0_statistics_restored_by_reshape_expand_or_unsqueeze(restore):
    g = Graph(opset=15)
    fused = assert_fused(g.model(jax2tf_ln(g, g.input(), restore=restore)), epsilon=1e-12, form="jax")
    assert not {"Reshape", "Expand", "Unsqueeze"} & set(ops(fused))


@pytest.mark.parametrize("inverse", ["Pow", "Div"])
def test_inverse_square_root_as_pow_minus_half_or_one_over_sqrt(inverse):
    g = Graph(opset=15)
    assert_fused(g.model(jax2tf_ln(g, g.input(), inverse=inverse)), epsilon=1e-12, form="jax")


def test_jax2tf_folded_affine_with_moments_variance_and_restored_mean():
    g = Graph(opset=15)
    assert_fused(g.model(jax2tf_ln(g, g.input(), folded=True)), epsilon=1e-12, form="tf")


def test_reduce_mean_with_keepdims0_and_unsqueeze():
    g = Graph(opset=15)
    assert_fused(g.model(jax2tf_ln(g, g.input(), mean_op="ReduceMean", restore="Unsqueeze")), epsilon=1e-12,
                 form="jax")


def test_restored_statistics_with_dynamic_batch_and_sequence():
    """Reshape(var, Concat(Shape(x)[0], Shape(x)[1], 1)): dims proved equal to x's by their origin."""
    g = Graph(opset=15)
    x = g.input(shape=["B", "S", 16])
    shape = g.op("Shape", x)
    pieces = [g.op("Unsqueeze", g.op("Gather", shape, g.init(i, np.int64), axis=0), g.init([0], np.int64))
              for i in (0, 1)]
    target = g.op("Concat", *pieces, g.init([1], np.int64), axis=0)
    proto = g.model(_with_target(g, x, target))
    outcome, fused = fuse(proto)
    assert outcome.matches == 1, outcome.details
    for batch, seq in ((1, 3), (3, 8)):
        feeds = {"x": (np.random.default_rng(seq).standard_normal((batch, seq, 16)) * 3 + 1).astype(np.float32)}
        assert_same_outputs(proto, fused, feeds)


def _with_target(g: Graph, x: str, target: str) -> str:
    """jax2tf_ln's centered form with a computed Reshape target (no Expand)."""
    m = g.op("ReduceMean", x, axes=[-1], keepdims=0)
    var = g.op("Max", g.init(0.0), g.op("Sub", g.op("ReduceMean", g.op("Mul", x, x), axes=[-1], keepdims=0),
                                        g.op("Mul", m, m)))
    rstd = g.op("Reciprocal", g.op("Sqrt", g.op("Add", g.op("Reshape", var, target), g.init(1e-12))))
    centered = g.op("Sub", x, g.op("Reshape", m, target))
    return g.op("Add", g.op("Mul", centered, g.op("Mul", rstd, g.init(GAMMA))), g.init(BETA))


def test_refuses_keepdims0_statistic_that_meets_x_without_restoring():
    """x [8, 16, 16]: the mean over the last axis is [8, 16]; Sub(x, mean) runs but broadcasts it along the
    last axis, which is not a LayerNorm."""
    g = Graph(opset=15)
    assert_refused(g.model(jax2tf_ln(g, g.input(shape=[8, 16, 16]), restore="none")), "rank 2, not 3")


def test_refuses_statistic_reshaped_onto_the_wrong_axes():
    g = Graph(opset=15)
    proto = g.model(jax2tf_ln(g, g.input(shape=[8, 8, 16]), restore="Reshape", target=[1, 8, 8]))
    assert_refused(proto, "not the input's per-row shape")


# --- refusals ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("role", ["gamma", "beta"])
def test_refuses_gamma_or_beta_that_is_a_graph_input(role):
    g = Graph()
    x, param = g.input(), g.input(role, [16])
    y = pytorch_ln(g, x, **{role: param})
    assert_refused(g.model(y), f"{role} is not a constant")


@pytest.mark.parametrize("axes", [(1,), (-2,)])
def test_non_trailing_axes_fuse_between_transposes(axes):
    """magika_v3 (jax2tf) normalizes over axis -2; left decomposed, ORT quantized its Sqrt/Reciprocal/Mul and the
    model collapsed. The input is transposed to put the axis last, normalized, and transposed back; gamma/beta
    ([8, 1]: per position along that axis) become [8]."""
    g = Graph()
    gamma, beta = RNG.uniform(0.5, 1.5, (8, 1)).astype(np.float32), RNG.uniform(-0.5, 0.5, (8, 1)).astype(np.float32)
    fused = assert_fused(g.model(pytorch_ln(g, g.input(), axes=axes, gamma=gamma, beta=beta)), epsilon=1e-5)
    transposes = [n for n in fused.graph.node if n.op_type == "Transpose"]
    assert [attr(n, "perm") for n in transposes] == [[0, 2, 1], [0, 2, 1]]
    scale = next(t for t in fused.graph.initializer if t.name == layernorm_node(fused).input[1])
    assert list(scale.dims) == [8]


def test_non_trailing_axes_refused_when_gamma_varies_outside_them():
    g = Graph()
    gamma = RNG.uniform(0.5, 1.5, (8, 16)).astype(np.float32)  # varies along the kept axis too
    assert_refused(g.model(pytorch_ln(g, g.input(), axes=(1,), gamma=gamma, beta=None)), "varies outside")


def test_non_trailing_axes_of_unknown_rank_are_refused():
    g = Graph()
    assert_refused(g.model(pytorch_ln(g, g.input(shape=None), axes=(-2,), gamma=None, beta=None)),
                   "not the trailing axes of an input of unknown rank")


def test_positive_axes_need_a_known_rank():
    g = Graph()
    assert_refused(g.model(pytorch_ln(g, g.input(shape=None), axes=(2,))), "input rank is unknown")
    g = Graph()  # the same graph with negative axes is provably trailing
    outcome, _ = fuse(g.model(pytorch_ln(g, g.input(shape=None), axes=(-1,))))
    assert outcome.matches == 1


def test_refuses_reductions_over_different_axes():
    g = Graph()
    x = g.input()
    mean = g.mean(x, (-1,))
    d = g.op("Sub", x, mean)
    std = g.op("Sqrt", g.op("Add", g.mean(g.op("Mul", d, d), (-2, -1)), g.init(1e-5)))
    assert_refused(g.model(g.op("Div", d, std)), "reduce different axes")


@pytest.mark.parametrize("eps", [0.0, -1e-5, np.full((1, 1, 2), 1e-5), "graph input"])
def test_refuses_epsilon_that_is_not_a_positive_scalar_constant(eps):
    g = Graph()
    x = g.input()
    if isinstance(eps, str):
        eps = g.input("eps", [])
    assert_refused(g.model(pytorch_ln(g, x, eps=eps)), "epsilon is not a positive scalar constant")


def test_refuses_mismatched_epsilon_placement():
    """Add(eps) after Sqrt is a different function (sqrt(var) + eps): the pattern does not match it."""
    g = Graph()
    x = g.input()
    mean = g.mean(x)
    d = g.op("Sub", x, mean)
    std = g.op("Add", g.op("Sqrt", g.mean(g.op("Mul", d, d))), g.init(1e-5))
    assert_refused(g.model(g.op("Add", g.op("Mul", g.op("Div", d, std), g.init(GAMMA)), g.init(BETA))))


def test_refuses_pow_exponent_other_than_two():
    g = Graph()
    assert_refused(g.model(pytorch_ln(g, g.input(), exponent=3.0)), "Pow exponent")


@pytest.mark.parametrize("leak", ["mean", "deviation", "std"])
def test_refuses_an_intermediate_used_outside_the_pattern(leak):
    """The rewriter refuses these itself (nothing in the rule): deleting the node would break the other use."""
    g = Graph()
    x = g.input()
    mean = g.mean(x)
    d = g.op("Sub", x, mean)
    std = g.op("Sqrt", g.op("Add", g.mean(g.op("Pow", d, g.init(2.0))), g.init(1e-5)))
    y = g.op("Add", g.op("Mul", g.op("Div", d, std), g.init(GAMMA)), g.init(BETA))
    side = g.op("Relu", {"mean": mean, "deviation": d, "std": std}[leak])
    assert_refused(g.model(y, extra_outputs=[side]))


def test_refuses_gamma_varying_outside_the_normalized_axes():
    g = Graph()
    per_position = RNG.uniform(0.5, 1.5, (8, 16)).astype(np.float32)
    assert_refused(g.model(pytorch_ln(g, g.input(), gamma=per_position)), "varies outside the normalized axes")


def test_refuses_non_float_input():
    """Sqrt has no integer kernel, so such a graph is invalid ONNX (built without shape inference, which would
    refuse it); the check is what keeps the rule from trusting it."""
    g = Graph(dtype=TensorProto.INT32)
    x = g.input()
    mean = g.mean(x)
    d = g.op("Sub", x, mean)
    var = g.mean(g.op("Mul", d, d))
    y = g.op("Div", d, g.op("Sqrt", g.op("Add", var, g.init(1, np.int32))))
    proto = make_model(g.nodes, g.inputs, [(y, None, TensorProto.INT32)], g.initializers, opset=17, name="ln",
                       infer_shapes=False)
    assert_refused(proto, "not float")


def test_refuses_jax_mean_not_over_the_reduced_count():
    g = Graph()
    assert_refused(g.model(jax_ln(g, g.input(), count=15)), "not the mean over 16 elements")


def test_refuses_jax_variance_guard_other_than_zero():
    g = Graph()
    assert_refused(g.model(jax_ln(g, g.input(), zero=1e-3)), "Max(·, 0)")


# --- real models ---------------------------------------------------------------------------------------------


def _real_model_check(name: str, feeds: dict, expected: int):
    proto = onnx.shape_inference.infer_shapes(onnx.load(demo_model(name)))
    assert count_decomposed_layernorms(proto) == expected
    outcome, fused = fuse(proto)
    assert outcome.matches == expected, outcome.details
    assert ops(fused)["LayerNormalization"] == expected and ops(fused)["ReduceMean"] == 0
    assert fused.opset_import[0].version == 17
    onnx.checker.check_model(fused)
    assert count_decomposed_layernorms(fused) == 0
    assert_same_outputs(proto, fused, feeds, atol=1e-4)
    return outcome


@pytest.mark.slow
def test_minilm_fuses_13_and_is_upgraded_to_opset_17():
    sample = np.load(CALIBRATION / "minilm" / "calib" / "0000.npz")
    outcome = _real_model_check("minilm_l6_v2.onnx", dict(sample), 13)
    assert outcome.details["opset_upgraded_from"] == 14
    assert outcome.details["epsilons"] == [1e-12]


@pytest.mark.slow
def test_ppocrv4_rec_fuses_5():
    image = cv2.imread(str(CALIBRATION / "ocr_rec" / "calib" / "0000.png"))  # BGR, 48x320
    x = ((image.astype(np.float32) - 127.5) / 127.5).transpose(2, 0, 1)[None]
    outcome = _real_model_check("ppocrv4_rec.onnx", {"x": np.ascontiguousarray(x)}, 5)
    assert outcome.details["epsilons"] == [1e-6, 1e-5]


def test_count_does_not_touch_the_model():
    g = Graph(opset=14)
    proto = g.model(pytorch_ln(g, g.input()))
    before = proto.SerializeToString()
    assert count_decomposed_layernorms(proto) == 1
    assert proto.SerializeToString() == before
