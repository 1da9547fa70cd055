# Shared by the check scripts (tools/arm64_check.sh, tools/oldest_ort_check.sh): one PASS/FAIL
# line per check, FAILED=1 on any failure, and commands whose output goes to $LOG unless they fail.
# Source it after setting LOG; it sets FAILED=0.
FAILED=0
say() { printf '%s\n' "$*"; }
pass() { say "PASS $*"; }
fail() { say "FAIL $*"; FAILED=1; }
run_logged() {  # run_logged DESCRIPTION CMD...: output to the log, its tail on failure
  local what=$1; shift
  if ! "$@" >>"$LOG" 2>&1; then
    say "FAIL $what (last lines of $LOG):"; tail -n 25 "$LOG" | sed 's/^/    /'; exit 1
  fi
}
