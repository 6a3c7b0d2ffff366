"""fuse_gelu: decomposed GELU activations → one node, so a quantizer treats GELU as one activation instead of
giving each of the 4-10 elementwise ops inside it its own int8 range.

Forms (t is the output of the core op, x the GELU's input):

    erf      t = Erf(u),      u = x / sqrt(2)                          y = 0.5 * x * (1 + t)
    tanh     t = Tanh(u),     u = sqrt(2/pi) * (x + 0.044715 * x^3)    y = 0.5 * x * (1 + t)
    sigmoid  t = Sigmoid(u),  u = 1.702 * x                            y = x * t

Pattern: exporters write u and y with their constants in any association and order — `x / 1.4142135` or
`x * 0.70710677`; x^3 as Pow(x, 3), x * (x * x) or (x * x) * x; `sqrt(2/pi) * x * (1 + 0.044715 * x * x)`
(Hugging Face FastGELU), `c1 * x + c2 * x^3`; `(x * (1 + t)) * 0.5`, `x * (0.5 * (1 + t))` (Flax via jax2tf),
`0.5 * x + 0.5 * x * t`. So the pattern is read as algebra, on graph edges: from the core node, the chain of
Add/Sub/Mul/Div/Neg/Pow nodes back to x (u) and forward to the node whose output is y, each evaluated as a
polynomial with its scalar constants read from the graph.

Check: u is exactly the polynomial of its form in one variable x and y the polynomial in (x, t), coefficient by
coefficient within a relative error of 1e-4 (`REL_TOL`): float32 spellings of the constants (1.4142135,
0.70710677, 0.7978846, 0.044715) are within 1e-7 of the exact values, meaningful look-alikes (0.044 for
0.044715, 1.5 for sqrt 2) are off by more than 1e-2. Every constant is an initializer or Constant node (never a
graph input) holding one element, with no more dimensions than x (broadcasting cannot change the shape); no
intermediate value is used outside the GELU or is a graph output. A core node combined with its own argument's
variable (a GELU-shaped candidate) that fails a check is left alone and counted with its reason; x*sigmoid(x)
(SiLU) is not a GELU candidate.

Replacement (`settings.gelu`): `onnx` → Gelu (opset 20, approximate "none" | "tanh"; the sigmoid form has no
ONNX op and is refused), converting an older model with ConvertVersionPass only when something matched and
`max_opset` allows 20; `microsoft` → ONNX Runtime's com.microsoft Gelu / FastGelu / QuickGelu(alpha) (version 1);
`auto` → onnx if the model is already at opset >= 20, else microsoft for ONNX Runtime (backend "ort" or none),
else off (rknn-toolkit2 wants opset <= 19 and has no com.microsoft ops; fp16 likewise).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import onnx
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from qprep.graph.ir import FLOAT_TYPES, MS_DOMAIN, constant_array, default_opset, infer_shapes
from qprep.graph.rules import OpsetUpgrade, all_nodes, take_over, unique_node_name
from qprep.optimize.passes import GraphPass, PassOutcome, PassSettings

REL_TOL = 1e-4  # relative tolerance on every coefficient (see the module docstring)
GELU_OPSET = 20  # ONNX Gelu's first opset
UPGRADE = OpsetUpgrade(GELU_OPSET, forbidden="gelu: {found} GELU(s) need opset {target} for ONNX Gelu but max_opset "
                                          "is {max_opset}", failed="gelu: converting opset {opset} → {target} failed")
MODES = ("auto", "onnx", "microsoft", "off")
POLYNOMIAL_OPS = frozenset({"Add", "Sub", "Mul", "Div", "Neg", "Pow"})
MAX_STEPS = 6  # nodes between the core op and y; exporters use 2-4

Polynomial = dict  # {(power of x, power of t): coefficient}
X, T = (1, 0), (0, 1)
HALF_X_TIMES_ONE_PLUS_T = {(1, 0): 0.5, (1, 1): 0.5}


@dataclass(frozen=True)
class Form:
    core: str  # the op whose output is t
    inner: Polynomial  # u as a polynomial in x (the sigmoid form's coefficient is read, not fixed)
    outer: Polynomial  # y as a polynomial in x and t
    onnx: dict | None  # attributes of ONNX Gelu, or None when ONNX has no op for the form
    microsoft: str  # the com.microsoft op


FORMS = {
    "erf": Form("Erf", {X: math.sqrt(0.5)}, HALF_X_TIMES_ONE_PLUS_T, {"approximate": "none"}, "Gelu"),
    "tanh": Form("Tanh", {X: math.sqrt(2 / math.pi), (3, 0): 0.044715 * math.sqrt(2 / math.pi)},
                 HALF_X_TIMES_ONE_PLUS_T, {"approximate": "tanh"}, "FastGelu"),
    "sigmoid": Form("Sigmoid", {X: 1.702}, {(1, 1): 1.0}, None, "QuickGelu"),
}
FORM_OF_CORE = {form.core: name for name, form in FORMS.items()}


# ---------------------------------------------------------------------------------------------------------
# Polynomials over graph edges
# ---------------------------------------------------------------------------------------------------------


class NotPolynomial(Exception):
    """The subgraph is not a polynomial of the variables (the reason says where)."""


def _add(a: Polynomial, b: Polynomial, sign: float = 1.0) -> Polynomial:
    out = dict(a)
    for key, c in b.items():
        out[key] = out.get(key, 0.0) + sign * c
    return {k: c for k, c in out.items() if c != 0.0}


def _mul(a: Polynomial, b: Polynomial) -> Polynomial:
    out: Polynomial = {}
    for (ax, at), ca in a.items():
        for (bx, bt), cb in b.items():
            key = (ax + bx, at + bt)
            out[key] = out.get(key, 0.0) + ca * cb
    return {k: c for k, c in out.items() if c != 0.0}


class _Reader:
    """Evaluates values as polynomials of the variables, recording the nodes it reads through."""

    def __init__(self, variables: dict[ir.Value, Polynomial], rank: int | None):
        self.variables, self.rank = variables, rank
        self.nodes: set[ir.Node] = set()

    def read(self, value: ir.Value | None) -> Polynomial:
        if value is None:
            raise NotPolynomial("a missing input")
        if value in self.variables:
            return self.variables[value]
        constant = self._scalar(value)
        if constant is not None:
            return {(0, 0): constant} if constant != 0.0 else {}
        node = value.producer()
        if value.is_graph_input():
            raise NotPolynomial(f"{value.name} is a graph input, not a constant")
        if node is None or node.op_type not in POLYNOMIAL_OPS or node.domain not in ("", "ai.onnx"):
            raise NotPolynomial(f"{value.name} is neither x nor a constant")
        self.nodes.add(node)
        a = self.read(node.inputs[0])
        if node.op_type == "Neg":
            return {k: -c for k, c in a.items()}
        if node.op_type == "Pow":
            exponent = self._scalar(node.inputs[1])
            if exponent is None or exponent != int(exponent) or not 0 <= exponent <= 4:
                raise NotPolynomial(f"Pow exponent {exponent} is not a small whole number")
            out = {(0, 0): 1.0}
            for _ in range(int(exponent)):
                out = _mul(out, a)
            return out
        if node.op_type == "Div":
            divisor = self._scalar(node.inputs[1])
            if not divisor:
                raise NotPolynomial("a Div by something other than a non-zero constant")
            return {k: c / divisor for k, c in a.items()}
        b = self.read(node.inputs[1])
        return _add(a, b) if node.op_type == "Add" else _add(a, b, -1.0) if node.op_type == "Sub" else _mul(a, b)

    def _scalar(self, value: ir.Value) -> float | None:
        """The constant's single element, when it is one that cannot broadcast x to a higher rank."""
        array = constant_array(value)
        if array is None:
            return None
        if array.size != 1:
            raise NotPolynomial(f"constant {value.name} has shape {array.shape}, not a single element")
        if array.ndim > 0 and (self.rank is None or array.ndim > self.rank):
            raise NotPolynomial(f"constant {value.name} of rank {array.ndim} may broadcast x (rank {self.rank})")
        return float(array.reshape(()))


