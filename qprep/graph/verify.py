"""Prove a transform kept the numbers: run before/after with ONNX Runtime on real samples, compare outputs.

Every output of every sample must satisfy |a - b| <= atol + rtol * |a| element-wise and a cosine of at least
`min_cosine`, or stay within what float32 rounding alone does to it. Why the second: a rewrite that is exact in
math (a BatchNorm folded into a Conv, a LayerNorm fused) rounds differently, and 90 layers deep that moves a
sigmoid output by 7e-05, which a fixed atol of 1e-5 calls broken. So the Verifier measures each output's
float32 noise on the model it starts from: the same model run again with every weight of Conv/MatMul/Gemm one
rounding away (±1 ulp, seeded), which is what folding does to a weight, amplified through the real depth and
magnitudes of the network. A candidate may move an output `noise_factor` times that far (and at least
`noise_factor` ulps of the output's largest value); a real break (a wrong epsilon, swapped gamma/beta, a 1e-3
relative error in one layer) moves it 20-500 times that far on the demo models.

The reference outputs of the model under test are cached, so a chain of passes runs each accepted model once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import numpy_helper

from qprep.errors import ModelError
from qprep.model.io import is_heavy, is_large, weightless
from qprep.model.runtime import run_model


@dataclass(frozen=True)
class Tolerance:
    atol: float = 1e-5
    rtol: float = 1e-4
    min_cosine: float = 0.99999
    noise_factor: float = 8.0  # × the measured float32 noise a rewrite may add (0: atol/rtol/min_cosine only)

    @classmethod
    def from_config(cls, cfg: dict) -> "Tolerance":
        return cls(atol=cfg["atol"], rtol=cfg["rtol"], min_cosine=cfg["min_cosine"],
                   noise_factor=cfg["noise_factor"])


@dataclass(frozen=True)
class Float32Noise:
    """How far float32 rounding alone moves one output on one sample: the largest |ref - ref'| and
    ||ref - ref'|| / ||ref||, ref' from the model with its weights one rounding away (see the module doc)."""

    max_abs: float = 0.0
    rel_l2: float = 0.0

    def allowance(self, reference: np.ndarray, factor: float) -> tuple[float, float]:
        """(absolute error, relative L2 error) a rewrite may cause on this output and sample: `factor` times
        the measured noise, and never less than `factor` ulps of the output's scale (a weight-free graph has no
        measured noise, but its reorderings still round)."""
        finite = np.abs(reference[np.isfinite(reference)])
        scale = float(finite.max()) if finite.size else 0.0
        eps = float(np.finfo(np.float32).eps)
        return factor * max(self.max_abs, eps * scale), factor * max(self.rel_l2, eps)


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
    if is_heavy(model):  # the checker serializes the proto (over 2 GB it cannot): it checks the graph only
        model = weightless(model, placeholder="empty")[0]
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


def compare(reference: list[dict], result: list[dict], tol: Tolerance,
            noise: list[dict[str, Float32Noise]] | None = None) -> Verification:
    """Compare every output over all samples; the reason names each failing output and by how much. With
    `noise` (per sample and output, measured by the Verifier on the same samples), an output may also move as
    far as float32 rounding allows there."""
    outputs, reasons = {}, []
    for name in reference[0]:
        most_allowed = None
        if name not in result[0]:
            return Verification(False, outputs, f"output '{name}' disappeared", len(reference))
        stats = {"max_abs": 0.0, "max_rel": 0.0, "cosine_min": 1.0}
        ok = True
        for index, (ref, got) in enumerate(zip(reference, result)):
            if not (is_numeric(ref[name]) and is_numeric(got[name])):
                if repr(ref[name]) != repr(got[name]):  # a rewrite must leave strings and maps exactly as they were
                    return Verification(False, outputs, f"output '{name}' (not a numeric tensor) changed",
                                        len(reference))
                continue
            a, b = ref[name].astype(np.float64), got[name].astype(np.float64)
            if a.shape != b.shape:
                return Verification(False, outputs, f"output '{name}' changed shape {a.shape} -> {b.shape}",
                                    len(reference))
            allowed = None
            if noise is not None and tol.noise_factor > 0 and name in noise[index]:
                allowed = noise[index][name].allowance(a, tol.noise_factor)
                most_allowed = max(most_allowed or 0.0, allowed[0])
            ok &= _compare_arrays(a, b, tol, stats, allowed)
        if most_allowed is not None:
            stats["float32_allows"] = most_allowed
        outputs[name] = {**stats, "ok": ok}
        if not ok:
            limit = f" (float32 noise allows {most_allowed:.3g})" if most_allowed is not None else ""
            reasons.append(f"output '{name}': max |a-b| {stats['max_abs']:.3g}{limit}, "
                           f"cosine {stats['cosine_min']:.6f}")
    return Verification(not reasons, outputs, "; ".join(reasons), len(reference))



def rewrite_mismatch(original: onnx.ModelProto, reference: list[dict], rewritten: onnx.ModelProto,
                     samples: list[dict], threads: int = 2) -> str:
    """Why a rewrite meant to be exact is not: "" when `rewritten`'s outputs on `samples` match `reference` (the
    `original` model's, often from the run that planned the rewrite) within the default tolerance, else the
    comparison's reason or ONNX Runtime's error. A reference missing an output (one no node computes, e.g. an
    initializer listed as an output, which an intermediates run leaves out) is run again from `original`."""
    outputs = {o.name for o in original.graph.output}
    try:
        if any(outputs - set(values) for values in reference):
            reference = run_model(original, samples, threads)
        verdict = compare(reference, run_model(rewritten, samples, threads), Tolerance())
    except ModelError as exc:
        return str(exc)
    return "" if verdict.ok else verdict.reason


def _compare_arrays(a: np.ndarray, b: np.ndarray, tol: Tolerance, stats: dict,
                    allowed: tuple[float, float] | None = None) -> bool:
    """Update running stats with one sample; True when it is within tolerance, or within `allowed`
    (absolute, relative L2) float32 noise."""
    # Non-finite reference values (e.g. -inf masks) must be reproduced exactly; finite ones within tolerance.
    same = same_nonfinite(a, b)
    finite = np.isfinite(a)
    a, b = np.where(finite, a, 0.0), np.where(finite, b, 0.0)
    diff = np.abs(a - b)
    if diff.size:
        stats["max_abs"] = max(stats["max_abs"], float(diff.max()))
        stats["max_rel"] = max(stats["max_rel"], float((diff / np.maximum(np.abs(a), 1e-12)).max()))
    allowed_abs, allowed_rel = allowed or (0.0, 0.0)
    within = bool((diff <= np.maximum(tol.atol + tol.rtol * np.abs(a), allowed_abs)).all())
    if a.size and np.abs(a).max() <= 10 * tol.atol:
        return same and within  # an all-but-zero output: its direction (cosine) is rounding noise
    similarity = cosine(a, b)
    stats["cosine_min"] = min(stats["cosine_min"], similarity)
    min_cosine = min(tol.min_cosine, 1.0 - allowed_rel ** 2 / 2)  # 1 - cos = |a-b|^2 / 2|a|^2 off-direction
    return same and within and similarity >= min_cosine


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
        self.noise: list[dict[str, Float32Noise]] | None = None

    def set_reference(self, model: onnx.ModelProto) -> None:
        """Run the starting model, and (noise_factor > 0) measure its outputs' float32 noise: one more run."""
        self.reference = run_model(model, self.samples, self.threads)
        self.noise = None
        if self.tol.noise_factor > 0:
            self.noise = float32_noise(model, self.reference, self.samples, self.threads)

    def check(self, candidate: onnx.ModelProto) -> Verification:
        if self.reference is None:
            raise RuntimeError("Verifier.check called before set_reference")
        result = run_model(candidate, self.samples, self.threads)
        verdict = compare(self.reference, result, self.tol, self.noise)
        if verdict.ok:
            self.reference = result
        return verdict


