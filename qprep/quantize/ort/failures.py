"""The nodes ONNX Runtime's quantizer fails on, found and kept float so that the rest of the model quantizes.

Why: ORT's quantizer raises bare errors on constructs it does not expect (a Gemm bias of shape [1, N] with
per-channel weights: "The truth value of an array with more than one element is ambiguous"), and also writes
models ONNX Runtime cannot run (uint8 weights on such a Gemm: a per-axis DequantizeLinear of that bias, "scale
must be 1D tensor with size 1"). Either way the rest of the model quantizes fine without the node. The failing
node is found by bisection over the nodes ORT would quantize (nodes_to_exclude), recorded with ORT's message and
left out of every later build too.

Not every failure is one node's. A model that defines a name twice (ORT: "Duplicate definition of name", "two
nodes with same node name"; onnx: "SSA form"; qprep's own check, graph/names.py) fails whichever nodes are
quantized, or fails for some and not others by chance of naming: bisecting it cost issue #61's U-Net 454 s and
ended telling the user to exclude a node. Such a failure stops the build at once as `WholeModelFailure`, exit 3:
the model qprep handed over was invalid, which is qprep's bug.
"""

from __future__ import annotations

import logging
import re
from typing import Callable

import onnx

from qprep.errors import QprepError
from qprep.graph.names import DuplicateNames
from qprep.model.runtime import ort_session, session_outputs, short_ort_message
from qprep.quantize.ort.settings import OrtSettings

log = logging.getLogger("qprep")

MAX_UNQUANTIZABLE = 16  # nodes ORT's quantizer fails on that are kept float before the failure is an error

# (ranges, nodes to exclude, settings) → the model ORT's quantizer writes (raw_build.RawBuild)
Quantize = Callable[[object, list[str], OrtSettings], onnx.ModelProto]


# ONNX Runtime's and onnx's words for a model that is invalid as a whole, not for a node it cannot take
WHOLE_MODEL = re.compile(r"Duplicate definition of name|two nodes with same node name|single static assignment"
                         r"|used as output names multiple times")


class WholeModelFailure(RuntimeError):
    """ORT's quantizer (or the session on its result) failed on the model as a whole, not on a node of it:
    qprep's bug, exit 3; the message holds the cause. Not a QprepError: nothing the user excludes fixes it."""


def whole_model(exc: Exception) -> WholeModelFailure | None:
    """`exc` as a WholeModelFailure when no node's exclusion can help, else None."""
    if isinstance(exc, WholeModelFailure):
        return exc
    line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if isinstance(exc, DuplicateNames):
        return WholeModelFailure(line)
    if WHOLE_MODEL.search(str(exc)):
        return WholeModelFailure(f"ONNX Runtime's quantizer failed on the model qprep prepared as a whole, not on "
                                 f"one node ({short_ort_message(line)[:300]}): qprep's bug, not the model's")
    return None


class Unquantizable:
    """`found`: node ORT's quantizer fails on → its message (kept float in every build)."""

    def __init__(self, model: onnx.ModelProto, samples: list[dict], threads: int, quantize: Quantize,
                 quantized_types: Callable[[OrtSettings], set[str]]):
        """`quantized_types(settings)`: the op types a build with those settings quantizes."""
        self.model, self.samples, self.threads = model, samples, threads
        self.quantize, self.quantized_types = quantize, quantized_types
        self.found: dict[str, str] = {}

    def around(self, ranges, excluded: frozenset[str], settings: OrtSettings, check: bool) -> onnx.ModelProto:
        """ORT's quantizer with `excluded` and the nodes it fails on kept float; with `check`, the result is run
        on one calibration sample too (the first build: later ones leave out what it found)."""
        while True:
            skip = sorted(excluded | set(self.found))
            try:
                return self._runnable(ranges, skip, settings, check=check)
            except QprepError:
                raise
            except Exception as exc:  # ORT raises bare exceptions
                failure = whole_model(exc)
                if failure is not None:
                    raise failure from exc
                if len(self.found) >= MAX_UNQUANTIZABLE:
                    raise
                culprit = self._failing_node(ranges, skip, settings)
                if culprit is None:
                    raise
                reason = f"{type(exc).__name__}: {short_ort_message(str(exc).splitlines()[0]) if str(exc) else ''}"
                self.found[culprit] = reason
                log.warning("ort: ONNX Runtime's quantizer fails on node %s (%s): kept float", culprit, reason)

    def _failing_node(self, ranges, skip: list[str], settings: OrtSettings) -> str | None:
        """The first node (graph order) whose quantization makes ORT's quantizer fail: with only the first k
        candidates quantized it fails for k >= that node's place, so a bisection over k finds it. None when the
        quantizer fails even with every candidate excluded (not a node's doing)."""
        types = self.quantized_types(settings)
        candidates = [n.name for n in self.model.graph.node if n.op_type in types and n.name not in skip]

        def fails(quantized: int) -> bool:
            try:
                self._runnable(ranges, skip + candidates[quantized:], settings, check=True)
                return False
            except Exception as exc:  # noqa: BLE001 - any failure of a node counts
                failure = whole_model(exc)
                if failure is not None:
                    raise failure from exc
                return True

        if not candidates or fails(0):
            return None
        low, high = 0, len(candidates)  # fails(low) is False; fails(high) is the failure being contained
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (low, middle) if fails(middle) else (middle, high)
        return candidates[high - 1]

    def _runnable(self, ranges, excluded: list[str], settings: OrtSettings, check: bool) -> onnx.ModelProto:
        """The quantized model, and with `check` the result run on one calibration sample: ORT's own exception
        is let through, so a node whose model ONNX Runtime cannot run is found and kept float like the
        quantizer's failures."""
        quantized = self.quantize(ranges, excluded, settings)
        if check and self.samples:  # as written (a fused kernel would skip the node); ORT's error line not printed
            session_outputs(ort_session(quantized, self.threads, log_severity=4), self.samples[:1])
        return quantized
