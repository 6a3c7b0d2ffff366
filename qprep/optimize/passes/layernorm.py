"""fuse_layernorm: decomposed LayerNorm subgraphs → one ONNX `LayerNormalization` (opset 17).

Why: exporters below opset 17 (and TF/JAX converters at any opset) spell LayerNorm as a chain of ~9 ops. A
quantizer then calibrates and rounds every step of that chain (mean, deviation, variance, rsqrt) on its own,
which is where transformer accuracy goes; as one op it can be kept float or handled by the backend's kernel.

Math, over the trailing k axes (k = number of reduced axes):

    y = (x - E[x]) / sqrt(Var[x] + eps) * gamma + beta  ≡  LayerNormalization(x, gamma, beta, axis=-k, epsilon=eps)

Normalized axes that are not trailing (magika's jax2tf LayerNorm over axis -2; ONNX's op normalizes trailing axes
only): Transpose(x) putting them last → LayerNormalization → Transpose back, gamma/beta as their normalized dims.
Left decomposed, ORT quantizes that LayerNorm's Sqrt/Reciprocal/Mul (BENCHMARKS.md: "LayerNorms over axes that are
not trailing fused").

Forms: two families (`pattern`, `check`, `rewrite` kept separate), every part spelled any way an exporter does:

    centered  d = x - mean;  d / sqrt(var + eps)  or  d * inverse_std  [* gamma] [+ beta],  or Flax's
              d * (inverse_std * gamma) [+ beta]. torch.onnx (TorchScript), paddle2onnx, Flax via jax2tf.
    folded    x * s + (beta - mean * s),  s = inverse_std [* gamma];  no beta: + Neg(mean * s).
              tf.nn.batch_normalization / Keras via tf2onnx, and jax2tf's folded affine.
  with
    mean         ReduceMean(t), or ReduceSum(t) * (1/N) or / N (jax2tf)
    var          E[(x - mean)²] (square as Pow(·, 2) or Mul(d, d): TF's SquaredDifference), or
                 Max(E[x²] - mean², 0) (Flax)
    inverse_std  Reciprocal(Sqrt(var + eps)) (TF's Rsqrt), Pow(var + eps, -0.5), Div(1, Sqrt(var + eps))
    broadcast    a statistic may reach its use through Reshape/Unsqueeze [+ Expand] (keepdims=0 reductions
                 restored by jax2tf's Reshape + BroadcastTo) or Expand
The record names the spelling: pytorch (centered, E[(x-m)²]), jax (moments variance), tf (folded).

Preconditions (any miss leaves the subgraph untouched; the reason goes to the record):
  - x is float16/bfloat16/float/double (types come from shape inference, run here if missing);
  - every reduction reduces the same axes (positive ones need a known rank; non-trailing ones a known rank and
    static dims), all with the same keepdims;
  - a statistic reduced with keepdims=0 or reshaped/expanded meets x with x's rank and, dim by dim, x's
    leading dims and 1 (or x's own) on the normalized ones — dims proved equal by their origin
    (qprep/graph/dim_origin.py), so a statistic broadcast along the wrong axis is refused;
  - ReduceSum-based means divide by exactly the number of reduced elements (static dims needed);
  - eps is a positive scalar constant added to the variance under the square root; Pow exponents are 2
    (-0.5 for the inverse square root), a Div's numerator is 1, the variance guard is Max(·, 0);
  - gamma/beta are constants (initializer or Constant node, not graph inputs) of x's dtype that vary only
    along the normalized axes;
  - no intermediate value is used outside the subgraph (the rewriter itself refuses those).
LayerNormalization exists from opset 17: a model below it is converted first, only when something matches and
`settings.max_opset` allows it.

Where: this module holds the rules (each family's `pattern`, the shared `check` and `rewrite`), the pass, and
the readers `qprep inspect`, `qprep init` and keep_float use (the same rules, nothing fused). The pieces every
pattern is built from (how exporters spell mean, variance, inverse std, a restored broadcast) are in
layernorm_pattern.py; the check's graph reading (reduced axes, scalar constants, gamma/beta, the new node's
name) in layernorm_check.py.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass
from onnxscript.rewriter import MatchResult, RewriteRuleClassBase, RewriteRuleSet
from onnxscript.rewriter import pattern as orp

from qprep.graph.dim_origin import DimOrigins
from qprep.graph.ir import infer_shapes
from qprep.graph.rules import OpsetUpgrade, count_matches, names_in_use
from qprep.optimize.passes import GraphPass, PassOutcome, PassSettings
from qprep.optimize.passes.layernorm_check import (
    affine_follower,
    affine_param,
    reduced_axes,
    scalar,
    scope_name,
    static_dims,
)
from qprep.optimize.passes.layernorm_pattern import Statistics, either, restored

LAYERNORM_OPSET = 17
UPGRADE = OpsetUpgrade(
    LAYERNORM_OPSET, forbidden="opset {opset} < {target} and max_opset {max_opset} forbids the upgrade",
    failed="converting opset {opset} to {target} failed (onnx version converter); {found} LayerNorms left decomposed")
FLOAT_TYPES = frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE})
# Why a shorter form declines: the longer form saw this LayerNorm's affine step and refused it (e.g. gamma
# is a graph input). Fusing only the normalization would hide that refusal, so the whole LayerNorm stays.
DEFERS_TO_AFFINE = "followed by its own affine Mul/Add: the form with affine decides"


# ---------------------------------------------------------------------------------------------------------
# What the checks found, and the per-run log the rules write to
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Mean:
    """One mean over the normalized axes: ReduceMean(t), or ReduceSum(t) * factor (1/N) or / divisor (N)."""

    node: ir.Node
    factor: ir.Value | None = None
    divisor: ir.Value | None = None


@dataclass
class _Fusion:
    """Everything `rewrite` needs, decided by `check` from the graph alone."""

    form: str
    axis: int
    epsilon: float
    scale: ir.Value | np.ndarray  # an existing constant value, or an array for a new initializer
    bias: ir.Value | np.ndarray
    name: str  # of the new node; its new initializers are '<name>.scale' / '<name>.bias' (made unique)
    initializer_names: dict[str, str]
    root: ir.Node  # the matched node the new one replaces
    restored: int = 0  # Reshape/Unsqueeze/Expand nodes between statistics and their uses (jax2tf)
    perm: tuple[int, ...] | None = None  # normalized axes not trailing: x is transposed to put them last, and back


@dataclass
class _FusionLog:
    """Filled by the rules during one run: what was fused, and why the other candidates were not."""

    fused: list[_Fusion] = field(default_factory=list)
    refused: dict[ir.Node, str] = field(default_factory=dict)  # root node -> reason (last one wins)
    untyped: bool = False  # a candidate's input had no dtype: shape inference may let it through
    origins: DimOrigins = field(default_factory=DimOrigins)  # proves restored statistics' dims

    def details(self) -> dict:
        """The record. Facts appear only when there are some: the optimize stage keeps a round's latest
        non-numeric values, so an empty later round must not overwrite what an earlier one fused."""
        fused_roots = {f.root for f in self.fused}
        refused = Counter(reason for root, reason in self.refused.items() if root not in fused_roots)
        out: dict = {"fused": len(self.fused)}
        if self.fused:
            out["forms"] = dict(sorted(Counter(f.form for f in self.fused).items()))
            out["epsilons"] = sorted({_readable(f.epsilon) for f in self.fused})
            out["axes"] = sorted({f.axis for f in self.fused})
            with_restored = sum(1 for f in self.fused if f.restored)
            if with_restored:
                out["with_restored_broadcasts"] = with_restored
        if refused:
            out["refused"] = dict(sorted(refused.items()))
        return out


def _readable(epsilon: float) -> float:
    """The shortest decimal that is the same float32 (1e-12, not 9.999999960041972e-13)."""
    return float(str(np.float32(epsilon)))


# ---------------------------------------------------------------------------------------------------------
# The shared check and rewrite
# ---------------------------------------------------------------------------------------------------------

# Bindings the check proves, by name: a constant that must equal a value (Pow exponents, the variance guard, …).
EXPECTED_CONSTANTS = {"exponent": (2.0, "Pow exponent is not the constant 2"),
                      "x_exponent": (2.0, "Pow exponent is not the constant 2"),
                      "mean_exponent": (2.0, "Pow exponent is not the constant 2"),
                      "zero": (0.0, "the variance guard is not Max(·, 0)"),
                      "inverse_exponent": (-0.5, "the inverse square root's Pow exponent is not -0.5"),
                      "numerator": (1.0, "the inverse square root's numerator is not 1")}
USED_STATISTICS = ("mean_used", "var_used", "inverse_used", "mean_scaled")
RESTORING_OPS = frozenset({"Reshape", "Unsqueeze", "Expand"})


class _LayerNormRule(RewriteRuleClassBase):
    """Base of the families: they differ in `pattern`; `check` reads every binding by name."""

    form = ""

    def __init__(self, log: _FusionLog, *, scale: bool = True, bias: bool = True, swapped: bool = False,
                 variant: str = "") -> None:
        affine = "+".join(p for p, on in (("scale", scale), ("bias", bias)) if on) or "plain"
        parts = ["fuse_layernorm", self.form, affine, variant, "swapped" if swapped else ""]
        super().__init__(name=".".join(p for p in parts if p))
        self.scale, self.bias, self.swapped, self.variant = scale, bias, swapped, variant
        self._log = log
        self._found: _Fusion | None = None  # set by check, read by the rewrite of the same match

    def _steps_of_longer_forms(self) -> tuple[str, ...]:
        """Ops that, right after this rule's root, a longer form of the family would have matched too."""
        if self.bias:
            return ()
        return ("Add",) if self.scale else ("Mul", "Add")

    def _root(self, make, a, b):
        """The pattern's last node in this rule's operand order (the engine cannot root a pattern at a choice)."""
        return make(b, a) if self.swapped else make(a, b)

    def check(self, context, x, eps, gamma=None, beta=None, **bindings) -> MatchResult:
        """Run the common preconditions; on success leave the fusion in `self._found`."""
        result = self._verify(context, x, eps, gamma, beta, bindings)
        if isinstance(result, _Fusion):
            self._found = result
            return MatchResult()
        if result.reason != DEFERS_TO_AFFINE:
            self._log.refused[context.root] = result.reason
        return result

    def _spelling(self, bindings) -> str:
        """The record's name for what matched: tf (folded shift), jax (moments variance), pytorch."""
        if self.form == "tf":
            return "tf"
        return "jax" if bindings.get("square_mean") or bindings.get("square_sum") else "pytorch"

    def _verify(self, context, x, eps, gamma, beta, bindings) -> _Fusion | MatchResult:
        fail = MatchResult().fail
        follower = affine_follower(context.output_values[0], self._steps_of_longer_forms())
        if follower is not None:  # first: a deferral is not a refusal, whatever else is wrong
            return fail(DEFERS_TO_AFFINE, follower)
        if x.dtype is None:
            self._log.untyped = True
        if x.dtype not in FLOAT_TYPES:
            return fail(f"input dtype {x.dtype} is not float (None: shape inference could not type it)", x)
        rank = x.shape.rank() if x.shape is not None else None

        means = [_Mean(value.producer(), bindings.get(f"{tag}_factor"), bindings.get(f"{tag}_divisor"))
                 for tag in ("mean", "var", "square")
                 for value in (bindings.get(f"{tag}_mean"), bindings.get(f"{tag}_sum")) if value is not None]
        axes, keepdims = set(), set()
        for mean in means:
            reduced = reduced_axes(mean.node, rank)
            if isinstance(reduced, str):
                return fail(reduced, mean.node)
            axes.add(reduced)
            keepdims.add(mean.node.attributes.get_int("keepdims", 1))
        if len(axes) != 1:
            return fail(f"the mean and the variance reduce different axes {sorted(axes)}", means[0].node)
        if len(keepdims) != 1:
            return fail("the reductions differ in keepdims", means[0].node)
        (reduced,) = axes
        k = len(reduced)
        normalized = [] if rank is None else [a % rank for a in reduced]  # as non-negative axes, in order
        perm = None
        if reduced != tuple(range(-k, 0)):
            if rank is None:
                return fail(f"reduced axes {list(reduced)} are not the trailing axes of an input of unknown rank",
                            means[0].node)
            perm = tuple([a for a in range(rank) if a not in normalized] + normalized)
        problem = self._broadcast_problem(context, x, set(normalized), keepdims.pop(), bindings)
        if problem:
            return fail(problem, x)
        norm_shape = static_dims(x, normalized)
        if perm is not None and norm_shape is None:
            return fail(f"reduced axes {list(reduced)} are not trailing and their dims are not static", means[0].node)

        for mean in means:
            if mean.node.op_type == "ReduceMean":
                continue
            if norm_shape is None:
                return fail("ReduceSum-based mean needs static normalized dims to prove its 1/N", mean.node)
            count = int(np.prod(norm_shape))
            value = scalar(mean.factor if mean.factor is not None else mean.divisor, rank)
            expected = 1.0 / count if mean.factor is not None else float(count)
            if value is None or not np.isclose(value, expected, rtol=1e-6, atol=0.0):
                return fail(f"ReduceSum scaled by {value}, not the mean over {count} elements", mean.node)

        epsilon = scalar(eps, rank)
        if epsilon is None or not np.isfinite(epsilon) or epsilon <= 0:
            return fail("epsilon is not a positive scalar constant", eps)
        for name, (expected, reason) in EXPECTED_CONSTANTS.items():
            if bindings.get(name) is not None and scalar(bindings[name], rank) != expected:
                return fail(reason, bindings[name])

        params = []
        for role, value, default in (("gamma", gamma, 1.0), ("beta", beta, 0.0)):
            param = affine_param(role, value, default, x, k, rank, norm_shape, perm)
            if isinstance(param, str):
                return fail(param, value if value is not None else x)
            params.append(param)
        if isinstance(context.graph_or_function, ir.Function) and any(isinstance(p, np.ndarray) for p in params):
            return fail("new scale/bias initializers cannot be added inside a function", x)

        names = names_in_use(context.model)
        name = names.node(scope_name(context.nodes, means[0].node))
        new_names = {role: names.value(f"{name}.{role}")
                     for role, p in zip(("scale", "bias"), params) if isinstance(p, np.ndarray)}
        return _Fusion(self._spelling(bindings), -k, float(np.float32(epsilon)), *params, name, new_names,
                       context.root, sum(n.op_type in RESTORING_OPS for n in context.nodes), perm)

    def _broadcast_problem(self, context, x: ir.Value, normalized: set[int], keepdims: int, bindings) -> str | None:
        """Why the statistics may not meet x as LayerNorm's per-row values, or None.

        Reductions with keepdims=1 used as they are broadcast correctly whatever the shapes. Otherwise (a
        keepdims=0 reduction, a Reshape/Unsqueeze/Expand between a statistic and its use) every statistic
        where it meets x must provably have the shape of x with the normalized dims 1 (or x's own: Expand
        may broadcast all the way), dims compared by their origin (qprep/graph/dim_origin.py).
        """
        restoring = [n for n in context.nodes if n.op_type in RESTORING_OPS]
        if keepdims == 1 and not restoring:
            return None
        rank = x.shape.rank() if x.shape is not None else None
        if rank is None:
            return "statistics reshaped or reduced with keepdims=0 need the input's rank to prove the broadcast"
        origins = self._log.origins
        for name in USED_STATISTICS:
            used = bindings.get(name)
            if used is None:
                continue
            if used.shape is None or used.shape.rank() != rank:
                return (f"a statistic meets the input with rank {used.shape.rank() if used.shape else 'unknown'}, "
                        f"not {rank} (keepdims=0 without a Reshape back)")
            for axis in range(rank):
                same = origins.same(used, axis, x, axis)
                if not (same or (axis in normalized and origins.of(used, axis) == 1)):
                    return f"a restored statistic has dim {axis} = {used.shape[axis]}, not the input's per-row shape"
        return None

    def rewrite(self, op, x, **_):
        found = self._found
        self._log.fused.append(found)
        scale, bias = (
            p if isinstance(p, ir.Value) else op.initializer(ir.tensor(p), name=found.initializer_names[role])
            for p, role in ((found.scale, "scale"), (found.bias, "bias"))
        )
        # stash_type 1 (float32): the schema allows float/bfloat16 only; ORT still computes double inputs in double
        if found.perm is None:
            return op.LayerNormalization(x, scale, bias, axis=found.axis, epsilon=found.epsilon, stash_type=1,
                                         _name=found.name)
        inverse = tuple(int(i) for i in np.argsort(found.perm))
        normalized = op.LayerNormalization(op.Transpose(x, perm=list(found.perm)), scale, bias, axis=found.axis,
                                           epsilon=found.epsilon, stash_type=1, _name=found.name)
        return op.Transpose(normalized, perm=list(inverse))


