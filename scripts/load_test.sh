#!/usr/bin/env bash
# Runs the multi-process suites ROUNDS times on a busy machine and prints one line
#   load: N passed, N failed
# counting suite runs (one per suite per round). A healthy job must not lose a rank because the machine is busy or
# another job runs beside it (issue 62): a suite may run slower here, never fail. The load, for the whole run:
#   - a CPU hog: two busy loops per core (stress-ng --cpu when installed), a load of 8-10 on 2 cores;
#   - a second corpc job beside ours: the fault suites in a loop (fault_matrix stops, kills and restarts its own ranks,
#     core_faults floods its ranks with strangers and hostile peers), whose ranks dial, fail and restart on this host
#     while ours run. Their own results are not counted (they are load), only printed.
#   scripts/load_test.sh [ROUNDS] [BUILD_DIR]          defaults: 3 rounds, build/ (built: scripts/suite.sh or ninja)
#   CORPC_LOAD_SUITES=flow,rpc scripts/load_test.sh   other suites (default: flow,rpc,soak,systems)
# scripts/test.sh runs a short version (2 rounds); docs/testing.md#load has the long runs' counts.
set -uo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3} dir=${2:-build}
IFS=, read -r -a suites <<<"${CORPC_LOAD_SUITES:-flow,rpc,soak,systems}"
side_suites=(fault_matrix core_faults)
limit=$((rounds * 600 + 60))  # every load process ends by itself, even if this script is killed

# Each load process leads a process group of its own (setsid), so that stopping it stops what it started too (the
# side job's meson, its test binaries and their ranks), and nothing else.
pids=()
stop_load() {
  for p in "${pids[@]}"; do kill -TERM -- "-$p" 2>/dev/null; done
  wait 2>/dev/null
  pids=()
}
trap stop_load EXIT

cores=$(nproc)
if command -v stress-ng >/dev/null; then
  setsid timeout "$limit" stress-ng --cpu $((2 * cores)) --quiet &
  pids+=($!)
else
  for _ in $(seq $((2 * cores))); do
    setsid timeout "$limit" bash -c 'while :; do :; done' &
    pids+=($!)
  done
fi
side_log=$dir/meson-logs/load-side-status.txt  # not load-side.txt: meson writes that one
: >"$side_log"
failed_tests=$dir/meson-logs/load-failed-tests.txt  # printed again at the end of scripts/test.sh's run
: >"$failed_tests"
setsid timeout "$limit" bash -c '
  while :; do
    meson test -C "$0" --no-rebuild --num-processes 1 --logbase load-side "${@}" >/dev/null 2>&1
    echo "side job: status $?" >>"$0/meson-logs/load-side-status.txt"
  done' "$dir" "${side_suites[@]}" &
pids+=($!)

ok=0 fail=0
for round in $(seq "$rounds"); do
  for suite in "${suites[@]}"; do
    start=$SECONDS
    # One log per suite and round (meson-logs/load-SUITE-ROUND.txt, the whole output of every test), so that a
    # failure of an early round is still there to read after the run.
    log=load-$suite-$round
    if meson test -C "$dir" --no-rebuild --print-errorlogs --num-processes 1 --logbase "$log" "$suite" \
      >"$dir/meson-logs/$log.out" 2>&1; then
      ok=$((ok + 1))
      echo "load round $round: $suite passed ($((SECONDS - start)) s, load $(cut -d' ' -f1 /proc/loadavg))"
    else
      fail=$((fail + 1))
      echo "load round $round: $suite FAILED ($((SECONDS - start)) s, load $(cut -d' ' -f1 /proc/loadavg))"
      cat "$dir/meson-logs/$log.out"
      echo "load round $round: $suite's whole log: $dir/meson-logs/$log.txt"
      scripts/failed_tests.py "$dir/meson-logs/$log.json" >>"$failed_tests"
    fi
  done
done
stop_load
trap - EXIT
echo "load: the job beside ours ran ${side_suites[*]} $(grep -c . "$side_log") time(s), $(grep -c 'status 0' "$side_log") passing"
[[ $fail == 0 ]] || echo "load: why it failed: $failed_tests"
echo "load: $ok passed, $fail failed"
[[ $fail == 0 ]]
