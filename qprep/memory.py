"""Memory a run frees goes back to the system, so a big model's peak is what it holds, not what it once held.

Why: glibc's malloc serves blocks below its mmap threshold from the heap and keeps them there once freed, and
the threshold grows (up to 32 MB) each time a bigger mapped block is freed. After the first weight arrays are
freed, every later weight-sized block (BERT's matrices are 2–16 MB) comes from the heap and stays resident when
freed: a model's weights, copied and freed many times in a run (protos, arrays handed to ONNX Runtime), piled
up. A fixed threshold makes each block of 8 MB or more a mapping of its own, returned when freed; a lower one
makes every 1-8 MB activation fault its pages in afresh, which costs system CPU time (BENCHMARKS.md: "mmap
threshold 8 MB").
"""

from __future__ import annotations

import ctypes
import sys

M_MMAP_THRESHOLD = -3  # glibc's mallopt() parameter number
THRESHOLD = 8 << 20


def return_freed_memory() -> bool:
    """Fix glibc's mmap threshold at THRESHOLD for this process; False where there is no glibc mallopt()."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return mallopt(M_MMAP_THRESHOLD, THRESHOLD) == 1