def _close(got: Polynomial, want: Polynomial) -> bool:
    """The same terms, each coefficient within REL_TOL."""
    scale = max(abs(c) for c in want.values())
    terms = {k for k, c in got.items() if abs(c) > 1e-9 * scale} | set(want)
    return all(k in got and k in want and math.isclose(got[k], want[k], rel_tol=REL_TOL) for k in terms)


def _show(poly: Polynomial) -> str:
    """0.5·x + 0.5·x·t"""
    def term(key, c):
        factors = [f"{v}^{p}" if p > 1 else v for v, p in zip("xt", key) if p]
        return "·".join([f"{c:.8g}", *factors])
    return " + ".join(term(k, c) for k, c in sorted(poly.items())) or "0"


# ---------------------------------------------------------------------------------------------------------
# Pattern and check: one GELU around one core node
# ---------------------------------------------------------------------------------------------------------


@dataclass
class Match:
    form: str
    x: ir.Value
    y: ir.Value  # the output the replacement takes over
    core: ir.Node
    nodes: set  # every node the replacement makes dead
    alpha: float = 1.0  # the sigmoid form's coefficient


def match_gelu(core: ir.Node) -> Match | str | None:
    """The GELU around `core` (an Erf/Tanh/Sigmoid node), the reason a GELU-shaped candidate fails its check, or
    None when `core` is not part of a GELU-shaped subgraph at all (its output is never multiplied by the
    variable its argument is computed from)."""
    form_name = FORM_OF_CORE[core.op_type]
    form = FORMS[form_name]
    reasons = []
    for x in _variable_candidates(core.inputs[0]):
        rank = x.shape.rank() if x.shape is not None else None
        inner_reader = _Reader({x: {X: 1.0}}, rank)
        try:
            inner, inner_problem = inner_reader.read(core.inputs[0]), None
        except NotPolynomial as exc:
            inner, inner_problem = {}, str(exc)
        if form_name == "sigmoid" and _silu(core.inputs[0], x):
            continue  # x * sigmoid(x) is SiLU, not a GELU candidate
        found = _outer(core.outputs[0], x, rank, form.outer, inner_reader.nodes | {core})
        if isinstance(found, str) or found is None:
            if found and not inner_problem and inner:
                reasons.append(found)
            continue
        y, outer, nodes = found
        want_inner = {X: inner.get(X, 0.0)} if form_name == "sigmoid" else form.inner
        if inner_problem:
            reasons.append(f"{core.op_type} argument: {inner_problem}")
        elif form_name == "sigmoid" and not math.isclose(inner.get(X, 0.0), 1.702, rel_tol=1e-3):
            reasons.append(f"Sigmoid argument {_show(inner)} is not 1.702·x")
        elif not _close(inner, want_inner):
            reasons.append(f"{core.op_type} argument {_show(inner)}, expected {_show(want_inner)} "
                           f"(rel tol {REL_TOL:g})")
        elif not _close(outer, form.outer):
            reasons.append(f"output {_show(outer)}, expected {_show(form.outer)} (rel tol {REL_TOL:g})")
        elif x.dtype is not None and x.dtype not in FLOAT_TYPES:
            reasons.append(f"input dtype {x.dtype} is not float")
        elif _used_outside(nodes, y):
            reasons.append(_used_outside(nodes, y))
        else:
            return Match(form_name, x, y, core, nodes, alpha=inner.get(X, 1.0))
    return reasons[0] if reasons else None


