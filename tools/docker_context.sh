#!/usr/bin/env bash
# Make the build context of deploy/docker/agent.Dockerfile and server.Dockerfile: OUT/wheels holds
# both Edgepack wheels (tools/build_wheels.py), every dependency's wheel and
# server-requirements.txt, so `docker build` installs with `pip install --no-index` (offline).
#
#   bash tools/docker_context.sh OUT [PIP_DOWNLOAD_OPTIONS...]
#
# The dependencies are downloaded for this machine's Python (the image's Python must match:
# python:3.11-slim and Debian bookworm both run 3.11); for another Python or CPU pass pip's own
# options, e.g. `--python-version 3.11 --platform manylinux_2_28_aarch64 --only-binary=:all:`.
# PYTHON (default .venv/bin/python) builds the wheels and runs pip.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
[ $# -ge 1 ] || { echo "usage: tools/docker_context.sh OUT [PIP_DOWNLOAD_OPTIONS...]" >&2; exit 2; }
OUT=$1; shift
PY=${PYTHON:-$REPO/.venv/bin/python}
[ -x "$PY" ] || PY=python3
WHEELS=$OUT/wheels
mkdir -p "$WHEELS"
rm -f "$WHEELS"/edgepack-*.whl "$WHEELS"/edgepack_agent-*.whl
"$PY" "$REPO/tools/build_wheels.py" "$WHEELS" --no-build-isolation >/dev/null
cp "$REPO/deploy/docker/server-requirements.txt" "$WHEELS/"
# Every requirement but `edgepack` itself (a name on PyPI that is not this project): the two
# wheels are given by path instead, so pip resolves their dependencies from them.
mapfile -t REQS < <(grep -v -e '^#' -e '^edgepack$' -e '^\s*$' "$REPO/deploy/docker/server-requirements.txt")
"$PY" -m pip download -q --disable-pip-version-check --only-binary=:all: -d "$WHEELS" "$@" \
  "$WHEELS"/edgepack_agent-*.whl "$WHEELS"/edgepack-*.whl "${REQS[@]}"
echo "$WHEELS"
