"""Fuse decomposed GELU activations into one node, so a quantizer treats GELU as one activation instead of
giving each of the 5-9 elementwise ops inside it its own int8 range.

Forms matched (x is any float tensor; constant operands may come in either order):

    exact (erf):  0.5 * x * (1 + Erf(x / 1.4142135))     also Erf(x * 0.70710678)
    tanh approx:  0.5 * x * (1 + Tanh(0.7978846 * (x + 0.044715 * x^3)))     x^3 = Pow(x, 3) | x * (x * x)

and the product `0.5 * x * (1 + t)` in each association exporters write: `(x * (1 + t)) * 0.5` (PyTorch's
F.gelu export), `(x * 0.5) * (1 + t)` (hand-written `x * 0.5 * (...)`), `x * ((1 + t) * 0.5)`.

Preconditions (the check): every constant is read from the graph (initializer or Constant node, never a graph
input) and must equal its exact value within a relative error of 1e-4 (`REL_TOL`): float32 spellings of the
constants (1.4142135, 0.70710677, 0.7978846, 0.044715) are within 1e-7 (relative) of the exact values, while
meaningful look-alikes (0.044 for 0.044715, 1.5 for sqrt 2) are off by more than 1e-2. Each constant holds a
single element and has no more dimensions than x, so broadcasting it cannot change the output shape. The
rewriter itself refuses a match whose intermediate values are used outside it.

Replacement (`settings.gelu`): `onnx` → Gelu (opset 20, approximate "none" | "tanh"), converting an older model
with ConvertVersionPass only when something matched and `max_opset` allows 20; `microsoft` → ONNX Runtime's
com.microsoft Gelu / FastGelu (version 1); `auto` → onnx if the model is already at opset >= 20, else
microsoft for ONNX Runtime (backend "ort" or none), else off (rknn-toolkit2 wants opset <= 19 and has no
com.microsoft ops; fp16 likewise).
"""

from __future__ import annotations

import abc
import functools
import math

import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass
from onnxscript.rewriter import MatchResult, RewriteRuleClassBase, RewriteRuleSet
from onnxscript.rewriter import pattern as orp

from qprep.optimize.ir_utils import constant_array, default_opset
from qprep.optimize.passes import GraphPass, PassOutcome, PassSettings
from qprep.optimize.rules import OpsetUpgrade, all_nodes, count_matches, unique_node_name

REL_TOL = 1e-4  # relative tolerance on every constant (see the module docstring)
GELU_OPSET = 20  # ONNX Gelu's first opset
UPGRADE = OpsetUpgrade(GELU_OPSET, forbidden="gelu: {found} GELU(s) need opset {target} for ONNX Gelu but max_opset "
                                          "is {max_opset}", failed="gelu: converting opset {opset} → {target} failed")
MS_DOMAIN = "com.microsoft"
MODES = ("auto", "onnx", "microsoft", "off")
HALF_PLACEMENTS = ("last", "on_x", "on_sum")  # where the 0.5 joins the product 0.5 * x * (1 + t)


def _check_constants(x: ir.Value, expected: dict[str, tuple[ir.Value | None, float]]) -> MatchResult:
    """Each named value must be a graph constant with one element equal to its expected value (REL_TOL)."""
    result = MatchResult()
    rank = x.shape.rank() if x.shape is not None else None
    for name, (value, want) in expected.items():
        array = constant_array(value)
        if array is None:
            return result.fail(f"{name} is not a constant", value)
        if array.size != 1:
            return result.fail(f"{name} has shape {array.shape}, not a single element", value)
        if array.ndim > 0 and (rank is None or array.ndim > rank):
            return result.fail(f"{name} of rank {array.ndim} may broadcast x (rank {rank}) to a higher rank", value)
        got = float(array.reshape(()))
        if not math.isclose(got, want, rel_tol=REL_TOL):
            return result.fail(f"{name} = {got:.8g}, expected {want:.8g} (rel tol {REL_TOL:g})", value)
    return result


def _half_x_times(op, x, one_plus_t, half, placement: str):
    """0.5 * x * (1 + t) in one of the three associations exporters write."""
    if placement == "last":
        return op.Mul(op.Mul(x, one_plus_t), half)
    if placement == "on_x":
        return op.Mul(op.Mul(x, half), one_plus_t)
    return op.Mul(x, op.Mul(one_plus_t, half))


class _GeluRule(RewriteRuleClassBase):
    """What both forms share: the outer product, the replacement by mode, naming. A subclass gives the
    pattern of `t` (binding its Erf/Tanh output as `core`) and the constants the check must verify."""

    approximate: str  # the ONNX Gelu attribute for this form
    ms_op: str  # the com.microsoft op for this form

    def __init__(self, placement: str, mode: str):
        super().__init__(name=f"{type(self).__name__}[{placement}]")
        self.placement, self.mode = placement, mode

    @abc.abstractmethod
    def expected_constants(self, **bindings) -> dict[str, tuple[ir.Value | None, float]]:
        """{label: (bound value, exact value)} for every constant this match bound."""

    def check(self, context, x, **bindings) -> MatchResult:
        return _check_constants(x, self.expected_constants(**bindings))

    def rewrite(self, op, x, core, **_):
        if self.mode == "onnx":
            return op.Gelu(x, approximate=self.approximate, _name=_name_near(core.producer(), "Gelu"))
        return getattr(op, self.ms_op)(x, _domain=MS_DOMAIN, _version=1, _name=_name_near(core.producer(), self.ms_op))