# ---------------------------------------------------------------------------------------------------------
# The two families
# ---------------------------------------------------------------------------------------------------------


class CenteredLayerNorm(_LayerNormRule):
    """(x - mean) normalized, then the affine: PyTorch (TorchScript exporter), Paddle, and Flax via jax2tf.

        Div(d, Sqrt(var + eps)) | Mul(d, inverse_std)       then Mul(gamma), Add(beta), each optional
        Mul(d, Mul(inverse_std, gamma))                     Flax: gamma folded into the multiplier
    """

    form = "centered"

    def pattern(self, op, x, eps, gamma, beta):
        stats = Statistics(op, x, eps)
        d = stats.deviation
        if self.variant == "Div":  # plain
            return op.Div(d, op.Sqrt(stats.var_eps))
        if self.variant == "Mul":  # plain
            return self._root(op.Mul, d, stats.inverse_std)
        if self.variant == "gamma_inside" and not self.bias:
            return self._root(op.Mul, d, either(op.Mul, stats.inverse_std, gamma))
        normalized = orp.OrValue([op.Div(d, op.Sqrt(stats.var_eps)), either(op.Mul, d, stats.inverse_std)])
        if not self.scale:
            return self._root(op.Add, normalized, beta)
        if not self.bias:
            return self._root(op.Mul, normalized, gamma)
        scaled = orp.OrValue([either(op.Mul, normalized, gamma),
                              either(op.Mul, d, either(op.Mul, stats.inverse_std, gamma))])
        return self._root(op.Add, scaled, beta)


