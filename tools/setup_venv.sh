#!/usr/bin/env bash
# Create .venv (if missing) and install Edgepack with the host and dev extras, editable: both
# distributions of the checkout, the device one (distributions/edgepack-agent: edgepack_core,
# device_agent, `edgepack-agent`) and the host one (.: sdk, `edgepack`, which depends on the
# device one, so pip must be given both in one command).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
# A venv from before the split holds one `edgepack` distribution that owned bin/edgepack-agent:
# replaced in the same pip run, its uninstall would delete the script edgepack-agent just wrote.
if .venv/bin/python -m pip show -q edgepack >/dev/null 2>&1 \
    && ! .venv/bin/python -m pip show -q edgepack-agent >/dev/null 2>&1; then
  .venv/bin/python -m pip uninstall -q -y edgepack
fi
.venv/bin/python -m pip install -q -e distributions/edgepack-agent -e ".[dev]"
# Optional: PyTorch for the export workflow and its tests (CI sets EDGEPACK_WITH_TORCH=1).
# Pinned: on these machines 2.13.0 is a CPU build on local disk; an unpinned torch pulls GBs of CUDA.
if [ "${EDGEPACK_WITH_TORCH:-0}" = 1 ]; then
  .venv/bin/python -m pip install -q "torch==${EDGEPACK_TORCH_VERSION:-2.13.0}"
fi
echo "installed: $(.venv/bin/python -c 'import onnxruntime, onnx, numpy; print("onnxruntime", onnxruntime.__version__, "onnx", onnx.__version__, "numpy", numpy.__version__)')"
