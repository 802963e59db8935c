#!/usr/bin/env bash
# Sets up, builds and runs the whole test suite, then a bounded fuzzing run (scripts/fuzz.sh); ends with the line
# "N passed, N failed, N skipped" over both. (scripts/sanitize.sh joins this loop once its runs are clean.)
#   scripts/test.sh           everything (what CI runs)
#   scripts/test.sh --quick   the plain suite only
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh
set +e
meson test -C build --print-errorlogs --num-processes 2
status=$?
set -e
# meson's summary lines ("Ok: 3", "Fail: 0", ...) become the one closing line CI reads.
log=build/meson-logs/testlog.txt
ok=$(awk '/^Ok:/ {print $2}' "$log" | tail -1)
fail=$(awk '/^(Fail|Timeout|Unexpected Pass):/ {s += $NF} END {print s + 0}' "$log")
skipped=$(awk '/^Skipped:/ {print $2}' "$log" | tail -1)
ok=${ok:-0} fail=${fail:-0} skipped=${skipped:-0}
if [[ "${1:-}" != "--quick" ]]; then
  # Each prints a last line "<name>: N passed, N failed"; their counts join the suite's.
  for extra in scripts/fuzz.sh; do
    set +e
    "$extra" 2>&1 | tee build/extra.log
    extra_status=${PIPESTATUS[0]}
    set -e
    line=$(grep -E '^[a-z]+: [0-9]+ passed, [0-9]+ failed$' build/extra.log | tail -1)
    if [[ -z $line ]]; then
      echo "$extra ended without its summary line (status $extra_status)"
      fail=$((fail + 1))
    else
      ok=$((ok + $(sed -E 's/.*: ([0-9]+) passed.*/\1/' <<<"$line")))
      fail=$((fail + $(sed -E 's/.* ([0-9]+) failed$/\1/' <<<"$line")))
    fi
    [[ $extra_status -ne 0 ]] && status=1
  done
fi
echo "$ok passed, $fail failed, $skipped skipped"
exit $status