class FoldedScaleLayerNorm(_LayerNormRule):
    """TF/Keras (tf.nn.batch_normalization) and jax2tf's folded affine: s = gamma * inverse_std scales x and the
    mean moves into the shift, x * s + (beta - mean * s); without beta (Keras center=False): + Neg(mean * s)."""

    form = "tf"

    def pattern(self, op, x, eps, gamma, beta):
        stats = Statistics(op, x, eps)
        s = orp.OrValue([either(op.Mul, stats.inverse_std, gamma), stats.inverse_std])
        scaled_mean = either(op.Mul, restored(op, stats.mean, "mean_scaled"), s)
        shift = orp.OrValue([op.Sub(beta, scaled_mean), op.Neg(scaled_mean)])
        return self._root(op.Add, either(op.Mul, x, s), shift)


def _rule_set(log: _FusionLog) -> RewriteRuleSet:
    """Every form, each root in both operand orders (a Div root has only one)."""
    rules = [CenteredLayerNorm.rule(log, scale=False, bias=False, variant="Div")]
    for swapped in (False, True):
        rules += [
            CenteredLayerNorm.rule(log, scale=True, bias=True, swapped=swapped),
            CenteredLayerNorm.rule(log, scale=True, bias=False, swapped=swapped),
            CenteredLayerNorm.rule(log, scale=True, bias=False, variant="gamma_inside", swapped=swapped),
            CenteredLayerNorm.rule(log, scale=False, bias=True, swapped=swapped),
            CenteredLayerNorm.rule(log, scale=False, bias=False, variant="Mul", swapped=swapped),
            FoldedScaleLayerNorm.rule(log, swapped=swapped),
        ]
    return RewriteRuleSet(rules)


