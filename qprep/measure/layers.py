"""Per-layer error: where along the network the quantized model drifts from the float one.

Each float-model tensor is compared with the quantized model's tensor that computes it, decided by the graphs
(correspondence.py: a name can lie, ORT's quantizer gives a Conv the name of the Relu it absorbed), the rounded
copy a Q/DQ pair made first (the error quantizing it adds); a tensor no result tensor provably computes is left
out with the reason (`LayerComparison.left_out`). Both models run end to end, so this is the *accumulated* error
at each tensor.
"""

from __future__ import annotations

import numpy as np
import onnx

from qprep.graph.verify import cosine, same_nonfinite
from qprep.measure.correspondence import correspond
from qprep.measure.metrics import sqnr_of
from qprep.model.runtime import Intermediates

NOT_COMPARABLE = "not one float tensor of one shape in every sample"
NOT_FLOAT = "bool or integer tensors, not rounded"  # a mask, ids, indices: no float value to compare


def matched_tensors(float_model: onnx.ModelProto, quantized: onnx.ModelProto) -> list[tuple[str, str, str, str]]:
    """(float tensor, quantized tensor, op type, node name) for every float node output a result tensor
    provably computes (correspondence.py)."""
    return correspond(float_model, quantized).pairs


def layer_errors(float_model: onnx.ModelProto, quantized: onnx.ModelProto, samples: list[dict],
                 threads: int = 2) -> list[dict]:
    """Cosine and SQNR per matched float tensor, worst (lowest SQNR) first (see LayerComparison)."""
    return LayerComparison(float_model, quantized, threads).errors(samples)


class LayerComparison:
    """Both models' sessions with their matched tensors exposed (Intermediates: built on first use from what
    ORT needs, holding neither proto). A caller that hands over its last reference to a model frees it before
    the sessions are built (the 3.16 GB BERT's FP32 proto, beside both sessions, made this step the run's peak)."""

    def __init__(self, float_model: onnx.ModelProto, quantized: onnx.ModelProto, threads: int = 2):
        found = correspond(float_model, quantized)
        self.pairs, self.left_out = found.pairs, dict(found.left_out)  # float tensor → why it is not compared
        self.grids = found.grids  # result tensors held as integers → (scale, zero point) they stand for
        self.factors = found.factors  # result tensors a smoothing scaled → factor per channel (last axis)
        self.reference = Intermediates(float_model, [p[0] for p in self.pairs], threads) if self.pairs else None
        self.result = Intermediates(quantized, [p[1] for p in self.pairs], threads) if self.pairs else None

    def left_out_counts(self) -> dict[str, int]:
        """How many float tensors are left out, by reason (the report's "left out: N (reason)")."""
        counts: dict[str, int] = {}
        for reason in self.left_out.values():
            counts[reason] = counts.get(reason, 0) + 1
        return counts

    def errors(self, samples: list[dict]) -> list[dict]:
        """Both models run side by side one sample at a time, each tensor's error accumulated (`Drift`): holding
        every intermediate tensor of every sample of both models made this step the run's peak (BERT-large,
        8 samples: 16.5 GB, now 12.0); one sample's tensors of each model are alive at a time."""
        if not self.pairs:
            return []
        drifts = {tensor: Drift() for tensor, *_ in self.pairs}
        for sample in samples:
            ref, res = self.reference.values(sample), self.result.values(sample)
            for tensor, twin, *_ in self.pairs:
                drifts[tensor].add(ref.get(tensor), _dequantized(res.get(twin), self.grids.get(twin),
                                                                 self.factors.get(twin)))
            del ref, res  # before the next sample is computed
        rows = []
        for order, (tensor, twin, op_type, node) in enumerate(self.pairs):
            if drifts[tensor].comparable:
                rows.append({"tensor": tensor, "node": node, "op_type": op_type, "order": order,
                             **drifts[tensor].figures(), "quantized": twin != tensor})
            else:
                self.left_out[tensor] = NOT_FLOAT if drifts[tensor].not_float else NOT_COMPARABLE
        return sorted(rows, key=lambda r: (-float("inf") if r["sqnr_db"] is None else r["sqnr_db"], r["order"]))


class Drift:
    """One tensor's error over the samples, one sample at a time: per-sample cosine, and the sums SQNR is made
    of (as compare_output's "tensor" kind: non-finite entries that match compare as equal, a new NaN/Inf is a
    total miss). A tensor missing, not float, or changing shape in any sample is not comparable; one the float
    model holds as bool or integers is not a layer's float value at all, and is told apart (`not_float`)."""

    def __init__(self):
        self.cosines: list[float] = []
        self.signal = self.noise = 0.0
        self.size, self.broken, self.refused, self.not_float = 0, False, False, False

    @property
    def comparable(self) -> bool:
        return bool(self.cosines) and not self.refused

    def add(self, a: np.ndarray | None, b: np.ndarray | None) -> None:
        if a is not None and b is not None and _padded(a.shape, b.shape):
            b = b[:, :a.shape[1]]  # quantize/ort/channel_padding.py: zero channels after the real ones
        if a is None or b is None or a.dtype.kind != "f" or a.shape != b.shape:
            self.refused = True
            self.not_float |= a is not None and a.dtype.kind in "biu"
        if self.refused:
            return
        a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
        broken = False
        if not (np.isfinite(a).all() and np.isfinite(b).all()):  # rare; the masks took most of this step's time
            broken = not same_nonfinite(a, b)
            a, b = np.where(np.isfinite(a), a, 0.0), np.where(np.isfinite(a) & np.isfinite(b), b, 0.0)
        signal, error = float(np.dot(a, a)), a - b
        self.cosines.append(0.0 if broken else cosine(a, b))
        self.signal += signal
        self.noise += float(np.dot(error, error))
        self.size += a.size
        self.broken |= broken

    def figures(self) -> dict:
        sqnr = None if not self.size else float("-inf") if self.broken else sqnr_of(self.signal, self.noise)
        return {"cosine_mean": float(np.mean(self.cosines)), "cosine_min": float(np.min(self.cosines)),
                "sqnr_db": sqnr}


def _dequantized(values: np.ndarray | None, grid: tuple[np.ndarray, np.ndarray] | None,
                 factor: np.ndarray | None = None) -> np.ndarray | None:
    """The float values a result tensor stands for (correspondence.py): integers on their grid,
    (q - zero point) · scale; a smoothed tensor times its factor per channel (last axis)."""
    if values is not None and grid is not None:
        values = (values.astype(np.float64) - grid[1]) * grid[0]
    if values is not None and factor is not None:
        if not values.ndim or values.shape[-1] != factor.size:
            return None  # at another scale per channel than the float tensor: not comparable, never compared
        values = values * factor
    return values


def _padded(reference: tuple, result: tuple) -> bool:
    """`result` is `reference` with more channels (axis 1), as channel padding leaves an ORT model's tensors."""
    return (len(reference) == len(result) >= 3 and result[1] > reference[1]
            and reference[:1] + reference[2:] == result[:1] + result[2:])
