import subprocess
import sys

import pytest

PROBE = """
import numpy as np
from qprep.memory import return_freed_memory
def rss_mb():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) >> 10
assert return_freed_memory()
np.ones(24 << 17).sum()  # a 24 MB block freed: glibc's own threshold would rise to 24 MB
blocks, pins = [], []
for _ in range(20):
    blocks.append(np.ones(12 << 17))  # 12 MB, a weight-sized block
    pins.append(np.ones(200))  # a small heap block above it keeps the heap from shrinking
before = rss_mb()
del blocks
print(before - rss_mb())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_freed_weight_sized_blocks_go_back_to_the_system():
    """Without the fixed threshold the 240 MB stay resident (glibc keeps them in the heap)."""
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
    assert int(done.stdout) >= 180
