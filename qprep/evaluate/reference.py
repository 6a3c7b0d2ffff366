"""The FP32 reference outputs on the evaluation samples: run once, shared by quantize's fallback and the evaluation.

Why an object of its own: the fallback search measures every trial against the reference, and the final
evaluation compares the result with it; running the reference twice costs a full pass over the evaluation set.
The runner creates one `ReferenceOutputs` per run and hands it to both on the run context; whoever reads
`expected` first runs the model.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from functools import cached_property

import onnx

from qprep.data import SampleSet
from qprep.model.runtime import run_model
from qprep.progress import Progress


@dataclass
class ReferenceOutputs:
    """The FP32 reference, the evaluation samples (checked against its inputs: the result's may differ, e.g.
    float16) and, computed on first use, its outputs on them."""

    path: str  # where the reference came from (evaluation.reference_model, or the input model)
    model: onnx.ModelProto | None  # None once released
    samples: SampleSet
    threads: int
    progress: Progress
    heldout: SampleSet | None = None  # evaluation.heldout: only the final evaluation reads it

    @classmethod
    def of_run(cls, config, checked, progress: Progress) -> "ReferenceOutputs | None":
        """The FP32 reference of a run's evaluation (None without `evaluation:`): evaluation.reference_model,
        else the input as preflight loaded and prepared it (names, fixed dims), before any stage."""
        cfg = config["evaluation"]
        if not cfg:
            return None
        if cfg["reference_model"]:
            path, model = cfg["reference_model"], checked.reference
        else:
            path, model = config["model"], checked.model
        return cls(path, model, checked.evaluation, config["threads"], progress, checked.heldout)

    @cached_property
    def expected(self) -> list[dict]:
        """The reference's outputs, one dict per sample (run on the first read, then kept)."""
        with self.progress.step("evaluation: FP32 reference outputs"):
            return run_model(self.model, self.samples.samples, self.threads, optimize=True)

    @cached_property
    def heldout_expected(self) -> list[dict]:
        with self.progress.step("evaluation: FP32 reference outputs on the held-out samples"):
            return run_model(self.model, self.heldout.samples, self.threads, optimize=True)

    def release(self) -> None:
        """Drop the model once the evaluation has run it for the last time (outputs computed, latency timed): a
        big model's weights would otherwise stay in memory beside the per-layer error's two sessions (the
        24x1600 BERT was killed there at 23 GB). Collected at once: reference cycles left by the stages still
        reach the proto, and Python's collector had not run by then (measured on that BERT: the per-layer error
        started at 9.6 GB resident, 6.8 GB with this collection)."""
        self.model = None
        gc.collect()