MULTIPLY_ACCUMULATE = ("Conv", "ConvTranspose", "MatMul", "Gemm")


def float32_noise(model: onnx.ModelProto, reference: list[dict], samples: list[dict],
                  threads: int = 2) -> list[dict[str, Float32Noise]]:
    """Per sample and numeric output, how far it moves when every weight is one rounding away (module doc).
    Per sample, because an all-but-zero output (a detector's empty image) is mostly noise where others are not.
    A model over 2 GB is not copied for this: its outputs get the ulp-of-scale floor only."""
    moved = reference if is_large(model) else run_model(weights_one_ulp_away(model), samples, threads)
    noise = []
    for ref, got in zip(reference, moved):
        per_output = {}
        for name, value in ref.items():
            if not (is_numeric(value) and is_numeric(got.get(name))) or value.shape != got[name].shape:
                continue
            a, b = value.astype(np.float64), got[name].astype(np.float64)
            finite = np.isfinite(a) & np.isfinite(b)
            a, diff = np.where(finite, a, 0.0), np.abs(np.where(finite, a - b, 0.0))
            norm = float(np.linalg.norm(a))
            per_output[name] = Float32Noise(float(diff.max()) if diff.size else 0.0,
                                            float(np.linalg.norm(diff)) / norm if norm else 0.0)
        noise.append(per_output)
    return noise


def weights_one_ulp_away(model: onnx.ModelProto, seed: int = 0) -> onnx.ModelProto:
    """A copy whose constant Conv/MatMul/Gemm operands (initializers or Constant nodes, float types) are each
    moved one ulp up or down at random (seeded): one more rounding of every weight, the model otherwise equal.
    Only multiply-accumulate operands: an exponent, a Resize scale or a -inf mask must keep its exact value.
    Built from the weightless skeleton: a full copy whose weights were then replaced kept both in memory
    (protobuf frees a message's memory only with the whole message)."""
    copy = weightless(model)[0]
    weights = {name for node in copy.graph.node if node.op_type in MULTIPLY_ACCUMULATE
               for name in node.input[:2]}
    rng = np.random.default_rng(seed)

    def moved(tensor: onnx.TensorProto) -> onnx.TensorProto | None:
        array = numpy_helper.to_array(tensor)
        if array.dtype.kind != "f" or not array.size:
            return None
        toward = np.where(rng.random(array.shape) < 0.5, -np.inf, np.inf).astype(array.dtype)
        return numpy_helper.from_array(np.where(np.isfinite(array), np.nextafter(array, toward), array),
                                       tensor.name)

    for stub, tensor in zip(copy.graph.initializer, model.graph.initializer):
        new = moved(tensor) if tensor.name in weights else None
        stub.CopyFrom(tensor if new is None else new)
    for node in copy.graph.node:
        if node.op_type == "Constant" and node.output[0] in weights:
            for attr in node.attribute:
                if attr.name == "value" and (new := moved(attr.t)) is not None:
                    attr.t.CopyFrom(new)
    return copy
