"""The optimize passes, one module each, in the order `optimize` runs them by default.

A pass is pattern → check → replacement on graph edges, written with onnx_ir and the onnxscript rewriter
(`RewriteRuleClassBase`: `pattern`, `check`, `rewrite` kept visibly separate). It mutates the `ir.Model` it is
given and says how many places it rewrote; the optimize stage (qprep/optimize/stage.py), not the pass,
converts to and from ModelProto, verifies the numbers with ONNX Runtime and rolls a failing pass back.

Each module defines `PASS = GraphPass(...)`.
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


# Canonical order: cleanup first (fewer nodes to match), then folds that expose constants, then fusions.
PASS_MODULES: tuple[str, ...] = ("cleanup", "fold_constants", "simplify_shapes", "fold_into_conv",
                                 "layernorm", "gelu", "fuse_gemm")


def all_passes() -> dict[str, GraphPass]:
    passes = {}
    for module in PASS_MODULES:
        graph_pass = importlib.import_module(f"qprep.optimize.passes.{module}").PASS
        passes[graph_pass.name] = graph_pass
    return passes
