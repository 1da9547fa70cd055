#!/usr/bin/env bash
# Create .venv (if missing) and install Edgepack with the host and dev extras, editable.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -e ".[dev]"
echo "installed: $(.venv/bin/python -c 'import onnxruntime, onnx, numpy; print("onnxruntime", onnxruntime.__version__, "onnx", onnx.__version__, "numpy", numpy.__version__)')"