def _name_near(node: ir.Node, op_type: str) -> str:
    """`<scope of node>/<op_type>`, e.g. `/bert/.../intermediate_act_fn/Gelu`; suffixed `_1`, `_2` if taken, so
    fused nodes stay traceable to the scope they replace."""
    scope = (node.name or "").rpartition("/")[0] or node.name or ""
    return unique_node_name(node.graph, f"{scope}/{op_type}" if scope else op_type)


class ErfGelu(_GeluRule):
    """0.5 * x * (1 + Erf(x / sqrt 2)), the exact GELU (torch.nn.GELU() exported)."""

    approximate, ms_op = "none", "Gelu"

    def pattern(self, op, x, scale, one, half):
        scaled = orp.OrValue([op.Div(x, scale), op.Mul(x, scale)], tag_var="scale_op", tag_values=["Div", "Mul"])
        erf = op.Erf(scaled, _outputs=["core"])
        return _half_x_times(op, x, op.Add(erf, one), half, self.placement)

    def expected_constants(self, scale, one, half, scale_op, **_):
        scale_name, scale_value = ("sqrt(2)", math.sqrt(2)) if scale_op == "Div" else ("1/sqrt(2)", math.sqrt(0.5))
        return {scale_name: (scale, scale_value), "one": (one, 1.0), "half": (half, 0.5)}


class TanhGelu(_GeluRule):
    """0.5 * x * (1 + Tanh(sqrt(2/pi) * (x + 0.044715 * x^3))), GELU's tanh approximation."""

    approximate, ms_op = "tanh", "FastGelu"

    def pattern(self, op, x, three, cubic, sqrt_2_over_pi, one, half):
        cube = orp.OrValue([op.Pow(x, three), op.Mul(x, op.Mul(x, x))], tag_var="cube_op", tag_values=["Pow", "Mul"])
        inner = op.Add(x, op.Mul(cubic, cube))
        tanh = op.Tanh(op.Mul(sqrt_2_over_pi, inner), _outputs=["core"])
        return _half_x_times(op, x, op.Add(tanh, one), half, self.placement)

    def expected_constants(self, three, cubic, sqrt_2_over_pi, one, half, cube_op, **_):
        expected = {"x^3 coefficient": (cubic, 0.044715), "sqrt(2/pi)": (sqrt_2_over_pi, math.sqrt(2 / math.pi)),
                    "one": (one, 1.0), "half": (half, 0.5)}
        if cube_op == "Pow":
            expected["Pow exponent"] = (three, 3.0)
        return expected


FORMS = {"erf": ErfGelu, "tanh": TanhGelu}
MARKER_OPS = {"erf": "Erf", "tanh": "Tanh"}  # a form can only match where its Erf/Tanh node exists


@functools.cache
def _form_rules(form: str, mode: str) -> RewriteRuleSet:
    """Every operand order of every Add/Mul (commute=True): 48 rules for erf, 768 (2^8 x 3) for tanh. Built
    once per process, as building the tanh set takes ~0.2 s."""
    return RewriteRuleSet([FORMS[form].rule(placement, mode) for placement in HALF_PLACEMENTS], commute=True)


def rule_sets(model: ir.Model, mode: str) -> dict[str, RewriteRuleSet]:
    """The rule set of each form whose Erf/Tanh op occurs in the model. The engine tries every rule at every
    node, and the 768 tanh rules cost ~2 s on MiniLM's 646 nodes although it has no Tanh at all."""
    ops = {node.op_type for node in all_nodes(model) if node.domain == ""}
    return {form: _form_rules(form, mode) for form, marker in MARKER_OPS.items() if marker in ops}


def resolve_mode(settings: PassSettings, opset: int) -> tuple[str, str]:
    """(mode, why): `auto` picks what the model and the backend after this pass can run."""
    if settings.gelu not in MODES:
        raise ValueError(f"gelu: unknown mode {settings.gelu!r}; expected one of {', '.join(MODES)}")
    if settings.gelu != "auto":
        return settings.gelu, "set by the gelu option"
    if opset >= GELU_OPSET:
        return "onnx", f"auto: model opset {opset} >= {GELU_OPSET}"
    if settings.backend in (None, "ort"):
        return "microsoft", f"auto: opset {opset} < {GELU_OPSET}, ONNX Runtime runs com.microsoft ops"
    return "off", (f"auto → off: backend {settings.backend} has no com.microsoft ops and the model is at opset "
                   f"{opset} < {GELU_OPSET}")


def apply(model: ir.Model, settings: PassSettings) -> PassOutcome:
    """Fuse in place; details: mode (and why), fused per form, opset_upgraded_from, or skipped: reason."""
    opset = default_opset(model)
    mode, why = resolve_mode(settings, opset)
    if mode == "off":
        return PassOutcome(0, {"skipped": "gelu: off" if settings.gelu == "off" else f"gelu: {why}"})
    details: dict = {"mode": mode, "mode_reason": why}
    if mode == "onnx":
        rules = [rule for rule_set in rule_sets(model, mode).values() for rule in rule_set.rules]
        proceed, upgrade = UPGRADE.prepare(model, settings.max_opset, lambda: count_matches(model, rules))
        details.update(upgrade)
        if not proceed:
            return PassOutcome(0, details)
    fused = dict.fromkeys(FORMS, 0)
    for form, rules in rule_sets(model, mode).items():
        fused[form] = rules.apply_to_model(model)
    RemoveUnusedNodesPass()(model)  # Constant nodes that fed only the fused subgraphs
    return PassOutcome(sum(fused.values()), {**details, "fused": fused})


PASS = GraphPass(name="fuse_gelu", apply=apply,
                 doc="fuse decomposed GELU (erf and tanh forms) into ONNX Gelu (opset 20) or com.microsoft "
                     "Gelu/FastGelu, per the gelu setting and backend")