def _silu(u: ir.Value, x: ir.Value) -> bool:
    """u is x itself up to constants of any rank (x * sigmoid(x), Swish with beta 1)."""
    try:
        return _Reader({x: {X: 1.0}}, rank=64).read(u) == {X: 1.0}
    except NotPolynomial:
        return False


def _variable_candidates(u: ir.Value) -> list[ir.Value]:
    """Values u may be a polynomial of, nearest first: every non-constant value reached back through
    Add/Sub/Mul/Div/Neg/Pow nodes (x itself may be computed by such a node, e.g. a bias Add)."""
    seen, order, frontier = set(), [], [u]
    while frontier and len(order) < 16:
        value = frontier.pop(0)
        if value is None or value in seen or constant_array(value) is not None:
            continue
        seen.add(value)
        order.append(value)
        node = value.producer()
        if node is not None and node.op_type in POLYNOMIAL_OPS:
            frontier.extend(node.inputs)
    return order[1:] if len(order) > 1 else order


def _outer(t: ir.Value, x: ir.Value, rank: int | None, want: Polynomial, inner_nodes: set) -> tuple | str | None:
    """(y, y as a polynomial in x and t, every node from x to y) down the chain of polynomial ops from t: the
    first value equal to `want`, else the last with an x·t term (a GELU-shaped candidate the check then refuses:
    its whole product, e.g. 0.6·x·(1 + t)). A string when the walk met a non-constant operand after such a
    candidate (why it is not a GELU); None when there is no candidate."""
    value, candidate = t, None
    for _ in range(MAX_STEPS):
        following = [use.node for use in value.uses()
                     if use.node.op_type in POLYNOMIAL_OPS and use.node.domain in ("", "ai.onnx")]
        if len(following) != 1:
            break
        value = following[0].outputs[0]
        reader = _Reader({x: {X: 1.0}, t: {T: 1.0}}, rank)
        try:
            poly = reader.read(value)
        except NotPolynomial as exc:
            if candidate is not None and "constant" in str(exc):
                return f"output: {exc}"
            break
        if _close(poly, want):
            return value, poly, inner_nodes | reader.nodes
        if (1, 1) in poly:
            candidate = value, poly, inner_nodes | reader.nodes
    return candidate


