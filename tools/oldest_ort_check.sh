#!/usr/bin/env bash
# Prove that artifacts run on the oldest onnxruntime the device distribution allows.
#
# Creates (and keeps) a second venv, .venv-oldest, holding the device distribution
# `edgepack-agent` (a wheel of distributions/edgepack-agent, as a device installs it) with the
# onnxruntime floor of its pyproject.toml pinned (today 1.16.0; numpy < 2 with it, as onnxruntime
# releases before 1.19 were built against numpy 1.x, which is what a device with such a release
# has), and checks that this install stands alone (tools/device_install_check.py: no sdk, no
# `edgepack` command, the systemd unit and schemas inside the package). Then, with the main
# .venv, builds the demo models (tools/build_demos.py) and every demo
# recipe (recipes/*.yaml), and in .venv-oldest for each artifact: `edgepack-agent install`
# (verification and golden smoke test) and `edgepack-agent predict`, whose outputs must match
# the same predict on the main venv's onnxruntime (max abs diff <= 1e-4). Finally it builds an
# artifact that needs a newer onnxruntime (an opset-21 graph) and checks that the old agent
# refuses it in one line naming both versions, and that a `.ort` file the packager writes
# loads there. One PASS/FAIL line per check; non-zero exit on any failure.
#
#   bash tools/oldest_ort_check.sh            (CI runs it from .ci/run, after the tests)
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
PY=$REPO/.venv/bin/python
BIN=$REPO/.venv/bin
OLD=$REPO/.venv-oldest
WORK=$(mktemp -d /tmp/edgepack-oldest.XXXXXX)
LOG=$WORK/oldest.log
START=$(date +%s)
trap 'rm -rf "$WORK"' EXIT
# shellcheck source=tools/check_helpers.sh
. "$REPO/tools/check_helpers.sh"  # say, pass, fail, run_logged; FAILED=0

[ -x "$PY" ] || bash tools/setup_venv.sh

# 1. The floor, read from the device distribution's dependencies (the one list a device installs).
DEVICE_PYPROJECT=distributions/edgepack-agent/pyproject.toml
FLOOR=$(grep -oE '"onnxruntime>=[0-9.]+' "$DEVICE_PYPROJECT" | head -n 1 | cut -d= -f2)
[ -n "$FLOOR" ] || { fail "$DEVICE_PYPROJECT names no onnxruntime>= floor"; exit 1; }
case "$FLOOR" in *.*.*) ;; *) FLOOR=$FLOOR.0 ;; esac  # pip installs 1.16.0 for ==1.16
PINS=("onnxruntime==$FLOOR")
MINOR=$(echo "$FLOOR" | cut -d. -f2)
if [ "$MINOR" -lt 19 ]; then PINS+=("numpy<2"); fi

# 2. .venv-oldest with the device wheel and the pins (rebuilt when its dependencies or the pins change).
run_logged "build the device wheel" "$PY" tools/build_wheels.py "$WORK/wheel" --dist agent --no-build-isolation
WHEEL=$(cd "$WORK/wheel" && ls edgepack_agent-*.whl)
DEPS_KEY=$( (echo edgepack-agent; unzip -p "$WORK/wheel/$WHEEL" '*.dist-info/METADATA' | grep '^Requires-Dist' \
  | grep -v 'extra =='; echo "${PINS[*]}") | sha256sum | cut -c1-16)
if [ "$(cat "$OLD/.deps-key" 2>/dev/null)" != "$DEPS_KEY" ]; then
  say "creating .venv-oldest (onnxruntime $FLOOR)"
  rm -rf "$OLD"
  run_logged "create .venv-oldest" python3 -m venv "$OLD"
  run_logged "pip install edgepack-agent with ${PINS[*]}" "$OLD/bin/pip" install -q "${PINS[@]}" \
    "$WORK/wheel/$WHEEL"
  echo "$DEPS_KEY" > "$OLD/.deps-key"
fi
run_logged "install the device wheel" "$OLD/bin/pip" install -q --no-deps --force-reinstall "$WORK/wheel/$WHEEL"
HAVE=$("$OLD/bin/python" -c 'import onnxruntime; print(onnxruntime.__version__)')
[ "$HAVE" = "$FLOOR" ] && pass ".venv-oldest runs onnxruntime $HAVE (the device distribution's floor)" \
  || { fail ".venv-oldest has onnxruntime $HAVE, not the floor $FLOOR"; exit 1; }
"$OLD/bin/python" tools/device_install_check.py || FAILED=1  # its own PASS/FAIL lines

