"""Prove a transform kept the numbers: run before/after with ONNX Runtime on real samples, compare outputs.

Every output of every sample must satisfy |a - b| <= atol + rtol * |a| element-wise and a cosine of at least
`min_cosine`. The reference outputs of the model under test are cached, so a chain of passes runs each
accepted model once, not twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx

from qprep.model_io import ort_session


@dataclass(frozen=True)
class Tolerance:
    atol: float = 1e-5
    rtol: float = 1e-4
    min_cosine: float = 0.99999

    @classmethod
    def from_config(cls, cfg: dict) -> "Tolerance":
        return cls(atol=cfg["atol"], rtol=cfg["rtol"], min_cosine=cfg["min_cosine"])


@dataclass
class Verification:
    ok: bool
    outputs: dict = field(default_factory=dict)  # name -> {max_abs, max_rel, cosine_min, ok}
    reason: str = ""
    samples: int = 0

    def as_dict(self) -> dict:
        return {"ok": self.ok, "reason": self.reason, "samples": self.samples, "outputs": self.outputs}


def run_model(model: onnx.ModelProto, samples: list[dict], threads: int = 2) -> list[dict[str, np.ndarray]]:
    """Outputs of `model` for every sample (only the inputs the model declares are fed)."""
    session = ort_session(model, threads=threads)
    names = [i.name for i in session.get_inputs()]
    outputs = [o.name for o in session.get_outputs()]
    return [dict(zip(outputs, session.run(outputs, {n: s[n] for n in names}))) for s in samples]


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a = np.asarray(a, dtype=np.float64).ravel()
    b = np.asarray(b, dtype=np.float64).ravel()
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    if na == 0 and nb == 0:
        return 1.0
    if na == 0 or nb == 0:
        return 0.0
    return float(np.dot(a, b) / (na * nb))


def compare(reference: list[dict], result: list[dict], tol: Tolerance) -> Verification:
    """Compare per output over all samples; the first failing output names the reason."""
    outputs, reasons = {}, []
    for name in reference[0]:
        if name not in result[0]:
            return Verification(False, outputs, f"output '{name}' disappeared", len(reference))
        max_abs = max_rel = excess = 0.0
        cos_min = 1.0
        for ref, got in zip(reference, result):
            a = np.asarray(ref[name], dtype=np.float64)
            b = np.asarray(got[name], dtype=np.float64)
            if a.shape != b.shape:
                return Verification(False, outputs, f"output '{name}' changed shape {a.shape} -> {b.shape}",
                                    len(reference))
            if a.size == 0:
                continue
            if not (np.isfinite(a) == np.isfinite(b)).all() or not (a[~np.isfinite(a)] == b[~np.isfinite(b)]).all():
                excess = np.inf
            diff = np.abs(a - b)
            diff[~np.isfinite(a)] = 0.0
            max_abs = max(max_abs, float(diff.max()))
            max_rel = max(max_rel, float((diff / np.maximum(np.abs(a), 1e-12)).max()))
            excess = max(excess, float((diff - (tol.atol + tol.rtol * np.abs(np.nan_to_num(a)))).max()))
            cos_min = min(cos_min, cosine(np.nan_to_num(a), np.nan_to_num(b)))
        ok = excess <= 0 and cos_min >= tol.min_cosine
        outputs[name] = {"max_abs": max_abs, "max_rel": max_rel, "cosine_min": cos_min, "ok": ok}
        if not ok:
            reasons.append(f"output '{name}': max |a-b| {max_abs:.3g}, cosine {cos_min:.6f}")
    return Verification(not reasons, outputs, "; ".join(reasons), len(reference))


class Verifier:
    """Checks candidate models against the last accepted model's outputs on fixed samples.

    `set_reference(model)` runs the starting model once; each `check(candidate)` that passes makes the
    candidate the new reference, so a chain of N rewrites costs N + 1 model runs.
    """

    def __init__(self, samples: list[dict], tol: Tolerance, threads: int = 2, source: str = ""):
        self.samples = samples
        self.tol = tol
        self.threads = threads
        self.source = source  # where the samples come from, for records ("calibration" / "random")
        self.reference: list[dict] | None = None

    def set_reference(self, model: onnx.ModelProto) -> None:
        self.reference = run_model(model, self.samples, self.threads)

    def check(self, candidate: onnx.ModelProto) -> Verification:
        if self.reference is None:
            raise RuntimeError("Verifier.check called before set_reference")
        result = run_model(candidate, self.samples, self.threads)
        verdict = compare(self.reference, result, self.tol)
        if verdict.ok:
            self.reference = result
        return verdict
