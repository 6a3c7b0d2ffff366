#!/usr/bin/env bash
# Set up qprep on a fresh machine: .venv with qprep and everything the shipped configs need
# (rknn-toolkit2 2.5.0, CPU torch for the demo exports), then the real demo models in models/ and the
# QDQ/QAT models derived from them.
# Idempotent: when nothing that decides the install has changed, the second call only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=$ROOT/.venv
CONSTRAINTS=$ROOT/scripts/constraints.txt

pick_python() {
  for candidate in "${PYTHON:-}" python3.11 python3; do
    [ -n "$candidate" ] && command -v "$candidate" >/dev/null 2>&1 && { echo "$candidate"; return; }
  done
  echo "qprep setup: no python3 found; install Python 3.11 and rerun" >&2; exit 2
}

[ -x "$VENV/bin/python" ] || { echo "qprep setup: creating .venv"; "$(pick_python)" -m venv "$VENV"; }
PY=$VENV/bin/python
PIP=("$PY" -m pip --disable-pip-version-check -q)
# This machine's pip config lists local index folders that may be absent: hide only that warning.
quiet_pip() { "${PIP[@]}" "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }

stamp=$(cat pyproject.toml "$CONSTRAINTS" qprep/quantize/rknn/constraints.txt scripts/setup.sh | sha256sum | cut -c1-16)
if [ "$(cat "$VENV/.qprep-setup" 2>/dev/null)" != "$stamp" ]; then
  echo "qprep setup: installing packages (constraints: scripts/constraints.txt)"
  # Everything resolvable goes through one pip call so the resolver sees every pin at once.
  quiet_pip install -c "$CONSTRAINTS" -e ".[demo,dev,ray]" \
      setuptools typing_extensions filelock jinja2 networkx fsspec sympy \
      psutil ruamel.yaml fast-histogram tqdm opencv-python-headless scipy
  # Packages whose metadata would drag in a CUDA torch, opencv-python or numpy 2: installed without
  # their declared dependencies (those are installed above, pinned).
  quiet_pip install -c "$CONSTRAINTS" --no-deps torch==2.13.0 efficientnet-lite-pytorch==0.1.0
  if "$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
    quiet_pip install -c "$CONSTRAINTS" --no-deps rknn-toolkit2==2.5.0
  else
    echo "qprep setup: rknn-toolkit2 2.5.0 ships only for CPython 3.11; the RKNN backend is not installed"
  fi
  "$PY" -c 'import numpy, onnx, onnxruntime; print("qprep setup: numpy", numpy.__version__, "onnx", onnx.__version__, "onnxruntime", onnxruntime.__version__)'
  echo "$stamp" > "$VENV/.qprep-setup"
fi

"$PY" scripts/fetch_models.py
"$PY" scripts/build_qdq_fixtures.py   # QDQ/QAT test and demo models (models/qdq/), built from the demo models
echo "qprep setup: ready (.venv/bin/qprep)"
