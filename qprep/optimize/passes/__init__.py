"""The optimize passes, one module each, in the order `optimize` runs them by default — and how to write a rule.

A pass mutates the `ir.Model` it is given and says how many places it rewrote (`PassOutcome`); the optimize stage
(qprep/optimize/stage.py), not the pass, converts to and from ModelProto, verifies the numbers with ONNX Runtime
and rolls a failing pass back. Each module defines `PASS = GraphPass(...)`. The qdq rewrites (qprep/qdq/) are
rules written the same way, verified rewrite by rewrite by qdq/verified.py instead.

Writing a rule. A rule is pattern → check → replacement on graph edges (producer/consumer, never node order),
written with onnx_ir and the onnxscript rewriter as a `RewriteRuleClassBase` subclass whose `pattern`, `check`
and `rewrite` stay separate:

    pattern(op, x, ...)          the subgraph's structure only; bind what the check needs (`_outputs=["name"]`)
    check(context, x, ...)       everything that makes it legal: dtypes, shapes, attributes, constants read from
                                 the graph (`ir_utils.constant_array`; never assumed); `MatchResult().fail(reason)`
                                 otherwise — a partial match leaves the graph untouched
    rewrite(op, x, ...)          the replacement, named after what it replaces (`_name=`)

The module docstring states its Forms, Preconditions and Math. Its tests build tiny graphs and either
`assert_fused` (same numbers with ONNX Runtime) or `assert_refused` (with the reason), as
tests/optimize/passes/test_pass_layernorm.py does. Shared helpers, written once:

    qprep/graph/ir.py   constant_array (initializer or Constant node, never a graph input),
                                 default_opset, infer_shapes
    qprep/graph/rules.py      names_in_use / unique_node_name / unique_value_name (names for what a
                                 replacement adds); OpsetUpgrade + count_matches (a replacement op newer than the
                                 model: dry run, then convert only when something matches and max_opset allows
                                 it); per_channel (a constant on a Conv output as one value per channel)
    qprep/third_party.py         the dependencies' private APIs (get_numpy_value, MaterializeReshapeShape, ...)

Per-run state (what a run fused, refused, which anchors it may touch) lives in an object `apply` creates and
hands to the rules' constructors (layernorm's _FusionLog, qdq/verified.py's RewriteLog, float_maxpool's shapes);
never in a module-level variable, so two runs cannot see each other's state.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable

import onnx_ir as ir


@dataclass(frozen=True)
class PassSettings:
    """What passes may depend on, resolved once by the optimize stage from its options and the pipeline."""

    fold_max_elements: int = 1 << 20  # constant folding never creates a tensor bigger than this...
    max_opset: int = 21  # ...and rewrites never raise the opset above this (RKNN: 19)
    gelu: str = "auto"  # auto | onnx | microsoft | off
    backend: str | None = None  # the quantize backend later in the pipeline (ort | rknn | fp16), if any
    threads: int = 2  # the run's threads, for a pass that runs ONNX Runtime (constant folding)


@dataclass
class PassOutcome:
    matches: int = 0  # places rewritten (0: the model is unchanged and needs no verification)
    details: dict = field(default_factory=dict)  # pass-specific facts for the record (e.g. epsilons found)


@dataclass(frozen=True)
class GraphPass:
    name: str
    apply: Callable[[ir.Model, PassSettings], PassOutcome]
    doc: str
    default: bool = True  # part of the default pass list


# Canonical order: ONNX Runtime's fused ops apart (so the rest sees ONNX ops), cleanup (fewer nodes to match),
# then folds that expose constants, then fusions.
PASS_MODULES: tuple[str, ...] = ("split_ort_fusions", "hardswish", "cleanup", "fold_constants", "simplify_shapes",
                                 "fold_into_conv", "layernorm", "gelu", "softmax", "fuse_gemm")


def all_passes() -> dict[str, GraphPass]:
    passes = {}
    for module in PASS_MODULES:
        graph_pass = importlib.import_module(f"qprep.optimize.passes.{module}").PASS
        passes[graph_pass.name] = graph_pass
    return passes
