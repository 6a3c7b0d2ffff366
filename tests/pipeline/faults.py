"""What every fault-suite case asserts, and a tiny real project to break.

A fault case runs the CLI as users do (`python -m qprep ...` in a subprocess: signals, exit codes and the
terminal are real) and checks the contract of issue #18: the exit code, at most one line on stderr and no
traceback, the input files byte-identical, and a previous run intact where it should be.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import yaml

from conftest import ROOT
from graphs import tiny_conv_model


@dataclass
class Outcome:
    code: int
    out: str
    err: str


# Root ignores file permissions; without the two capabilities that let it, a chmod 000 denies root too.
UNPRIVILEGED = (["setpriv", "--bounding-set=-dac_override,-dac_read_search"]
                if hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("setpriv") else [])
CAN_BE_DENIED = not (hasattr(os, "geteuid") and os.geteuid() == 0) or bool(UNPRIVILEGED)


def qprep(*args, cwd: Path | None = None, timeout: float = 300, stdin=None, unprivileged: bool = False) -> Outcome:
    """`python -m qprep ARGS` in a subprocess → exit code, stdout, stderr. `unprivileged`: file permissions
    apply (as root, the capabilities that bypass them are dropped)."""
    prefix = UNPRIVILEGED if unprivileged else []
    done = subprocess.run([*prefix, sys.executable, "-m", "qprep", *map(str, args)], capture_output=True,
                          text=True, cwd=cwd or ROOT, timeout=timeout, stdin=stdin)
    return Outcome(done.returncode, done.stdout, done.stderr)


def start(*args, cwd: Path | None = None) -> subprocess.Popen:
    """`python -m qprep ARGS` started in the background (for signals and concurrency), with SIGINT at its default
    even when the test runner inherited it ignored (a shell's background job does: Python then never raises
    KeyboardInterrupt and the signal tests would wait out their timeouts)."""
    return subprocess.Popen([sys.executable, "-m", "qprep", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=cwd or ROOT,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def assert_one_line(outcome: Outcome, code: int, *phrases: str) -> None:
    """Exit `code`, stderr at most one line, no traceback; each phrase appears in that line."""
    assert outcome.code == code, f"exit {outcome.code} (wanted {code}): {outcome.err}"
    lines = [line for line in outcome.err.splitlines() if line.strip()]
    assert len(lines) <= 1, f"more than one line on stderr:\n{outcome.err}"
    assert "Traceback" not in outcome.err
    assert "internal error" not in outcome.err or code == 3, outcome.err
    for phrase in phrases:
        assert phrase in outcome.err, f"{phrase!r} not in {outcome.err!r}"


def digests(*paths: Path) -> dict[str, str]:
    """sha256 of every file under `paths` (files or folders): compare before/after to prove nothing changed."""
    found = {}
    for path in paths:
        files = sorted(p for p in Path(path).rglob("*") if p.is_file()) if Path(path).is_dir() else [Path(path)]
        for file in files:
            if file.exists():
                found[str(file)] = hashlib.sha256(file.read_bytes()).hexdigest()
    return found


def wait_for(predicate, timeout: float = 60, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False


def interrupt(process: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 60) -> Outcome:
    process.send_signal(sig)
    out, err = process.communicate(timeout=timeout)
    return Outcome(process.returncode, out, err)


@dataclass
class Project:
    """A tiny float model with calibration and evaluation samples and a config that runs it end to end."""

    root: Path
    model: Path
    calibration: Path
    evaluation: Path
    config: Path
    out: Path

    def inputs(self) -> dict[str, str]:
        return digests(self.model, self.calibration, self.evaluation, self.config)

    def write_config(self, name: str = "config.yaml", **changes) -> Path:
        """The project's config with top-level keys changed (None removes a key) → its path."""
        values = yaml.safe_load(self.config.read_text())
        for key, value in changes.items():
            if value is None:
                values.pop(key, None)
            else:
                values[key] = value
        path = self.root / name
        path.write_text(yaml.safe_dump(values, sort_keys=False))
        return path


def project(root: Path, samples: int = 4, pipeline=("optimize", "quantize")) -> Project:
    """model.onnx (Conv+Relu, x[1,3,8,8]), calib/ and eval/ with .npy samples, config.yaml → out/."""
    root.mkdir(parents=True, exist_ok=True)
    model = root / "model.onnx"
    onnx.save(tiny_conv_model(batch=1), str(model))
    rng = np.random.default_rng(0)
    folders = []
    for name in ("calib", "eval"):
        folder = root / name
        folder.mkdir(exist_ok=True)
        for i in range(samples):
            np.save(folder / f"{i}.npy", rng.standard_normal((1, 3, 8, 8)).astype(np.float32))
        folders.append(folder)
    config = root / "config.yaml"
    config.write_text(yaml.safe_dump({
        "model": "model.onnx", "output_dir": "out",
        "calibration": {"source": "calib"},
        "evaluation": {"source": "eval", "latency": {"runs": 0}},
        "pipeline": [{name: {}} for name in pipeline]}, sort_keys=False))
    return Project(root, model, folders[0], folders[1], config, root / "out")
