#!/usr/bin/env bash
# Mutation testing of the pure rules (artifact header checks, signature verify, smoke compare,
# job transitions, command parsing, admission, health verdict, rollout policy) with mutmut.
#
# Why: a rule whose tests pass whatever the rule says is not pinned. mutmut changes one thing
# at a time in the listed functions (a comparison, a constant, a boolean) and runs the tests
# that cover it; a mutant the tests do not notice ("survived") is a rule nobody checks.
#
# The targets (module, functions, tests) come from tools/mutation_targets.txt only; a target
# whose module or tests do not exist yet is skipped with a message. The run happens in a copy
# of the working tree under $MUTATION_WORK (default: a new folder in /tmp), so mutmut's
# mutants/ folder never lands in the checkout that others work in.
#
# Usage: tools/mutation.sh [TARGET-MODULE...]     (no argument: every target in the list)
# Environment: MUTATION_JOBS (parallel children, default 2), MUTATION_WORK, VENV (default .venv).
# Prints the survivors and a score table; exits 1 if no target could run.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${VENV:-$ROOT/.venv}
TARGETS=$ROOT/tools/mutation_targets.txt
JOBS=${MUTATION_JOBS:-2}
WORK=${MUTATION_WORK:-$(mktemp -d /tmp/edgepack-mutation.XXXXXX)}

if ! "$VENV/bin/python" -c "import mutmut" 2>/dev/null; then
    echo "mutation.sh: mutmut is not installed in $VENV (pip install -e '.[dev]')" >&2
    exit 2
fi

modules=() tests=() globs=()
while read -r module functions rest; do
    [[ -z "$module" || "$module" == \#* ]] && continue
    if (($#)) && [[ " $* " != *" $module "* ]]; then
        continue
    fi
    if [[ ! -f "$ROOT/$module" ]]; then
        echo "skip: $module does not exist yet"
        continue
    fi
    found=()
    for test in $rest; do
        if [[ -f "$ROOT/$test" ]]; then found+=("$test"); else echo "note: $test does not exist yet ($module)"; fi
    done
    if ((${#found[@]} == 0)); then
        echo "skip: $module has none of its test files yet ($rest)"
        continue
    fi
    modules+=("$module")
    tests+=("${found[@]}")
    dotted=${module%.py}
    dotted=${dotted//\//.}
    IFS=, read -ra names <<<"$functions"
    for name in "${names[@]}"; do
        if [[ "$name" == "*" ]]; then
            globs+=("$dotted.*")
        elif [[ "$name" == *.* ]]; then
            globs+=("$dotted.xǁ${name%%.*}ǁ${name#*.}__mutmut_*")
        else
            globs+=("$dotted.x_${name}__mutmut_*")
        fi
    done
done <"$TARGETS"

if ((${#modules[@]} == 0)); then
    echo "mutation.sh: no target can run" >&2
    exit 1
fi

echo "copying the working tree to $WORK"
mkdir -p "$WORK"
(cd "$ROOT" && git ls-files -co --exclude-standard -z) | "$VENV/bin/python" -c '
import os, shutil, sys
root, work = sys.argv[1], sys.argv[2]
for name in sys.stdin.buffer.read().decode().split("\0"):
    if not name or name.startswith((".venv", "mutants/")) or not os.path.isfile(os.path.join(root, name)):
        continue
    os.makedirs(os.path.dirname(os.path.join(work, name)) or work, exist_ok=True)
    shutil.copy2(os.path.join(root, name), os.path.join(work, name))
' "$ROOT" "$WORK"

toml_list() { printf '"%s", ' "$@" | sed 's/, $//'; }
unique_tests=$(printf '%s\n' "${tests[@]}" | sort -u)
# Tests read data beside the packages (recipes/, schemas/, tools/...): copy every other folder.
extra_dirs=$(cd "$WORK" && find . -mindepth 1 -maxdepth 1 -type d ! -name edgepack_core ! -name device_agent \
    ! -name sdk ! -name tests ! -name mutants -printf '%f\n' | sort)
# shellcheck disable=SC2086
cat >>"$WORK/pyproject.toml" <<TOML

[tool.mutmut]
source_paths = ["edgepack_core", "device_agent", "sdk"]
only_mutate = [$(toml_list "${modules[@]}")]
also_copy = [$(toml_list $extra_dirs)]
pytest_add_cli_args = ["-q", "-p", "no:cacheprovider"]
pytest_add_cli_args_test_selection = [$(toml_list $unique_tests)]
TOML

cd "$WORK"
echo "mutating ${modules[*]}"
"$VENV/bin/mutmut" run --max-children "$JOBS" "${globs[@]}" >"$WORK/mutmut-run.log" 2>&1 || {
    echo "mutation.sh: mutmut run failed; see $WORK/mutmut-run.log" >&2
    tail -20 "$WORK/mutmut-run.log" >&2
    exit 1
}
"$VENV/bin/mutmut" results --all true >"$WORK/mutmut-results.txt"
"$VENV/bin/python" - "$WORK/mutmut-results.txt" "${globs[@]}" <<'PY'
import collections, fnmatch, sys

results, patterns = sys.argv[1], sys.argv[2:]
per_module = collections.defaultdict(collections.Counter)
survivors = []
for line in open(results, encoding="utf-8"):
    name, _, status = line.strip().rpartition(": ")
    if not name or not any(fnmatch.fnmatchcase(name, p) for p in patterns):
        continue
    module = name.split(".x_")[0].split(".xǁ")[0]
    per_module[module][status] += 1
    if status not in ("killed", "timeout"):
        survivors.append(f"{name}: {status}")
for line in sorted(survivors):
    print("  ", line)
print(f"{'module':<36} {'mutants':>7} {'killed':>7} {'survived':>8} {'score':>6}")
total = collections.Counter()
for module, counts in sorted(per_module.items()):
    total.update(counts)
    checked = sum(counts.values()) - counts["skipped"] - counts["not checked"]
    killed = counts["killed"] + counts["timeout"]
    print(f"{module:<36} {checked:>7} {killed:>7} {checked - killed:>8} {killed / max(checked, 1):>6.1%}")
checked = sum(total.values()) - total["skipped"] - total["not checked"]
killed = total["killed"] + total["timeout"]
print(f"{'total':<36} {checked:>7} {killed:>7} {checked - killed:>8} {killed / max(checked, 1):>6.1%}")
PY
echo "mutants and logs: $WORK (mutmut show NAME there shows a mutant)"
