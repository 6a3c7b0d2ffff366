"""Prove a transform kept the numbers: run before/after with ONNX Runtime on real samples, compare outputs.

Every output of every sample must satisfy |a - b| <= atol + rtol * |a| element-wise and a cosine of at least
`min_cosine`. The reference outputs of the model under test are cached, so a chain of passes runs each
accepted model once, not twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx

from qprep.model.io import is_large
from qprep.model.runtime import run_model


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


def checker_problem(model: onnx.ModelProto) -> str | None:
    """onnx.checker's complaint, if any: ORT happily runs some invalid graphs (e.g. an op newer than the
    opset import), so numeric verification alone would not catch them."""
    if is_large(model):
        return None  # the checker cannot take a >2 GB proto in memory; ORT verification still runs
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as exc:
        return f"invalid model: {str(exc).splitlines()[0][:200]}"
    return None


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a = np.asarray(a, dtype=np.float64).ravel()
    b = np.asarray(b, dtype=np.float64).ravel()
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    if na == 0 and nb == 0:
        return 1.0
    if na == 0 or nb == 0:
        return 0.0
    return float(np.dot(a, b) / (na * nb))


def is_numeric(value) -> bool:
    """A numeric tensor, not strings, sequences or maps (which have no accuracy figure)."""
    return isinstance(value, np.ndarray) and value.dtype.kind in "biuf"


def same_nonfinite(a: np.ndarray, b: np.ndarray) -> bool:
    """NaN/Inf at the same places with the same values in both (a -inf mask reproduced, no new overflow)."""
    finite = np.isfinite(a)
    return bool(np.array_equal(finite, np.isfinite(b)) and np.array_equal(a[~finite], b[~finite], equal_nan=True))


def compare(reference: list[dict], result: list[dict], tol: Tolerance) -> Verification:
    """Compare every output over all samples; the reason names each failing output and by how much."""
    outputs, reasons = {}, []
    for name in reference[0]:
        if name not in result[0]:
            return Verification(False, outputs, f"output '{name}' disappeared", len(reference))
        stats = {"max_abs": 0.0, "max_rel": 0.0, "cosine_min": 1.0}
        ok = True
        for ref, got in zip(reference, result):
            if not (is_numeric(ref[name]) and is_numeric(got[name])):
                if repr(ref[name]) != repr(got[name]):  # a rewrite must leave strings and maps exactly as they were
                    return Verification(False, outputs, f"output '{name}' (not a numeric tensor) changed",
                                        len(reference))
                continue
            a, b = ref[name].astype(np.float64), got[name].astype(np.float64)
            if a.shape != b.shape:
                return Verification(False, outputs, f"output '{name}' changed shape {a.shape} -> {b.shape}",
                                    len(reference))
            ok &= _compare_arrays(a, b, tol, stats)
        outputs[name] = {**stats, "ok": ok}
        if not ok:
            reasons.append(f"output '{name}': max |a-b| {stats['max_abs']:.3g}, cosine {stats['cosine_min']:.6f}")
    return Verification(not reasons, outputs, "; ".join(reasons), len(reference))


def _compare_arrays(a: np.ndarray, b: np.ndarray, tol: Tolerance, stats: dict) -> bool:
    """Update running stats with one sample; True when it is within tolerance."""
    # Non-finite reference values (e.g. -inf masks) must be reproduced exactly; finite ones within tolerance.
    same = same_nonfinite(a, b)
    finite = np.isfinite(a)
    a, b = np.where(finite, a, 0.0), np.where(finite, b, 0.0)
    diff = np.abs(a - b)
    if diff.size:
        stats["max_abs"] = max(stats["max_abs"], float(diff.max()))
        stats["max_rel"] = max(stats["max_rel"], float((diff / np.maximum(np.abs(a), 1e-12)).max()))
    within = bool((diff <= tol.atol + tol.rtol * np.abs(a)).all())
    if a.size and np.abs(a).max() <= 10 * tol.atol:
        return same and within  # an all-but-zero output: its direction (cosine) is rounding noise
    similarity = cosine(a, b)
    stats["cosine_min"] = min(stats["cosine_min"], similarity)
    return same and within and similarity >= tol.min_cosine


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