def _used_outside(nodes: set, y: ir.Value) -> str | None:
    """Why the nodes cannot all go: an intermediate value is a graph output or read by another node."""
    for node in nodes:
        for out in node.outputs:
            if out is y:
                continue
            if out.is_graph_output():
                return f"intermediate {out.name} is a graph output"
            if any(use.node not in nodes for use in out.uses()):
                return f"intermediate {out.name} is also used outside the GELU"
    return None


def find_gelus(model: ir.Model) -> tuple[list[Match], Counter]:
    """Every decomposed GELU of the model (graph and subgraphs) and the refused candidates by reason.
    `apply` fuses exactly these; `qprep inspect` counts them."""
    matches, refused, claimed = [], Counter(), set()
    for node in list(all_nodes(model)):
        if node.op_type not in FORM_OF_CORE or node.domain not in ("", "ai.onnx") or node in claimed:
            continue
        found = match_gelu(node)
        if isinstance(found, Match):
            if found.nodes & claimed:
                continue
            claimed |= found.nodes
            matches.append(found)
        elif found is not None:
            refused[f"{FORM_OF_CORE[node.op_type]}: {found}"] += 1
    return matches, refused


# ---------------------------------------------------------------------------------------------------------
# Replacement
# ---------------------------------------------------------------------------------------------------------


def _replace(match: Match, mode: str, replaced: dict[ir.Value, ir.Value]) -> None:
    """One Gelu/FastGelu/QuickGelu node computing y from x, placed where y was computed; y's uses (and its name,
    if it is a graph output) move to it, and the old nodes die. `replaced` maps the y of GELUs replaced
    before to their new outputs (a GELU's x may be the previous one's y)."""
    form = FORMS[match.form]
    graph = match.y.producer().graph
    if mode == "onnx":
        op_type, domain, version, attributes = "Gelu", "", None, form.onnx
    else:
        op_type, domain, version = form.microsoft, MS_DOMAIN, 1
        attributes = {"alpha": float(match.alpha)} if match.form == "sigmoid" else {}
    node = ir.node(op_type, [replaced.get(match.x, match.x)], attributes=attributes, domain=domain, version=version,
                   name=_name_near(match.core, op_type))
    graph.insert_before(match.y.producer(), node)
    take_over(match.y, node.outputs[0])
    replaced[match.y] = node.outputs[0]


