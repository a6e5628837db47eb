#!/usr/bin/env bash
# The formerly racy tests (issue 40), N times in a row under a busy loop on every core:
#
#     bash tools/stress_racy.sh [N] [LOG]        # default 10, /tmp/stress_racy.log
#
# Each round runs the tests that kill or signal a run at a moment (the lab notebook's killed
# experiment, test_lifecycle, Ctrl-C on an experiment and on the launcher, a killed loader
# worker), the breakdown's overlap test and the leftover-process checks, the way `make test`
# runs them (-n 2), while `python3 -c "while True: pass"` spins on each core. It prints one
# line per round and ends with "K of N rounds passed", exit 0 only when every round passed.
# Override the selection with FILES="tests/x.py ..." and K="pytest -k expression".
set -uo pipefail
cd "$(dirname "$0")/.."
N=${1:-10}
LOG=${2:-/tmp/stress_racy.log}
PY=${PY:-.venv/bin/python}
FILES=${FILES:-"tests/test_lab_notebook.py tests/test_lifecycle.py tests/test_experiment.py
  tests/test_faults.py tests/test_breakdown.py tests/test_loader_workers.py tests/test_resources.py"}
K=${K:-"killed_experiment or test_lifecycle or ctrl_c or oom_killer or overlap or leaves_no_process"}

busy=()
for _ in $(seq "$(nproc)"); do python3 -c "while True: pass" & busy+=($!); done
trap 'kill "${busy[@]}" 2>/dev/null' EXIT

: >"$LOG"
passed=0
for i in $(seq "$N"); do
  t0=$(date +%s)
  # a background shell starts its commands with SIGINT ignored, and a shell cannot undo that
  # for its children (trap - INT is a no-op then): Python puts SIGINT back to its default
  # before it becomes pytest, so the experiment a Ctrl-C test starts sees it (docs/testing.md)
  # shellcheck disable=SC2086
  if $PY -c 'import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.executable, [sys.executable, "-m", "pytest", *sys.argv[1:]])' \
      -q -n 2 --dist loadgroup -p no:cacheprovider $FILES -k "$K" >>"$LOG" 2>&1; then
    passed=$((passed + 1)); word=passed
  else
    word=FAILED
  fi
  echo "round $i: $word in $(( $(date +%s) - t0 )) s ($(tail -1 "$LOG"))"
done
echo "$passed of $N rounds passed (log: $LOG)"
[ "$passed" = "$N" ]
