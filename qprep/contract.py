"""The stage contract: what a stage reads (`RunContext`), what it hands back (`StageResult`), its signature
(`StageFunction`), and how the runner gathers the results for the steps after the stages (`Products`).

Why explicit: everything a stage does to the rest of the run is in its return value, so the runner is the one
place that applies it (to the report, the run directory, later stages' context, the evaluation), and a stage
can be read, called and tested on its own. The context is frozen: when a stage adds to what later stages read
(the float set), the runner hands the next stage a new context.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import onnx

from qprep.config import Config
from qprep.data import SampleSet
from qprep.disk import owned
from qprep.graph.verify import Verifier
from qprep.measure.reference import ReferenceOutputs
from qprep.progress import Progress

SampleRunner = Callable[[list[dict]], list[dict]]  # samples → one dict per sample (outputs, or per-layer rows)


@dataclass(frozen=True)
class RunContext:
    """What a stage reads: the config, the run directory, the samples, the verifier, the FP32 reference outputs
    and what earlier stages produced (the float set, maintained by the runner). Read-only for stages."""

    config: Config
    run_dir: Path
    calibration: SampleSet | None
    verifier: Verifier  # a rewrite against the model before it (ORT on calibration or random samples)
    progress: Progress
    reference: ReferenceOutputs | None = None  # with `evaluation:`; quantize's fallback and the evaluation share it
    float_set: frozenset[str] = frozenset()  # node names that stay float (keep_float), for the quantize backends
    # tells the run a folder a stage is about to make in the run directory: the running manifest lists it first,
    # so `--force` after a run killed outright removes that folder and nothing else of work/
    announce: Callable[[str], None] | None = None

    def work_dir(self, name: str) -> Path:
        """A folder inside the run directory for a stage's or toolkit's working files (never through a link)."""
        if self.announce:
            self.announce(f"work/{name}/**")
        return owned.folder_inside(self.run_dir, "work", name)


@dataclass
class StageResult:
    """What a stage hands back; the runner applies it (the stage record, `Products.add`, later stages' context).

    A stage that hands back `prepared_model` (quantize) also decides how the evaluation runs the result:
    its `runner`, `analyzer` and `deployable` replace earlier ones, None included."""

    model: onnx.ModelProto  # the next stage's input; model.onnx after the last stage
    details: dict = field(default_factory=dict)  # the stage-specific part of its record in report.json
    status: str = "ok"  # ok | skipped
    reason: str = ""  # why skipped
    rolled_back: list = field(default_factory=list)  # rewrites refused by verification (the record)
    warnings: list[str] = field(default_factory=list)  # → report["warnings"]
    float_set: set[str] = field(default_factory=set)  # keep_float's nodes → later stages' ctx.float_set, the report
    prepared_model: onnx.ModelProto | None = None  # the float model quantize started from → per-layer error
    runner: SampleRunner | None = None  # runs the result when it is not ONNX (RKNN's simulator) → evaluation
    analyzer: SampleRunner | None = None  # the backend's own per-layer analysis → evaluation
    deployable: str | None = None  # the artifact to ship when it is not model.onnx → report["result"]
    artifacts: dict[str, Path] = field(default_factory=dict)  # run-dir file name → where it is; the runner moves it
    closers: list[Callable[[], None]] = field(default_factory=list)  # called when the run ends (the RKNN worker)
    fallback_target: dict = field(default_factory=dict)  # quantize.fallback's target → the evaluation's gate


StageFunction = Callable[[onnx.ModelProto, RunContext, Any], StageResult]  # (model, ctx, its options: schema.settings)


@dataclass
class Products:
    """What the stages handed back for the steps after them, gathered by the runner: one `add` per stage."""

    warnings: list[str] = field(default_factory=list)
    artifacts: dict[str, Path] = field(default_factory=dict)
    closers: list[Callable[[], None]] = field(default_factory=list)
    prepared_model: onnx.ModelProto | None = None
    runner: SampleRunner | None = None
    analyzer: SampleRunner | None = None
    deployable: str | None = None
    fallback_target: dict = field(default_factory=dict)

    def take_prepared_model(self) -> onnx.ModelProto | None:
        """The prepared float model for its last user (the per-layer error), which lets it go once its session
        holds the weights: kept here, a multi-GB proto stays beside that session."""
        model, self.prepared_model = self.prepared_model, None
        return model

    def add(self, result: StageResult) -> None:
        self.warnings += result.warnings
        self.artifacts.update(result.artifacts)
        self.closers += result.closers
        if result.prepared_model is not None:  # a quantized result: how the evaluation runs it
            self.prepared_model = result.prepared_model
            self.runner, self.analyzer, self.deployable = result.runner, result.analyzer, result.deployable
        if result.fallback_target:
            self.fallback_target = result.fallback_target