# ---------------------------------------------------------------------------------------------------------
# Driving the rules
# ---------------------------------------------------------------------------------------------------------


def _typed_retry(model: ir.Model, run, details: dict) -> tuple[int, _FusionLog]:
    """`run(log)`, and once more after shape inference if a candidate was refused for lacking a dtype.

    Inference runs only then, so a model nothing matches is never touched. `details` records that it ran.
    """
    log = _FusionLog()
    count = run(log)
    if not log.untyped:
        return count, log
    infer_shapes(model)
    details["shape_inference"] = "ran: a candidate's input had no dtype"
    retry = _FusionLog(fused=log.fused, refused=log.refused)
    return count + run(retry), retry


def apply(model: ir.Model, settings: PassSettings) -> PassOutcome:
    """Fuse every decomposed LayerNorm in place; upgrade to opset 17 first when needed and allowed."""
    details: dict = {}
    dry_runs: list[_FusionLog] = []

    def dry_run() -> int:
        found, log = _typed_retry(model, lambda log: count_matches(model, _rule_set(log)), details)
        dry_runs.append(log)
        return found

    proceed, upgrade = UPGRADE.prepare(model, settings.max_opset, dry_run)
    details.update(upgrade)
    if not proceed:  # nothing matched (the dry run's refusals go to the record), or the upgrade was not possible
        return PassOutcome(0, {**(dry_runs[0].details() if not upgrade else {}), **details})
    fused, log = _typed_retry(model, lambda log: _rule_set(log).apply_to_model(model), details)
    if fused:
        RemoveUnusedNodesPass()(model)  # the eps / exponent Constant nodes the match did not own
    return PassOutcome(fused, {**log.details(), **details})


