"""Where a qprep run's memory peaks: the high-water mark of resident memory (VmHWM) at every progress step.

Why not sample RSS from a thread: the peaks come from C calls that hold the GIL (ONNX Runtime building a session,
protobuf serializing a model), so a sampler thread never sees them. The run's own progress steps are the
checkpoints instead (Linux only: /proc/self/status).

    .venv/bin/python scripts/memory_by_step.py CONFIG [--out DIR]
"""

from __future__ import annotations

import argparse
import time

from qprep.config import load_config
from qprep.pipeline.runner import execute
from qprep.progress import Progress


def high_water_gb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM"):
                return int(line.split()[1]) / 1e6
    return float("nan")


class StepLog:
    """A progress stream that prints each step with the time since start and the high-water mark so far."""

    def __init__(self):
        self.started = time.time()

    def write(self, text: str) -> None:
        for part in text.replace("\r", "\n").split("\n"):
            if part.strip():
                print(f"{time.time() - self.started:7.1f} s  high-water {high_water_gb():6.2f} GB  {part.strip()[:120]}",
                      flush=True)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--out", help="run directory (default: the config's output_dir)")
    args = parser.parse_args()
    config = load_config(args.config, {"output_dir": args.out} if args.out else None)
    execute(config, force=True, progress=Progress(enabled=True, stream=StepLog()))
    print(f"peak {high_water_gb():.2f} GB")


if __name__ == "__main__":
    main()
