"""`weight_type: auto` and `reduce_range: auto` resolved for this CPU, so that the model evaluated here (and run
on any CPU) computes what its QDQ graph says.

Why: where this CPU's u8s8 kernels saturate (model/saturation.py: x86 without VNNI sums int8 products in int16
pairs), full-range int8 weights lose most of a model's accuracy when ORT fuses its Convs, though the QDQ graph is
right. Static activations then get symmetric uint8 weights (ORT's u8u8 kernels widen to 16 bits: exact, and 8
bits where reduce_range keeps 7); dynamic activations (quantized per inference around their own zero point, which
keeps the pair sums mostly in range) keep 8-bit int8. The figures: BENCHMARKS.md: "ONNX Runtime's u8s8 kernels
saturate" and "uint8 weights on CPUs whose u8s8 kernels saturate". Configured types and ranges are taken as they
are.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from qprep.model.saturation import this_cpu, u8s8_saturates

log = logging.getLogger("qprep")


def weight_range(options):
    """(a copy of the ORT settings with weight_type and reduce_range resolved, the stage's `weights` record:
    type, reduce_range, why)."""
    weight_type, configured = options.weight_type, options.reduce_range
    if weight_type == "uint8":
        return replace(options, reduce_range=False), {"type": "uint8", "reduce_range": False,
                                                     "why": "configured; uint8 weights do not saturate"}
    if configured != "auto":
        return replace(options, weight_type="int8"), {"type": "int8", "reduce_range": configured, "why": "configured"}
    saturates = u8s8_saturates()
    why = this_cpu()
    if saturates and options.activations == "dynamic":
        why += "; dynamic activations keep 8-bit int8 weights (measured: MiniLM cosine 0.977 with them, 0.848 7-bit)"
        saturates = False
    if not saturates or weight_type == "int8":
        if saturates:
            log.info("ort: 7-bit weights (reduce_range): %s", why)
        return (replace(options, weight_type="int8", reduce_range=saturates),
                {"type": "int8", "reduce_range": saturates, "why": why})
    log.info("ort: symmetric uint8 weights: %s", why)
    return (replace(options, weight_type="uint8", reduce_range=False),
            {"type": "uint8", "reduce_range": False, "why": why + "; uint8 weights run on its exact u8u8 kernels"})