def find_layernorms(model: onnx.ModelProto) -> dict:
    """What `qprep inspect` shows: the decomposed LayerNorms `fuse_layernorm` would fuse, per spelling, and
    the refused candidates by reason — the same rules, run on a copy.

    The proto is not changed. Its weights must be loaded (`onnx.load` does that): constants read from
    unresolved external data are unknown, and every check on them refuses.
    """
    copy = ir.from_proto(model)  # a new object graph; the proto is never written to
    _, log = _typed_retry(copy, lambda log: _rule_set(log).apply_to_model(copy), {})
    details = log.details()
    return {"decomposed": details.get("forms", {}), **({"refused": details["refused"]} if "refused" in details else {})}


def count_decomposed_layernorms(model: onnx.ModelProto) -> int:
    """How many LayerNorms `fuse_layernorm` would fuse in `model` (find_layernorms, summed)."""
    return sum(find_layernorms(model)["decomposed"].values())


PASS = GraphPass(
    name="fuse_layernorm",
    apply=apply,
    doc="Fuse decomposed LayerNorm (PyTorch/Paddle, TF/Keras, JAX/Flax exports) into LayerNormalization "
        "(opset 17; converts an older model first when max_opset allows).",
)


def decomposed_layernorm_nodes(proto: onnx.ModelProto) -> list[list[str]]:
    """Node names of each decomposed LayerNorm the optimize stage's fuse_layernorm rules match.

    keep_float uses it to put still-decomposed LayerNorms in the float set: the same matcher as the fusion.
    """
    model = ir.from_proto(proto)  # a copy: shape inference below rewrites value types the result must not keep
    infer_shapes(model)  # the rules need dtypes
    rules = _rule_set(_FusionLog())
    groups, claimed = [], set()
    for node in list(ir.traversal.RecursiveGraphIterator(model.graph)):
        for rule in rules:
            match = rule.match(model, node.graph, node)
            if match:
                names = [n.name for n in match.nodes if n.name not in claimed]
                claimed.update(names)
                groups.append(names)
                break
    return groups