# 3. Demo artifacts, built with the main venv.
run_logged "build demo models" "$PY" tools/build_demos.py --out "$WORK/demo"
cp -r "${EDGEPACK_OLDEST_RECIPES:-recipes}" "$WORK/recipes"  # the variable: another recipe folder, for trials
run_logged "keygen" "$BIN/edgepack" keygen --private "$WORK/release.key" --public "$WORK/release.pub"
EXTERNAL=()
if "$BIN/edgepack" build --help | grep -q -- --allow-external-paths; then EXTERNAL=(--allow-external-paths); fi
input_for() {  # the demo input a recipe's model takes
  case "$1" in
    mobilenet*) echo "$WORK/demo/mobilenet/images/img_000.png" ;;
    digits*) echo "$WORK/demo/digits/val/digit_0000.png" ;;
    tabular*) echo "$WORK/demo/tabular/example.npy" ;;
    vad*) echo "$WORK/demo/vad/audio/burst-16k-pcm16.wav" ;;
    yolo*) echo "$WORK/demo/yolo/val/val_000.png" ;;          # the torch demos (built when torch imports)
    ocr*) echo "$WORK/demo/ocr/val/val_000.png" ;;
    lstm-vad*) echo "$WORK/demo/lstm_vad/audio/talk-16k-pcm16.wav" ;;
    points*) echo "$WORK/demo/points/example.npy" ;;
    orientation*) echo "$WORK/demo/orientation/val/val_000.png" ;;
    *) echo "" ;;
  esac
}
mkdir -p "$WORK/out"
for recipe in "$WORK"/recipes/*.yaml; do
  name=$(basename "$recipe" .yaml)
  input=$(input_for "$name")
  if [ -z "$input" ]; then fail "$name: no demo input known to this script"; continue; fi
  if [ ! -e "$input" ]; then say "skip $name: its demo was not built (the torch demos need torch)"; continue; fi
  artifact=$WORK/$name.edgepkg
  if ! "$BIN/edgepack" build "$recipe" "${EXTERNAL[@]}" --key "$WORK/release.key" --output "$artifact" >>"$LOG" 2>&1; then
    fail "build $name (see the log below)"; tail -n 5 "$LOG" | sed 's/^/    /'; continue
  fi
  need=$("$PY" -c "import json,tarfile,sys; t=tarfile.open(sys.argv[1]); \
print(json.loads(t.extractfile('manifest.json').read())['model'].get('min_onnxruntime'))" "$artifact")
  if ! "$OLD/bin/edgepack-agent" install --store "$WORK/store-$name" --artifact "$artifact" \
      --trust "$WORK/release.pub" >>"$LOG" 2>&1; then
    fail "onnxruntime $HAVE: install $name (min_onnxruntime $need)"; tail -n 3 "$LOG" | sed 's/^/    /'; continue
  fi
  if ! "$OLD/bin/edgepack-agent" predict --artifact "$artifact" --trust "$WORK/release.pub" --input "$input" \
      --json --outputs raw > "$WORK/out/$name.old.json" 2>>"$LOG"; then
    fail "onnxruntime $HAVE: predict $name"; tail -n 3 "$LOG" | sed 's/^/    /'; continue
  fi
  run_logged "predict $name on the main venv" bash -c "'$BIN/edgepack-agent' predict --artifact '$artifact' \
    --trust '$WORK/release.pub' --input '$input' --json --outputs raw > '$WORK/out/$name.new.json'"
  if "$PY" - "$WORK/out/$name.new.json" "$WORK/out/$name.old.json" >>"$LOG" 2>&1 <<'EOF'
import json, sys
import numpy as np
new, old = (json.load(open(path)) for path in sys.argv[1:3])
assert new["model"] == old["model"] and set(new["outputs"]) == set(old["outputs"]), "different model or outputs"
worst = max(float(np.max(np.abs(np.asarray(new["outputs"][k]) - np.asarray(old["outputs"][k]))))
            for k in new["outputs"])
print(f"max abs diff {worst:.3g}")
sys.exit(0 if worst <= 1e-4 else 1)
EOF
  then
    pass "onnxruntime $HAVE: $name installs (smoke test), predicts, matches $("$PY" -c 'import onnxruntime as o; print(o.__version__)') (min_onnxruntime $need)"
  else
    fail "onnxruntime $HAVE: $name outputs differ from the main venv's"; tail -n 3 "$LOG" | sed 's/^/    /'
  fi
done

# 4. An artifact that needs a newer onnxruntime is refused by the old agent in one line.
mkdir -p "$WORK/newer"
"$PY" - "$WORK/newer" <<'EOF'
import sys
from pathlib import Path
import onnx
from onnx import TensorProto, helper
folder = Path(sys.argv[1])
graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "relu21",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
model.ir_version = 10
onnx.save(model, folder / "relu21.onnx")
(folder / "recipe.yaml").write_text("name: relu21\nversion: 1.0.0\nmodel: {path: relu21.onnx}\n"
                                    "postprocess: {kind: raw}\nvalidate: {data: synthetic}\ntargets: [x86]\n")
import numpy as np
np.save(folder / "x.npy", np.ones((1, 4), np.float32))
EOF
run_logged "build relu21 (opset 21)" "$BIN/edgepack" build "$WORK/newer/recipe.yaml" --key "$WORK/release.key" \
  --output "$WORK/newer/relu21.edgepkg"
set +e
"$OLD/bin/edgepack-agent" predict --artifact "$WORK/newer/relu21.edgepkg" --trust "$WORK/release.pub" \
  --input "$WORK/newer/x.npy" > "$WORK/newer/out" 2> "$WORK/newer/err"
CODE=$?
set -e
LINES=$(wc -l < "$WORK/newer/err")
if [ "$CODE" = 1 ] && [ "$LINES" = 1 ] && grep -q "needs onnxruntime >= 1.18.0, but this device has onnxruntime $HAVE" \
    "$WORK/newer/err"; then
  pass "onnxruntime $HAVE refuses an opset-21 artifact in one line: $(cat "$WORK/newer/err")"
else
  fail "onnxruntime $HAVE on an opset-21 artifact: exit $CODE, stderr:"; sed 's/^/    /' "$WORK/newer/err"
fi

# 5. The .ort format the packager writes (edgepack_core/ort_compat.py says version 6 files need
#    1.16): an android artifact's model/model.ort loads and runs on the old onnxruntime.
mkdir -p "$WORK/ort"
cp "$WORK/newer/x.npy" "$WORK/ort/x.npy"
"$PY" - "$WORK/ort" <<'EOF'
import sys
from pathlib import Path
import onnx
from onnx import TensorProto, helper
folder = Path(sys.argv[1])
graph = helper.make_graph([helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Softmax", ["r"], ["y"])], "ortfmt",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
model.ir_version = 8
onnx.save(model, folder / "ortfmt.onnx")
(folder / "recipe.yaml").write_text("name: ortfmt\nversion: 1.0.0\nmodel: {path: ortfmt.onnx}\n"
                                    "postprocess: {kind: raw}\nvalidate: {data: synthetic}\n"
                                    "optimize: {ort_format: true}\ntargets: [android]\n")
EOF
run_logged "build ortfmt (.ort format, android)" "$BIN/edgepack" build "$WORK/ort/recipe.yaml" \
  --key "$WORK/release.key" --output "$WORK/ort/ortfmt.edgepkg"
(cd "$WORK/ort" && tar xzf ortfmt.edgepkg model/model.ort manifest.json)
RUN_ORT='import sys, numpy as np, onnxruntime as ort
s = ort.InferenceSession(sys.argv[1], providers=["CPUExecutionProvider"])
print(np.array2string(s.run(None, {"x": np.load(sys.argv[2])})[0], precision=6))'
ORT_NEED=$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['model']['min_onnxruntime'])" "$WORK/ort/manifest.json")
if OLD_OUT=$("$OLD/bin/python" -c "$RUN_ORT" "$WORK/ort/model/model.ort" "$WORK/ort/x.npy" 2>>"$LOG") \
    && [ "$OLD_OUT" = "$("$PY" -c "$RUN_ORT" "$WORK/ort/model/model.ort" "$WORK/ort/x.npy")" ]; then
  pass "onnxruntime $HAVE loads and runs the .ort file written by the current onnxruntime (min_onnxruntime $ORT_NEED)"
else
  fail "onnxruntime $HAVE cannot run the .ort file (min_onnxruntime $ORT_NEED)"; tail -n 3 "$LOG" | sed 's/^/    /'
fi

# 6. A slice of onnx's node tests (every 5th), packaged for the rpi target by the current
#    onnxruntime, runs on the old one wherever bare onnxruntime of that version passes the test.
if SLICE_LOG=$("$PY" -m tools.conformance.oldest_slice build "$WORK/slice" --every 5 2>>"$LOG") \
    && SLICE_BUILT=${SLICE_LOG%%$'\n'*} && echo "$SLICE_LOG" >>"$LOG" \
    && SLICE_RUN=$("$OLD/bin/python" -m tools.conformance.oldest_slice run "$WORK/slice" 2>>"$LOG"); then
  pass "conformance slice: $SLICE_BUILT; $SLICE_RUN"
else
  fail "conformance slice on onnxruntime $HAVE: ${SLICE_BUILT:-not built}"; echo "${SLICE_RUN:-}" | sed 's/^/    /'
fi

ELAPSED=$(( $(date +%s) - START ))
if [ "$FAILED" = 0 ]; then say "oldest onnxruntime check passed in ${ELAPSED}s"
else say "oldest onnxruntime check FAILED (the log's tail:)"; tail -n 40 "$LOG" | sed 's/^/    /'; fi
exit "$FAILED"
