"""What one ORT build may vary beyond its float set: one immutable value, the builds' cache key.

Why immutable: the fallback (ort/search.py) tries other values per trial (mse ranges, bias correction on or off,
op types left float, spread tensors), and asks for each build with its settings; the quantizer is never
reconfigured from outside, so a cached build can never stand for another.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class OrtSettings:
    """What one build may vary beyond the float set; the rest of the options are fixed per run."""

    calibrate_method: str  # how activation ranges are chosen (ORT's calibrators, or qprep's "mse")
    bias_correction: bool  # correct the integer biases (static QDQ only)
    float_op_types: frozenset[str] = field(default_factory=frozenset)  # op types not quantized at all
    # activations whose channels spread too far for one int8 scale (channel_spread.py): their producer and
    # consumers left float, or (option spread_tensors: int16) the tensors quantized to 16 bits
    spread_tensors: frozenset[str] = field(default_factory=frozenset)
