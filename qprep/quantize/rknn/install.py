"""`qprep setup rknn`: rknn-toolkit2 into the Python environment qprep runs in, with the pins it needs and a
CPU torch.

Why a command and not a pip extra: `pip install rknn-toolkit2==2.5.0` follows the wheel's metadata, which asks for
torch<=2.4 (pip takes a CUDA build of several GB on Linux), opencv-python and numpy<=1.26.4, and downgrades what
the user had. An extra cannot say "this package without its declared dependencies". So: the toolkit's real
dependencies go in first under the constraints file qprep ships (constraints.txt next to this module: numpy
1.26.4, onnx 1.18.0, protobuf 4.25.4, onnxruntime 1.26.0, setuptools<81: the set it imports and builds with),
opencv-python-headless instead of opencv-python; torch, which the toolkit imports at start (rknn.api.gdq_quant
imports torch.nn), from PyTorch's CPU index unless one is already installed; the toolkit itself last with
--no-deps. The import is then checked in a fresh interpreter.
"""

from __future__ import annotations

import importlib.resources
import subprocess
import sys
from dataclasses import dataclass

from qprep.errors import QprepError

TOOLKIT = "rknn-toolkit2==2.5.0"
DEPENDENCIES = ("numpy", "onnx", "onnxruntime", "protobuf", "setuptools", "psutil", "ruamel.yaml", "scipy",
                "tqdm", "fast-histogram", "opencv-python-headless")  # the toolkit's, torch and opencv aside
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
PYTHONS = ((3, 11), (3, 12))  # the pinned set has wheels for these (ORT 1.26: none for 3.10; toolkit: none for 3.13)


@dataclass(frozen=True)
class Plan:
    commands: list[list[str]]
    notes: list[str]


def constraints_path() -> str:
    return str(importlib.resources.files("qprep.quantize.rknn") / "constraints.txt")


def plan(python: str = sys.executable, torch: str = "torch", torch_index: str = TORCH_CPU_INDEX,
         have_torch: bool | None = None, version: tuple[int, int] = sys.version_info[:2]) -> Plan:
    """The pip commands that install the toolkit into `python`'s environment (nothing is run)."""
    if version not in PYTHONS:
        raise QprepError(f"setup rknn: rknn-toolkit2 2.5.0 with its pins installs on CPython "
                         f"{' or '.join('%d.%d' % v for v in PYTHONS)}, this is {version[0]}.{version[1]}; make a "
                         f"venv with one of those (e.g. `python3.11 -m venv .venv-rknn`) and install qprep there")
    pip = [python, "-m", "pip", "install", "--disable-pip-version-check", "-c", constraints_path()]
    commands = [pip + list(DEPENDENCIES)]
    notes = ["numpy, onnx, onnxruntime and protobuf are set to the toolkit's pins in this environment "
             f"({constraints_path()}); use a separate venv if other packages here need numpy 2"]
    if have_torch is None:
        have_torch = _importable(python, "import torch")
    if have_torch:
        notes.append("torch is already installed: kept")
    else:
        commands.append(pip + [torch] + (["--index-url", torch_index] if torch_index else []))
    commands.append(pip + ["--no-deps", TOOLKIT])
    return Plan(commands, notes)


def install(python: str = sys.executable, torch: str = "torch", torch_index: str = TORCH_CPU_INDEX,
            dry_run: bool = False, say=print) -> None:
    """Run the plan, then check that the toolkit imports; a failing step is one QprepError line."""
    steps = plan(python, torch, torch_index)
    for note in steps.notes:
        say(f"qprep: {note}")
    for command in steps.commands:
        say("qprep: " + " ".join(command))
        if dry_run:
            continue
        done = subprocess.run(command)
        if done.returncode != 0:
            raise QprepError(f"setup rknn: pip failed (exit {done.returncode}) on `{' '.join(command[3:])}`; its "
                             "message is above")
    if not dry_run:
        if not _importable(python, "from rknn.api import RKNN"):
            raise QprepError("setup rknn: rknn-toolkit2 is installed but `from rknn.api import RKNN` fails; run "
                             f"`{python} -c 'from rknn.api import RKNN'` to see why")
        say("qprep: rknn-toolkit2 ready: `backend: rknn` works in this environment")


def _importable(python: str, statement: str) -> bool:
    """Does `statement` (an import) run in a fresh `python`: the environment as installed, not this process's."""
    return subprocess.run([python, "-c", statement], capture_output=True).returncode == 0
