#!/usr/bin/env bash
# The core tests (`pytest -m "not slow"`) in a second venv with the newest numpy/onnx/ONNX Runtime a pip user
# gets, beside the RKNN-pinned .venv that scripts/setup.sh builds: qprep must work on both ends of the
# version floors pyproject.toml declares. Run by .ci/run; ~3 minutes the first time, the venv is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-latest
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
# This machine's pip config lists local index folders that may be absent: hide only that warning.
"$VENV/bin/python" -m pip --disable-pip-version-check -q install --upgrade ".[demo]" pytest \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
"$VENV/bin/python" -c 'import numpy, onnx, onnxruntime; print("latest stack: numpy", numpy.__version__, "onnx", onnx.__version__, "onnxruntime", onnxruntime.__version__)'
"$VENV/bin/python" -m pytest -m "not slow" -p no:cacheprovider
