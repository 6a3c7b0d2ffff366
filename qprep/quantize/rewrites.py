"""The rewrites the quantize backends make to the prepared float model, in one table: which backend runs each,
when its settings turn it on, and the one verify-or-revert the exact ones go through.

Why a table: the backends run these in their own order (rknn/convert.py, ort/__init__.py), each rewrite written
in its own module; reading the table tells which run for ort, rknn or fp16 without reading the backends, and a
backend asks the table (`runs`) for each rewrite a setting can turn off, rather than repeating its conditions
(tests/quantize/test_rewrites.py fails when one does). The optimize stage's passes have their registry in
qprep/optimize/passes/__init__.py; the QDQ stages' rules are verified by qdq/verified.py.

`exact` is the verify-or-revert of a rewrite that must not change the numbers: the rewritten model's outputs on
calibration samples against the model's own, and the reason (logged) when they differ, so the rewrite hands back
the model as it was.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import onnx

from qprep.graph.verify import rewrite_mismatch

log = logging.getLogger("qprep")


@dataclass(frozen=True)
class Rewrite:
    name: str  # its record in the quantize stage's details
    module: str  # where it is written
    backends: tuple[str, ...]  # the backends that run it
    when: str  # before calibration | after the build
    doc: str
    applies: Callable[[Any], bool] | None = None  # (the backend's settings) → on; None: no setting turns it off


def _quantizing(options) -> bool:
    """rknn builds without int8 when do_quantization is off: nothing for an int8 rewrite to help."""
    return getattr(options, "do_quantization", True)


# In the order a backend runs them.
REWRITES: tuple[Rewrite, ...] = (
    Rewrite("opset_converted", "qprep/quantize/rknn/limits.py", ("rknn",), "before calibration",
            "the opset converted down to what rknn-toolkit2 takes"),
    Rewrite("static_graph", "qprep/quantize/rknn/static_graph/", ("rknn",), "before calibration",
            "loops unrolled, branches chosen, shapes fixed: the static graph the NPU compiles"),
    Rewrite("float16_clip", "qprep/quantize/rknn/limits.py", ("rknn",), "before calibration",
            "constants beyond float16 clipped where the outputs stay as they were"),
    Rewrite("float16_range", "qprep/quantize/float16_range.py", ("rknn",), "before calibration",
            "a chain whose values overflow float16 scaled down by a power of two (exact)"),
    Rewrite("smoothed_layernorms", "qprep/quantize/smooth_layernorm.py", ("ort", "rknn"), "before calibration",
            "spread LayerNorm outputs smoothed into the following MatMuls' weights (exact)",
            applies=lambda options: options.smooth_layernorm and _quantizing(options)),
    Rewrite("outlier_positions", "qprep/quantize/outlier_positions.py", ("rknn",), "before calibration",
            "LayerNorm chains computed apart for outlier sequence positions (exact)",
            # only with normal ranges: mmse and kl clip the copies that hold the outlier positions
            # (BENCHMARKS.md: "outlier positions computed apart")
            applies=lambda options: (options.split_outlier_positions and _quantizing(options)
                                     and options.quantized_algorithm == "normal")),
    Rewrite("residual_channels", "qprep/quantize/residual_channels.py", ("rknn",), "before calibration",
            "residual sums' huge channels scaled down, their LayerNorms computed from the scaled sums (exact)",
            applies=lambda options: options.rescale_residual_channels and _quantizing(options)),
    Rewrite("maxpool_float", "qprep/qdq/float_maxpool.py", ("ort",), "after the build",
            "MaxPools between Q/DQ computed in float, where ORT would run a slow uint8 kernel (exact)",
            applies=lambda options: options.activations != "dynamic"),
    Rewrite("channel_padding", "qprep/quantize/ort/channel_padding.py", ("ort",), "after the build",
            "channel counts padded to multiples of 16 for ORT's fast int8 kernels (exact; kept if faster)",
            applies=lambda options: (options.fast_kernels and options.format == "qdq"
                                     and options.activations != "dynamic")),
)


def of(backend: str) -> list[Rewrite]:
    """The rewrites `backend` runs, in order."""
    return [rewrite for rewrite in REWRITES if backend in rewrite.backends]


def runs(name: str, backend: str, options) -> bool:
    """Does `backend` with these settings run the rewrite `name`? (A name the table does not hold is qprep's
    error: KeyError.)"""
    rewrite = {r.name: r for r in REWRITES}[name]
    return backend in rewrite.backends and (rewrite.applies is None or bool(rewrite.applies(options)))


def exact(what: str, original: onnx.ModelProto, reference: list[dict], rewritten: onnx.ModelProto,
          samples: list[dict], threads: int = 2) -> str:
    """The verify-or-revert of a rewrite meant to be exact: "" when `rewritten` computes on `samples` what
    `original` did (`reference`: its outputs there, often from the run that planned the rewrite), else the reason,
    logged with `what` the rewrite did; the caller then hands back `original`. Exact in math: a failure means the
    pattern matched something it should not have."""
    reason = rewrite_mismatch(original, reference, rewritten, samples, threads)
    if reason:
        log.warning("quantize: %s changed the outputs (%s); the model is left as it was", what, reason)
    return reason
