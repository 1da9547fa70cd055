#!/usr/bin/env bash
# Run the whole test suite (unit and integration on real parts: mosquitto, onnxruntime, subprocesses).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash tools/setup_venv.sh
command -v mosquitto >/dev/null || [ -x /usr/sbin/mosquitto ] || {
  echo "mosquitto is not installed: sudo apt-get install -y mosquitto" >&2; exit 2; }
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -q "$@"
