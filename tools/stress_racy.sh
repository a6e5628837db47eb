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
# Override the selection with FILES="tests/x.py ..." and K="pytest -k expression", the number
# of busy loops with HOGS=1 (one of two cores, as issue 61 asks of the tests that time). The
# tests that time (docs/testing.md, "The tests that time, 20 times under a CPU hog"):
#   HOGS=1 FILES="tests/test_broken_methods.py tests/test_cluster.py tests/test_data_checks.py
#     tests/test_faults.py tests/test_launch.py tests/test_lifecycle.py tests/test_loader_workers.py
#     tests/test_resources.py tests/test_stats.py tests/test_seeds.py tests/test_breakdown.py
#     tests/test_warm.py tests/test_lab_server.py"
#   K="check_names_collectives_that_differ or check_of_a_hang or run_of_a_hang or
#     run_names_collectives or ranks_stuck_where or experiment_stops_at_the_check or
#     failed_node_and_a_timeout or corrupt_image_is_named or launcher_validate_names or
#     hung_rank_ends or bad_input_fails_before_spawning or bare_torchrun_rank_killed or
#     sigterm_reaches_rank_0 or a_killed_run_leaves_no_process or stopped_worker_is_one_line or
#     disk_that_fills or oom_killer or busy_machine_is_not_judged or clear_win_and_loss or
#     mlperf_scoring or time_to_accuracy_and_not_reached or rank_that_raises_fails_the_launch or
#     make_lab_serves or machine_load_tells_this_run"
set -uo pipefail
cd "$(dirname "$0")/.."
N=${1:-10}
LOG=${2:-/tmp/stress_racy.log}
PY=${PY:-.venv/bin/python}
FILES=${FILES:-"tests/test_lab_notebook.py tests/test_lifecycle.py tests/test_experiment.py
  tests/test_faults.py tests/test_breakdown.py tests/test_loader_workers.py tests/test_resources.py"}
K=${K:-"killed_experiment or test_lifecycle or ctrl_c or oom_killer or overlap or leaves_no_process"}

busy=()
for _ in $(seq "${HOGS:-$(nproc)}"); do python3 -c "while True: pass" & busy+=($!); done
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
