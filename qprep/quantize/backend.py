"""Quantization backends behind the one `quantize` stage: ONNX Runtime static INT8 (ort/), FP16 (fp16.py),
and RKNN (rknn/). Each takes the prepared float model, calibration samples and the float set (node names that
must stay float) and returns a `Quantized` result; qprep/quantize/stage.py is the stage that dispatches.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import onnx

from qprep.data import SampleSet
from qprep.quantize.nonfinite import Extremes


def carried_float_set(float_set: set[str], replaced: dict[str, list[str]]) -> set[str]:
    """`float_set` in a rewritten model: each node a rewrite replaced (outlier_positions' copies, the nodes that
    compute residual_channels' LayerNorm, float16_range's Log and the Add after it) by the nodes that do its
    work now; every other node as it was."""
    return {node for name in float_set for node in replaced.get(name, [name])}


@dataclass
class Quantized:
    """A backend's result: the ONNX model that continues down the pipeline (None when the artifact is not
    ONNX), extra deployable files, an optional runner for evaluation, and facts for the record."""

    model: onnx.ModelProto | None
    details: dict = field(default_factory=dict)
    artifacts: dict[str, Path] = field(default_factory=dict)  # file name in the run dir → where it is now
    deployable: str | None = None  # the artifact to ship, when it is not model.onnx (RKNN: model.rknn)
    runner: Callable[[list[dict]], list[dict]] | None = None  # None: evaluate the ONNX model with ORT
    analyzer: Callable[[list[dict]], list[dict]] | None = None  # per-layer rows from the backend's own tool
    close: Callable[[], None] | None = None  # frees what runner/analyzer hold (RKNN: the toolkit worker)
    warnings: list[str] = field(default_factory=list)  # → report["warnings"]
    float_set: frozenset[str] | None = None  # the float set of the model built, when the backend rewrote it first
    extremes: Extremes | None = None  # the extremes as the backend leaves them (rknn: back to int8; ort: upgrade)


@dataclass(frozen=True)
class QuantizeJob:
    """What every backend gets, resolved once by the quantize stage (qprep/quantize/stage.py) and read-only
    after: the prepared float model, calibration samples (capped at max_samples), the float set, the backend's
    settings (its config section, typed: schema.settings), a work folder inside the run directory and, with
    `quantize.fallback`, the search's settings, samples and measure. A backend that rewrites the model before
    its builds (rknn: float16 ranges, outlier positions) goes on with its own copy (`job.but(model=…)`); nothing
    is written back to the stage."""

    model: onnx.ModelProto
    calibration: "SampleSet | None"
    max_samples: int
    float_set: frozenset[str]
    options: Any  # the backend's settings: `quantize.<backend>` as schema.settings
    work_dir: Path
    fallback: Any = None  # `quantize.fallback` as schema.settings (target, time_budget_s, …) when the search is on
    measure: Callable[[list[dict], list[dict]], dict] | None = None  # (samples, their outputs) → per-output metrics
    evaluation_samples: tuple = ()  # what the fallback chooses on
    acceptance_samples: tuple = ()  # kept apart: what accepts its choice
    started: float | None = None  # perf_counter when the stage began: the fallback's time budget counts from it
    progress: object = None
    threads: int = 2
    extremes: Extremes = field(default_factory=Extremes)  # non-finite/huge tensors; their nodes are in float_set

    @property
    def samples(self) -> list[dict]:
        return self.calibration.samples[: self.max_samples] if self.calibration is not None else []

    def but(self, **changes) -> "QuantizeJob":
        """This job with `changes` (a rewritten model, its float set): a new job, this one unchanged."""
        return dataclasses.replace(self, **changes)
