"""The FP32 reference outputs on the evaluation samples: run once, shared by quantize's fallback and the evaluation.

Why an object of its own: the fallback search measures every trial against the reference, and the final
evaluation compares the result with it; running the reference twice costs a full pass over the evaluation set.
The runner creates one `ReferenceOutputs` per run and hands it to both on the run context; whoever reads
`expected` first runs the model.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field
from functools import cached_property

import onnx

from qprep.data import SampleSet
from qprep.model.io import is_heavy, weightless, weights_bytes
from qprep.model.runtime import SessionRecipe, model_error, ort_session, session_outputs
from qprep.progress import Progress

RETRY_BYTES = 1 << 30


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
    _session: object = field(default=None, repr=False)  # built by session(), once
    _judging: dict = field(default_factory=dict, repr=False)  # judging()'s decisions, per setting
    as_written: str | None = None  # why the session runs the graph as written (ORT's optimizer failed on it)

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
            return self._outputs(self.samples.samples)

    @cached_property
    def heldout_expected(self) -> list[dict]:
        with self.progress.step("evaluation: FP32 reference outputs on the held-out samples"):
            return self._outputs(self.heldout.samples)

    def judging(self, tasks: dict, padding: str) -> tuple[dict, object]:
        """(output kinds, padding): how each output is judged (kinds.py) and which of its positions count
        (padding.py), decided once on the evaluation samples, so the fallback's trials, the evaluation and the
        held-out samples are judged alike. `tasks`, `padding`: the evaluation section's settings."""
        key = (repr(tasks), padding)
        if key not in self._judging:
            from qprep.measure.kinds import output_kinds
            from qprep.measure.padding import find

            expected = self.expected  # first: running the reference may leave a heavy model weightless (session)
            self._judging[key] = (output_kinds(self.model, expected, tasks),
                                  find(self.model, self.samples.samples, expected, padding))
        return self._judging[key]

    def session(self):
        """The reference's ORT session (deployed settings), built once and reused to time it. A heavy model is
        then kept as its weightless skeleton (what output kinds and the CTC dictionary read): the proto beside
        the session it was building made a big model's peak (BENCHMARKS.md: "a heavy model's proto let go before
        its session")."""
        if self._session is None:
            recipe = SessionRecipe(self.model)
            # kept to build again from, as written, should ORT's optimizer fail on it (not over RETRY_BYTES: the
            # proto beside ORT's copy is what the big-model peak was)
            spare = self.model if weights_bytes(self.model) <= RETRY_BYTES else None
            if is_heavy(self.model):
                self.model = weightless(self.model)[0]
                gc.collect()  # reference cycles left by the stages still reach the proto
            try:
                self._session = ort_session(recipe, threads=self.threads, optimize=True,
                                            log_severity=3 if spare is None else 4)
            except Exception as exc:  # noqa: BLE001 - ORT's own types; the graph as written is then the reference
                # ORT 1.26's fusions fail on some valid models (onnxconverter-common's float16 MiniLM:
                # SimplifiedLayerNormFusion "Attempting to get index by a name which does not exist")
                if spare is None:
                    raise
                self.as_written = str(exc).splitlines()[0][:200]
                self._session = ort_session(spare, threads=self.threads, optimize=False)
        return self._session

    def _outputs(self, samples: list[dict]) -> list[dict]:
        try:
            return session_outputs(self.session(), samples)
        except Exception as exc:  # ORT's own exception types
            raise model_error(exc) from None

    def release(self) -> None:
        """Drop the model once the evaluation has run it for the last time (outputs computed, latency timed): a
        big model's weights would otherwise stay in memory beside the per-layer error's two sessions. Collected at
        once: reference cycles left by the stages still reach the proto, and Python's collector has not run by
        then (BENCHMARKS.md: "the reference let go before the per-layer error")."""
        self.model = self._session = None
        gc.collect()
