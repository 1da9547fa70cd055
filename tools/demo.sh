#!/usr/bin/env bash
# The README's first command: set up, package a demo model into a signed artifact, and run the
# device agent on it (install with smoke test, one-shot predict, the local HTTP API).
# Everything stays inside the checkout (.venv/ and demo/); nothing is downloaded but packages.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
DEMO=$ROOT/demo

step() { printf '\n== %s\n' "$*"; }

step "Set up .venv (host and dev extras)"
bash tools/setup_venv.sh
PY=$ROOT/.venv/bin/python
EDGEPACK=$ROOT/.venv/bin/edgepack
AGENT=$ROOT/.venv/bin/edgepack-agent

step "Build the demo models from code (no downloads)"
"$PY" tools/build_demos.py --out "$DEMO"

step "Create a signing key pair (kept if it exists)"
mkdir -p "$DEMO/keys"
if [ ! -f "$DEMO/keys/release.key" ]; then
  "$EDGEPACK" keygen --private "$DEMO/keys/release.key" --public "$DEMO/keys/release.pub"
fi

step "Package the digits CNN into a signed artifact"
# The demo recipes name their data in demo/, outside recipes/: allowed explicitly.
"$EDGEPACK" build recipes/digits.yaml --allow-external-paths --key "$DEMO/keys/release.key" \
  --output "$DEMO/dist/digits.edgepkg"
"$EDGEPACK" verify "$DEMO/dist/digits.edgepkg" --trust "$DEMO/keys/release.pub"
"$EDGEPACK" inspect "$DEMO/dist/digits.edgepkg" --trust "$DEMO/keys/release.pub" | sed -n "1,14p"

IMAGES=("$DEMO"/digits/val/*.png)
IMAGE=${IMAGES[0]}
step "One-shot inference on the device side: $(basename "$IMAGE")"
"$AGENT" predict --artifact "$DEMO/dist/digits.edgepkg" --trust "$DEMO/keys/release.pub" --input "$IMAGE" --json

step "Run the agent daemon on the artifact and call its HTTP API"
rm -rf "$DEMO/store"
PORT=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
cat > "$DEMO/agent.yaml" <<EOF
device_id: demo-01
store: $DEMO/store
trust: [$DEMO/keys/release.pub]
profile: x86
artifact: $DEMO/dist/digits.edgepkg
api: {listen: "127.0.0.1:$PORT"}
EOF
"$AGENT" run --config "$DEMO/agent.yaml" > "$DEMO/agent.log" 2>&1 &
AGENT_PID=$!
trap 'kill $AGENT_PID 2>/dev/null || true' EXIT
"$PY" - "$PORT" "$IMAGE" <<'EOF'
import json, sys, time, urllib.request
port, image = sys.argv[1], sys.argv[2]
base = f"http://127.0.0.1:{port}"
for _ in range(200):
    try:
        health = json.load(urllib.request.urlopen(f"{base}/healthz", timeout=1))
        break
    except OSError:
        time.sleep(0.1)
else:
    sys.exit("the agent did not come up; see demo/agent.log")
print("GET /healthz ->", json.dumps(health))
request = urllib.request.Request(f"{base}/predict", data=open(image, "rb").read(),
                                 headers={"Content-Type": "image/png"})
answer = json.load(urllib.request.urlopen(request, timeout=10))
print("POST /predict ->", json.dumps(answer.get("result")))
metrics = urllib.request.urlopen(f"{base}/metrics", timeout=5).read().decode()
print("GET /metrics ->", next(line for line in metrics.splitlines() if line.startswith('edgepack_requests_total{status="ok"}')))
EOF
kill -TERM "$AGENT_PID"
wait "$AGENT_PID" || true
trap - EXIT
step "Done. Artifact: demo/dist/digits.edgepkg; agent store: demo/store; agent log: demo/agent.log"
