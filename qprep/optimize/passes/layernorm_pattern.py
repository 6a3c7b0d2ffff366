"""fuse_layernorm's pattern pieces: how exporters spell a LayerNorm's statistics, as onnxscript sub-patterns.

The rules (qprep/optimize/passes/layernorm.py) build their patterns from these; every spelling the module
docstring there lists under Forms is one `orp.OrValue` choice here. A piece binds the values the check reads
by name (`mean_mean`, `var_sum`, `exponent`, `mean_used`, ...): the check proves what the pattern only shapes
(exponents are 2, a ReduceSum divides by N, a restored statistic keeps its per-row shape).
"""

from __future__ import annotations

from onnxscript.rewriter import pattern as orp


def either(make, a, b):
    """make(a, b) or make(b, a): exporters differ in operand order.

    A local choice costs one failed node match per wrong order. `RewriteRuleSet(commute=True)` would instead
    copy the whole rule per combination of swapped nodes (2^k), seconds per run (BENCHMARKS.md: "operand order
    matched per node").
    """
    return orp.OrValue([make(a, b), make(b, a)])


def square(op, t, exponent: str):
    """t², as Pow(t, exponent) or Mul(t, t); `check` proves the exponent is 2."""
    return orp.OrValue([op.Pow(t, orp.Var(exponent)), op.Mul(t, t)])


def mean_of(op, t, tag: str):
    """E[t] over the normalized axes: ReduceMean(t) (bound `{tag}_mean`), or jax2tf's ReduceSum(t) (bound
    `{tag}_sum`) times 1/N or divided by N; `check` proves N."""
    total = op.ReduceSum(t, _allow_other_inputs=True, _outputs=[f"{tag}_sum"])
    return orp.OrValue([op.ReduceMean(t, _allow_other_inputs=True, _outputs=[f"{tag}_mean"]),
                        either(op.Mul, total, orp.Var(f"{tag}_factor")), op.Div(total, orp.Var(f"{tag}_divisor"))])


def restored(op, v, name: str):
    """v where it meets the input: as it is, or brought back to the input's rank after a keepdims=0 reduction
    (jax2tf): Reshape or Unsqueeze, each optionally followed by Expand (tf.broadcast_to), or Expand alone.
    The value used is bound as `name`; `check` proves it has the statistic's shape [..., 1]."""
    def lifted():
        return orp.OrValue([op.Reshape(v, _allow_other_inputs=True), op.Unsqueeze(v, _allow_other_inputs=True)])
    return orp.OrValue([v, lifted(), op.Expand(orp.OrValue([v, lifted()]), _allow_other_inputs=True)], name=name)


def variance_of(op, x, mean, deviation):
    """Var[x]: E[(x - mean)²] (PyTorch, Paddle, TF's SquaredDifference) or Max(E[x²] - mean², 0) (Flax)."""
    central = mean_of(op, square(op, deviation, "exponent"), "var")
    moments = op.Sub(mean_of(op, square(op, x, "x_exponent"), "square"), square(op, mean, "mean_exponent"))
    return orp.OrValue([central, either(op.Max, moments, orp.Var("zero"))])


def inverse_std_of(op, var_eps):
    """1 / sqrt(var + eps): Reciprocal(Sqrt) (TF's Rsqrt), Pow(·, -0.5) or Div(1, Sqrt)."""
    return orp.OrValue([op.Reciprocal(op.Sqrt(var_eps)), op.Pow(var_eps, orp.Var("inverse_exponent")),
                        op.Div(orp.Var("numerator"), op.Sqrt(var_eps))])


class Statistics:
    """The statistics subgraph every family shares, built once per pattern: mean, deviation, var + eps and
    its inverse square root, each bound where it meets x-shaped data."""

    def __init__(self, op, x, eps):
        self.mean = mean_of(op, x, "mean")
        self.deviation = op.Sub(x, restored(op, self.mean, "mean_used"))
        variance = variance_of(op, x, self.mean, self.deviation)
        self.var_eps = either(op.Add, restored(op, variance, "var_used"), eps)
        self.inverse_std = restored(op, inverse_std_of(op, self.var_eps), "inverse_used")
