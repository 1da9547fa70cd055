#!/usr/bin/env bash
# Run the test suite (unit and integration on real parts: mosquitto, onnxruntime, subprocesses).
#
#   bash tools/test.sh            everything, in one pytest run (README's command)
#   bash tools/test.sh --quick    the inner loop: every test but the slow ones, last run's failures
#                                 first, stop at the first failure
#   bash tools/test.sh --no-slow  every test but the ones marked slow (CI's "tests" step)
#   bash tools/test.sh --slow     only the tests marked slow: the conformance run, the long broker
#                                 outage, the end-to-end updates... (CI's "slow tests" step)
#
# Further arguments go to pytest, e.g. `bash tools/test.sh --quick tests/test_keys.py -k force`.
# --no-slow and --slow together run each test once, as the plain command does.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=all
case "${1:-}" in
  --quick | --no-slow | --slow) mode=${1#--}; shift ;;
  -h | --help) sed -n '2,12p' "$0" | cut -c3-; exit 0 ;;
esac
[ -x .venv/bin/python ] || bash tools/setup_venv.sh
command -v mosquitto >/dev/null || [ -x /usr/sbin/mosquitto ] || {
  echo "mosquitto is not installed: sudo apt-get install -y mosquitto" >&2; exit 2; }
# Lint and type-check first (mypy: 0 errors, strict for edgepack_core; see pyproject.toml).
check() { .venv/bin/ruff check . && .venv/bin/python -m mypy edgepack_core device_agent sdk; }
case "$mode" in
  all) check && exec .venv/bin/python -m pytest -q "$@" ;;
  quick) check && exec .venv/bin/python -m pytest -q -x --failed-first -m "not slow" "$@" ;;
  no-slow) check && exec .venv/bin/python -m pytest -q -m "not slow" "$@" ;;
  slow) exec .venv/bin/python -m pytest -q -m slow "$@" ;;
esac
