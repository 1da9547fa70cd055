#!/usr/bin/env bash
# Prove the device agent on arm64 (Raspberry Pi class) under qemu user-mode emulation.
#
# Builds (and caches) a Debian bookworm arm64 root, installs the device distribution
# `edgepack-agent` into a venv inside it from a wheel built here (distributions/edgepack-agent),
# checks that this install stands alone (tools/device_install_check.py: no sdk, no `edgepack`
# command, the systemd unit and schemas inside the package), then inside the root: verifies each
# demo artifact, installs it into a store (golden smoke test) and runs `edgepack-agent predict`,
# and compares the outputs with the same predict on this x86 host (max abs diff <= 1e-4). It also proves the
# device side stays light there (no onnx, no host-only packages). One PASS/FAIL line per check;
# exit status non-zero on any failure. Mounts are cleaned up whatever happens.
#
#   bash tools/arm64_check.sh            (root; CI runs it from .ci/run)
#
# Pitfalls handled (each seen on these machines): /sys must stay out of the root or
# `import onnxruntime` crashes under qemu (it reads the host's CPU description), so only /proc
# is mounted; pip runs inside the root with the root's own Python so it picks manylinux_2_28
# aarch64 wheels; the host's CA bundle is copied in for an intercepting HTTPS proxy and the
# chroot starts from a clean environment.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${EDGEPACK_ARM64_CACHE:-/var/cache/edgepack/arm64}
ROOTFS=$CACHE/rootfs
MIRROR=${EDGEPACK_DEBIAN_MIRROR:-http://deb.debian.org/debian}
PY=${PYTHON:-$REPO/.venv/bin/python}
[ -x "$PY" ] || PY=python3
BIN=$(dirname "$PY")
WORK=$(mktemp -d /tmp/edgepack-arm64.XXXXXX)
LOG=$WORK/arm64.log
START=$(date +%s)
# shellcheck source=tools/check_helpers.sh
. "$REPO/tools/check_helpers.sh"  # say, pass, fail, run_logged; FAILED=0
cleanup() {
  for mount in "$ROOTFS/work" "$ROOTFS/proc"; do
    if mountpoint -q "$mount" 2>/dev/null; then umount -l "$mount" || true; fi
  done
  rm -rf "$WORK"
}
trap cleanup EXIT

CHROOT=$(command -v chroot)
in_root() {  # in_root CMD...: run inside the arm64 root with a clean environment
  env -i PATH=/opt/edgepack-venv/bin:/usr/local/bin:/usr/bin:/bin HOME=/root LANG=C.UTF-8 \
    PIP_CERT=/etc/ssl/certs/host-ca.crt PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1 \
    "$CHROOT" "$ROOTFS" "$@"
}

[ "$(id -u)" = 0 ] || { say "FAIL arm64 check needs root (chroot, mounts)"; exit 2; }

# 1. Host tools and binfmt_misc for qemu-aarch64.
if ! command -v debootstrap >/dev/null || [ ! -x /usr/bin/qemu-aarch64-static ]; then
  export DEBIAN_FRONTEND=noninteractive
  run_logged "apt-get update" apt-get update -qq
  run_logged "install debootstrap and qemu" apt-get install -y -qq debootstrap qemu-user-static binfmt-support
fi
if [ ! -e /proc/sys/fs/binfmt_misc/status ]; then
  mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc 2>>"$LOG" || true
fi
update-binfmts --enable qemu-aarch64 >>"$LOG" 2>&1 || true
if [ -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ]; then pass "binfmt_misc runs aarch64 binaries through qemu"
else fail "binfmt_misc has no qemu-aarch64 entry"; exit 1; fi

# 2. The arm64 root (cached; a marker says it is complete).
if [ ! -f "$ROOTFS/.edgepack-complete" ]; then
  say "building the arm64 bookworm root in $ROOTFS (about 5 minutes, once)"
  rm -rf "$ROOTFS"; mkdir -p "$ROOTFS"
  run_logged "debootstrap arm64" debootstrap --arch=arm64 --variant=minbase \
    --include=python3,python3-venv,python3-pip,ca-certificates bookworm "$ROOTFS" "$MIRROR"
  touch "$ROOTFS/.edgepack-complete"
fi
cp /etc/ssl/certs/ca-certificates.crt "$ROOTFS/etc/ssl/certs/host-ca.crt"
mkdir -p "$ROOTFS/proc" "$ROOTFS/work"
mount -t proc proc "$ROOTFS/proc"
mount --bind "$WORK" "$ROOTFS/work"
ARCH=$(in_root python3 -c 'import platform; print(platform.machine())')
[ "$ARCH" = aarch64 ] && pass "arm64 root: $(in_root python3 --version) on $ARCH" || fail "root reports $ARCH"

# 3. The device wheel, installed in a venv inside the root.
run_logged "build the device wheel" "$PY" "$REPO/tools/build_wheels.py" "$WORK/wheel" --dist agent --no-build-isolation
WHEEL=$(cd "$WORK/wheel" && ls edgepack_agent-*.whl)
DEPS_KEY=$( (echo edgepack-agent; unzip -p "$WORK/wheel/$WHEEL" '*.dist-info/METADATA' | grep '^Requires-Dist' \
  | grep -v 'extra ==') | sha256sum | cut -c1-16)
if [ "$(cat "$ROOTFS/opt/edgepack-venv/.deps-key" 2>/dev/null)" != "$DEPS_KEY" ]; then
  say "creating the agent venv inside the root (dependencies from PyPI, aarch64 wheels)"
  rm -rf "$ROOTFS/opt/edgepack-venv"
  run_logged "create venv in root" in_root python3 -m venv /opt/edgepack-venv
  run_logged "pip install edgepack-agent in root" in_root /opt/edgepack-venv/bin/pip install -q \
    --index-url https://pypi.org/simple "/work/wheel/$WHEEL"
  echo "$DEPS_KEY" > "$ROOTFS/opt/edgepack-venv/.deps-key"
fi
run_logged "install the device wheel in root" in_root /opt/edgepack-venv/bin/pip install -q --no-deps \
  --force-reinstall "/work/wheel/$WHEEL"
ORT=$(in_root /opt/edgepack-venv/bin/python -c 'import onnxruntime as o; print(o.__version__, o.get_available_providers())' 2>/dev/null)
pass "edgepack-agent installed in the arm64 venv: onnxruntime $ORT"

# 4. Lightness and a device install that stands alone: no onnx, click or host-only packages, no
#    sdk and no `edgepack` command in the device venv; the unit and schemas in the package.
cp "$REPO/tools/device_install_check.py" "$WORK/device_install_check.py"
in_root /opt/edgepack-venv/bin/python /work/device_install_check.py || FAILED=1  # its own PASS/FAIL lines
pass "device venv size: $(du -sh "$ROOTFS/opt/edgepack-venv" | cut -f1)"

# 5. Reference outputs on this x86 host.
mkdir -p "$WORK/out"
run_logged "build demo models" "$PY" "$REPO/tools/build_demos.py" --out "$WORK/demo" --only mobilenet \
  --only digits --only tabular
cp -r "$REPO/recipes" "$WORK/recipes"
run_logged "keygen" "$BIN/edgepack" keygen --private "$WORK/release.key" --public "$WORK/release.pub"
declare -A INPUT=([mobilenet]=demo/mobilenet/images/img_000.png [digits]=demo/digits/val/digit_0000.png
                  [tabular]=demo/tabular/example.npy)
for name in mobilenet digits tabular; do
  run_logged "build $name" "$BIN/edgepack" build "$WORK/recipes/$name.yaml" --allow-external-paths \
    --key "$WORK/release.key" --output "$WORK/$name.edgepkg"
  run_logged "x86 predict $name" bash -c "'$BIN/edgepack-agent' predict --artifact '$WORK/$name.edgepkg' \
    --trust '$WORK/release.pub' --input '$WORK/${INPUT[$name]}' --json --outputs raw --profile rpi > '$WORK/out/$name.x86.json'"
done
pass "x86 reference outputs for mobilenet, digits, tabular"

# 6. The same on arm64, inside the root.
for name in mobilenet digits tabular; do
  if in_root edgepack-agent verify --artifact "/work/$name.edgepkg" --trust /work/release.pub >>"$LOG" 2>&1; then
    pass "arm64 verify $name"; else fail "arm64 verify $name"; continue; fi
  if in_root edgepack-agent install --store "/work/store-$name" --artifact "/work/$name.edgepkg" \
      --trust /work/release.pub --profile rpi > "$WORK/out/$name.install.json" 2>>"$LOG"; then
    pass "arm64 install $name (golden smoke test passed)"; else fail "arm64 install $name"; continue; fi
  if in_root edgepack-agent predict --artifact "/work/$name.edgepkg" --trust /work/release.pub \
      --input "/work/${INPUT[$name]}" --json --outputs raw --profile rpi > "$WORK/out/$name.arm64.json" 2>>"$LOG"; then
    pass "arm64 predict $name"; else fail "arm64 predict $name"; continue; fi
  if "$PY" "$REPO/tools/arm64/compare.py" "$WORK/out/$name.x86.json" "$WORK/out/$name.arm64.json" --atol 1e-4; then
    :; else FAILED=1; fi
done

ELAPSED=$(( $(date +%s) - START ))
if [ "$FAILED" = 0 ]; then say "arm64 check passed in ${ELAPSED}s"; else say "arm64 check FAILED (log: kept above)"; fi
exit "$FAILED"
