#!/usr/bin/env bash
# Prove the container images: both Dockerfiles build, the compose stack passes its health checks,
# a rollout goes through it and a container killed with SIGKILL comes back healthy.
#
#   bash tools/docker_check.sh            (root; CI runs it from .ci/run)
#
# 1. Docker: uses the running dockerd, or starts one with its own exec root, pidfile and socket
#    under a temporary folder and its data root beside the cache (stopped and removed at the end).
# 2. Bases, offline for the builds: one Debian bookworm root by `debootstrap --variant=minbase`
#    (python3, python3-venv) imported as the images' BASE; a copy of it with Debian's mosquitto
#    and PostgreSQL added (apt in the root) is the services base: mosquitto runs from it and
#    tools/docker/postgres.Dockerfile makes a postgres:16 stand-in. Both root tarballs are cached
#    under .cache/docker (EDGEPACK_DOCKER_CACHE), keyed by their package lists; CI starts fresh.
# 3. deploy/docker/agent.Dockerfile and server.Dockerfile built from tools/docker_context.sh's
#    wheels (`pip install --no-index`); the agent image checked by tools/device_install_check.py
#    (no onnx, click or sdk; serves; stops on SIGTERM) and for its non-root user.
# 4. deploy/docker/compose.yaml started with those images and fresh secrets; every health check
#    waited on (docker inspect, bounded); a digits artifact built here rolled out to the agent
#    with `edgepack rollout create --wait` against the server's published port; the agent healthy
#    and answering /predict; the agent's process killed with SIGKILL and the container back,
#    healthy, serving the same model (restart: unless-stopped, the store on its volume).
#    `docker stop` (SIGTERM) then ends every service with exit status 0.
# 5. Everything torn down: the stack with its volumes, the images, the daemon if started here.
#
# One PASS/FAIL line per step; exit 1 on the first failure of a step the next ones need.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${EDGEPACK_DOCKER_CACHE:-$REPO/.cache/docker}
MIRROR=${EDGEPACK_DEBIAN_MIRROR:-http://deb.debian.org/debian}
PY=${PYTHON:-$REPO/.venv/bin/python}
BIN=$(dirname "$PY")
WAIT_S=${EDGEPACK_DOCKER_WAIT_S:-180}  # bound of every wait on a health state
WORK=$(mktemp -d /tmp/edgepack-docker.XXXXXX)
LOG=$WORK/docker.log
START=$(date +%s)
TAG=check-$$
PROJECT=edgepack-check-$$
BASE_PACKAGES=python3,python3-venv
SERVICE_PACKAGES="mosquitto mosquitto-clients postgresql-15"
# shellcheck source=tools/check_helpers.sh
. "$REPO/tools/check_helpers.sh"  # say, pass, fail, run_logged; FAILED=0
say() { printf '[%4ss] %s\n' "$(( $(date +%s) - START ))" "$*"; }  # each line with the time since the start

DOCKER=/usr/bin/docker
[ -x "$DOCKER" ] || DOCKER=$(command -v docker || echo docker)
if command -v docker-compose >/dev/null; then COMPOSE=(docker-compose); else COMPOSE=("$DOCKER" compose); fi
DOCKERD_PID=
DATA_ROOT=
ROOTS=
STACK_UP=0

teardown() {  # the stack with its volumes, the images made here, the daemon if started here
  set +e
  if [ "$STACK_UP" = 1 ]; then
    compose down -v --remove-orphans >>"$LOG" 2>&1
    STACK_UP=0
  fi
  # the images tagged here (their untagged parent layers go with them). Only these: another run
  # may share the daemon, and an untagged image of its build in progress is not ours to remove.
  "$DOCKER" image rm -f "edgepack-check/agent:$TAG" "edgepack-check/agent-build:$TAG" "edgepack-check/server:$TAG" \
    "edgepack-check/server-build:$TAG" "edgepack-check/postgres:$TAG" "edgepack-check/base:$TAG" \
    "edgepack-check/services:$TAG" >>"$LOG" 2>&1
  if [ -n "$DOCKERD_PID" ]; then
    kill "$DOCKERD_PID" 2>/dev/null && wait "$DOCKERD_PID" 2>/dev/null
    DOCKERD_PID=
  fi
  set -e
}
cleanup() { teardown; rm -rf "$WORK" ${ROOTS:+"$ROOTS"} ${DATA_ROOT:+"$DATA_ROOT"}; }
trap cleanup EXIT

docker() { "$DOCKER" "$@"; }
compose() {
  env COMPOSE_PROJECT_NAME="$PROJECT" EDGEPACK_SECRETS="$WORK/secrets" \
    EDGEPACK_AGENT_IMAGE="edgepack-check/agent:$TAG" EDGEPACK_SERVER_IMAGE="edgepack-check/server:$TAG" \
    EDGEPACK_MOSQUITTO_IMAGE="edgepack-check/services:$TAG" EDGEPACK_POSTGRES_IMAGE="edgepack-check/postgres:$TAG" \
    EDGEPACK_MQTT_ADDRESS=127.0.0.1 EDGEPACK_MQTT_PORT="$MQTT_PORT" EDGEPACK_SERVER_PORT="$SERVER_PORT" \
    EDGEPACK_AGENT_PORT="$AGENT_PORT" EDGEPACK_DEVICE_ID=agent-1 EDGEPACK_HEALTH_INTERVAL=2s \
    "${COMPOSE[@]}" -f "$REPO/deploy/docker/compose.yaml" "$@"
}
free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
declare -A ID  # service -> container id, read once after `compose up` (a restart keeps the container)
health() { docker inspect -f '{{if .State.Health}}{{.State.Health.Status}}{{else}}none{{end}}' "${ID[$1]}" 2>/dev/null; }
restarts() { docker inspect -f '{{.RestartCount}}' "${ID[$1]}"; }
wait_healthy() {  # wait_healthy SERVICE: polls docker's health state until healthy, within WAIT_S
  local deadline=$(( $(date +%s) + WAIT_S ))
  while [ "$(date +%s)" -lt "$deadline" ]; do
    [ "$(health "$1")" = healthy ] && return 0
    # a container that keeps failing at start will not get healthy: stop waiting
    [ "$(restarts "$1")" -lt 3 ] || return 1
    sleep 1
  done
  return 1
}
stop_for() {  # stop_for WHAT: a FAIL line, the service's last log lines, exit 1
  fail "$1"
  compose logs --no-color --tail 15 >>"$LOG" 2>&1 || true
  tail -n 40 "$LOG" | sed 's/^/    /'
  exit 1
}

[ "$(id -u)" = 0 ] || { say "FAIL docker check needs root (debootstrap, chroot, dockerd)"; exit 2; }
[ -x "$PY" ] || { say "FAIL no Python at $PY (run tools/setup_venv.sh)"; exit 2; }
for tool in debootstrap "$DOCKER" "${COMPOSE[0]}"; do
  command -v "$tool" >/dev/null || { say "FAIL $tool is not installed (apt-get install docker.io docker-compose debootstrap)"; exit 2; }
done

# 1. A Docker daemon.
if ! docker info >/dev/null 2>&1; then
  DROOT=$WORK/dockerd  # sockets and state: short paths (a unix socket's path is at most 107 bytes)
  mkdir -p "$DROOT" "$CACHE"
  DATA_ROOT=$(mktemp -d "$CACHE/dockerd-data.XXXXXX")  # images and volumes: on disk, not in a tmpfs /tmp
  dockerd --data-root "$DATA_ROOT" --exec-root "$DROOT/exec" --pidfile "$DROOT/dockerd.pid" \
    -H "unix://$DROOT/docker.sock" >"$DROOT/dockerd.log" 2>&1 &
  DOCKERD_PID=$!
  export DOCKER_HOST=unix://$DROOT/docker.sock
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null 2>&1 || { fail "dockerd did not start:"; tail -n 20 "$DROOT/dockerd.log" | sed 's/^/    /'; exit 1; }
  pass "dockerd started here (data root $DATA_ROOT)"
else
  pass "dockerd running: $(docker version -f '{{.Server.Version}}')"
fi

# 2. The bases: one minbase root (cached as a tarball), a copy with the services added.
slim_root() {  # what images do not need: package caches and lists, docs, man pages, locales
  rm -rf "$1"/var/cache/apt/archives/*.deb "$1"/var/lib/apt/lists/* "$1"/usr/share/doc/* "$1"/usr/share/man/* \
    "$1"/usr/share/locale/*
}
in_root() { env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin DEBIAN_FRONTEND=noninteractive LANG=C.UTF-8 \
  ${http_proxy:+http_proxy=$http_proxy} chroot "$@"; }
KEY=$(printf '%s|%s|%s|1' "$BASE_PACKAGES" "$SERVICE_PACKAGES" "$MIRROR" | sha256sum | cut -c1-12)
BASE_TAR=$CACHE/base-$KEY.tar
SERVICES_TAR=$CACHE/services-$KEY.tar
if [ ! -f "$BASE_TAR" ] || [ ! -f "$SERVICES_TAR" ]; then
  mkdir -p "$CACHE"
  # the roots are made beside the cache, on disk: /tmp may be a tmpfs mounted nodev, where the
  # device nodes debootstrap makes do not open
  ROOTS=$(mktemp -d "$CACHE/roots.XXXXXX")
  ROOT=$ROOTS/base
  run_logged "debootstrap bookworm minbase" debootstrap --variant=minbase --include="$BASE_PACKAGES" \
    bookworm "$ROOT" "$MIRROR"
  cp -a "$ROOT" "$ROOTS/services"
  slim_root "$ROOT"
  tar -C "$ROOT" -cf "$BASE_TAR.tmp" . && mv "$BASE_TAR.tmp" "$BASE_TAR"
  rm -rf "$ROOT"
  # Services: no daemon starts in the chroot, and PostgreSQL makes no cluster (the entrypoint does).
  printf '#!/bin/sh\nexit 101\n' > "$ROOTS/services/usr/sbin/policy-rc.d"
  chmod 755 "$ROOTS/services/usr/sbin/policy-rc.d"
  mkdir -p "$ROOTS/services/etc/postgresql-common"
  echo "create_main_cluster = false" > "$ROOTS/services/etc/postgresql-common/createcluster.conf"
  # shellcheck disable=SC2086  # the package list splits on purpose
  run_logged "apt-get install $SERVICE_PACKAGES in the services root" in_root "$ROOTS/services" sh -c \
    "apt-get update -qq && apt-get install -y -qq --no-install-recommends $SERVICE_PACKAGES"
  slim_root "$ROOTS/services"
  tar -C "$ROOTS/services" -cf "$SERVICES_TAR.tmp" . && mv "$SERVICES_TAR.tmp" "$SERVICES_TAR"
  rm -rf "$ROOTS"
  pass "bookworm roots made by debootstrap (cached in $CACHE)"
fi
run_logged "docker import the base" docker import "$BASE_TAR" "edgepack-check/base:$TAG"
run_logged "docker import the services base" docker import "$SERVICES_TAR" "edgepack-check/services:$TAG"
pass "bases imported: base $(du -m "$BASE_TAR" | cut -f1) MB, services $(du -m "$SERVICES_TAR" | cut -f1) MB"

# 3. The images, built offline from the wheels.
run_logged "the build context (tools/docker_context.sh)" env PYTHON="$PY" bash "$REPO/tools/docker_context.sh" "$WORK/ctx"
for image in agent server; do
  # the build stage tagged too (built first, then reused from the cache), so no untagged image is left
  for target in build ""; do
    run_logged "build the $image image${target:+ (stage $target)}" docker build -q \
      -f "$REPO/deploy/docker/$image.Dockerfile" --build-arg "BASE=edgepack-check/base:$TAG" \
      ${target:+--target "$target"} -t "edgepack-check/$image${target:+-$target}:$TAG" "$WORK/ctx"
  done
done
run_logged "build the postgres stand-in" docker build -q -f "$REPO/tools/docker/postgres.Dockerfile" \
  --build-arg "BASE=edgepack-check/services:$TAG" -t "edgepack-check/postgres:$TAG" "$REPO/tools/docker"
AGENT_MB=$(( $(docker image inspect -f '{{.Size}}' "edgepack-check/agent:$TAG") / 1000000 ))
VENV_MB=$(docker run --rm --entrypoint du "edgepack-check/agent:$TAG" -sm /opt/edgepack | cut -f1)
pass "images built: agent $AGENT_MB MB, server $(( $(docker image inspect -f '{{.Size}}' "edgepack-check/server:$TAG") / 1000000 )) MB"
[ "$(docker image inspect -f '{{.Config.User}}' "edgepack-check/agent:$TAG")" = 10001:10001 ] \
  && pass "agent image runs as uid 10001" || fail "agent image does not run as uid 10001"
if docker run --rm --entrypoint /opt/edgepack/bin/python -v "$REPO/tools/device_install_check.py:/check.py:ro" \
    "edgepack-check/agent:$TAG" /check.py >"$WORK/install-check.txt" 2>&1; then
  pass "agent image holds the device distribution only (tools/device_install_check.py)"
else
  fail "tools/device_install_check.py in the agent image:"; sed 's/^/    /' "$WORK/install-check.txt"
fi

PROBE='import importlib.util as u; print(" ".join(m for m in ("onnx", "sklearn", "sympy", "torch") if u.find_spec(m)))'
HOST_ONLY=$(docker run --rm --entrypoint /opt/edgepack/bin/python "edgepack-check/server:$TAG" -c "$PROBE" 2>&1) \
  && [ -z "$HOST_ONLY" ] && docker run --rm "edgepack-check/server:$TAG" fleet serve --help >/dev/null 2>>"$LOG" \
  && pass "server image: fleet serve runs, without the packager's onnx, scikit-learn, sympy" \
  || fail "server image: ${HOST_ONLY:-edgepack fleet serve --help fails}"

# 4. Secrets (as docs/docker.md makes them), the artifact, the stack with the shipped agent.yaml.
SECRETS=$WORK/secrets
mkdir -p "$SECRETS"
run_logged "release keys" "$BIN/edgepack" keygen --private "$WORK/release.key" --public "$SECRETS/release.pub"
run_logged "operator keys" "$BIN/edgepack" keygen --operator --private "$SECRETS/operator.key" --public "$SECRETS/operator.pub"
rand() { "$PY" -c 'import secrets; print(secrets.token_hex(24))'; }
printf 'admin:%s\n' "$(rand)" > "$SECRETS/tokens"
rand > "$SECRETS/mqtt-operator.pw"
rand > "$SECRETS/mqtt-device.pw"
rand > "$SECRETS/db.pw"
chown -R 10001:10001 "$SECRETS"
chmod 600 "$SECRETS"/*
run_logged "build the digits demo" "$PY" "$REPO/tools/build_demos.py" --out "$WORK/demo" --only digits
cp -r "$REPO/recipes" "$WORK/recipes"
run_logged "build the digits artifact" "$BIN/edgepack" build "$WORK/recipes/digits.yaml" --allow-external-paths \
  --key "$WORK/release.key" --output "$WORK/digits.edgepkg"
MQTT_PORT=$(free_port); SERVER_PORT=$(free_port); AGENT_PORT=$(free_port)
STACK_UP=1
run_logged "compose up" compose up -d
for service in mosquitto postgres server agent; do ID[$service]=$(compose ps -q "$service"); done
for service in mosquitto postgres server; do
  wait_healthy "$service" || stop_for "$service not healthy within ${WAIT_S}s (health: $(health "$service"), restarts: $(restarts "$service"))"
done
pass "mosquitto, postgres and the fleet server healthy"

# 5. A rollout through the stack, from the host's CLI against the server's published port.
SERVER=http://127.0.0.1:$SERVER_PORT
deadline=$(( $(date +%s) + WAIT_S ))
until "$BIN/edgepack" fleet status --server "$SERVER" --token-file "$SECRETS/tokens" --json 2>>"$LOG" \
    | grep -q '"agent-1"'; do
  [ "$(date +%s)" -lt "$deadline" ] || stop_for "the fleet server never heard of agent-1"
  sleep 1
done
pass "the fleet server knows agent-1 (over mosquitto with the shipped ACL)"
run_logged "rollout of digits to agent-1" "$BIN/edgepack" rollout create "$WORK/digits.edgepkg" --device agent-1 \
  --health-window 5 --wait --timeout "$WAIT_S" --server "$SERVER" --token-file "$SECRETS/tokens" --reason "docker check"
pass "rollout succeeded: agent-1 runs digits"
wait_healthy agent || stop_for "the agent is not healthy after the rollout (health: $(health agent))"
predict() {
  "$PY" - "http://127.0.0.1:$AGENT_PORT/predict" "$WORK/demo/digits/val/digit_0000.png" <<'PY'
import json, sys, urllib.request
request = urllib.request.Request(sys.argv[1], data=open(sys.argv[2], "rb").read(), headers={"Content-Type": "image/png"})
answer = json.load(urllib.request.urlopen(request, timeout=30))
print(answer["model"]["name"], answer["model"]["version"])
PY
}
SERVED=$(predict 2>>"$LOG") || stop_for "the agent's /predict did not answer"
pass "agent healthy, /predict answers from $SERVED"

# 6. kill -9 the agent: restart: unless-stopped brings it back, healthy, serving from its store volume.
AGENT_ID=${ID[agent]}
RESTARTS=$(restarts agent)
kill -9 "$(docker inspect -f '{{.State.Pid}}' "$AGENT_ID")"
deadline=$(( $(date +%s) + WAIT_S ))
until [ "$(restarts agent)" -gt "$RESTARTS" ]; do
  [ "$(date +%s)" -lt "$deadline" ] || stop_for "the killed agent was not restarted"
  sleep 1
done
wait_healthy agent || stop_for "the restarted agent is not healthy (health: $(health agent))"
# idle: the model loaded and smoke-tested, no request yet (BENCHMARKS.md)
AGENT_RSS=$(docker exec "$AGENT_ID" sh -c 'grep VmRSS /proc/1/status' | awk '{printf "%.1f", $2 / 1024}')
AGENT_MEM=$(docker stats --no-stream --format '{{.MemUsage}}' "$AGENT_ID" | cut -d/ -f1)
# what the agent says of its memory (/healthz: anonymous, and the start-up pages it gave back)
AGENT_MEMORY=$("$PY" - "http://127.0.0.1:$AGENT_PORT/healthz" 2>>"$LOG" <<'PY'
import json, sys, urllib.request
memory = json.load(urllib.request.urlopen(sys.argv[1], timeout=10)).get("memory", {})
print(f"anonymous {memory.get('anonymous_bytes', 0) / 2**20:.1f} MiB, start-up pages given back: "
      f"{memory.get('release', '?')}, {memory.get('released_bytes', 0) / 2**20:.1f} MiB")
PY
) || AGENT_MEMORY="/healthz gave no memory"
AGAIN=$(predict 2>>"$LOG") || stop_for "the restarted agent's /predict did not answer"
[ "$AGAIN" = "$SERVED" ] && pass "agent killed with SIGKILL came back healthy, serving $AGAIN" \
  || fail "the restarted agent serves $AGAIN, not $SERVED"
pass "agent image $AGENT_MB MB (its venv $VENV_MB MiB); idle serving digits after the restart: VmRSS $AGENT_RSS MiB ($AGENT_MEMORY), docker stats $AGENT_MEM"

# 7. docker stop: every service ends on SIGTERM within the grace period (exit 0; 137 would be
#    the SIGKILL docker sends after it), so a server checkpoints its database and an agent its store.
run_logged "compose stop" compose stop -t 30
CODES=""
for service in mosquitto postgres server agent; do
  CODES="$CODES $service=$(docker inspect -f '{{.State.ExitCode}}' "${ID[$service]}")"
done
case "$CODES" in
  *=[1-9]*) fail "a service did not stop cleanly on SIGTERM:$CODES" ;;
  *) pass "every service stopped on SIGTERM:$CODES" ;;
esac
teardown
pass "torn down: the stack, its volumes and the images made here"
ELAPSED=$(( $(date +%s) - START ))
if [ "$FAILED" = 0 ]; then say "docker check passed in ${ELAPSED}s"; else say "docker check FAILED after ${ELAPSED}s"; fi
exit "$FAILED"