def _name_near(node: ir.Node, op_type: str) -> str:
    """`<scope of node>/<op_type>`, e.g. `/bert/.../intermediate_act_fn/Gelu`; suffixed `_1`, `_2` if taken, so
    fused nodes stay traceable to the scope they replace."""
    scope = (node.name or "").rpartition("/")[0] or node.name or ""
    return unique_node_name(node.graph, f"{scope}/{op_type}" if scope else op_type)


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


NO_ONNX_OP = "sigmoid: no ONNX op computes x·sigmoid(1.702·x) (gelu: microsoft fuses it into QuickGelu)"


def _fusable(model: ir.Model, mode: str) -> tuple[list[Match], Counter]:
    """find_gelus, with the forms the mode has no op for moved to the refusals."""
    matches, refused = find_gelus(model)
    if mode == "onnx":
        without_op = sum(FORMS[m.form].onnx is None for m in matches)
        if without_op:
            refused[NO_ONNX_OP] += without_op
        matches = [m for m in matches if FORMS[m.form].onnx is not None]
    return matches, refused


def apply(model: ir.Model, settings: PassSettings) -> PassOutcome:
    """Fuse in place; details: mode (and why), fused per form, refused candidates by reason, opset_upgraded_from,
    or skipped: reason."""
    opset = default_opset(model)
    mode, why = resolve_mode(settings, opset)
    if mode == "off":
        return PassOutcome(0, {"skipped": "gelu: off" if settings.gelu == "off" else f"gelu: {why}"})
    details: dict = {"mode": mode, "mode_reason": why}
    matches, refused = _fusable(model, mode)
    if mode == "onnx":
        proceed, upgrade = UPGRADE.prepare(model, settings.max_opset, lambda: len(matches))
        details.update(upgrade)
        if not proceed:
            return PassOutcome(0, {**details, **({"refused": dict(refused)} if refused else {})})
        if upgrade:  # the converter rebuilt the graph: match again on the converted model
            matches, refused = _fusable(model, mode)
    replaced: dict[ir.Value, ir.Value] = {}
    for match in matches:
        _replace(match, mode, replaced)
    if matches and mode == "microsoft":
        model.opset_imports.setdefault(MS_DOMAIN, 1)
    if matches:
        RemoveUnusedNodesPass()(model)  # the replaced nodes and the Constant nodes that fed only them
    if matches:  # only then: the stage keeps a later round's value, and a round with nothing left must not hide it
        details["fused"] = {form: sum(m.form == form for m in matches) for form in FORMS}
    if refused:
        details["refused"] = dict(sorted(refused.items()))
    return PassOutcome(len(matches), details)


def count_gelus(proto: onnx.ModelProto) -> dict:
    """What `qprep inspect` shows: decomposed GELUs per form (the ones `optimize` fuses) and refused candidates
    by reason, found by the same matcher on a copy (the proto is not changed), after shape inference as in the
    optimize stage (the check needs x's rank)."""
    model = ir.from_proto(proto)
    infer_shapes(model)
    matches, refused = find_gelus(model)
    out: dict = {"decomposed": {form: sum(m.form == form for m in matches) for form in FORMS}}
    if refused:
        out["refused"] = dict(sorted(refused.items()))
    return out


PASS = GraphPass(name="fuse_gelu", apply=apply,
                 doc="fuse decomposed GELU (erf, tanh and sigmoid forms, constants in any association) into ONNX "
                     "Gelu (opset 20) or com.microsoft Gelu/FastGelu/QuickGelu, per the gelu setting and backend")
