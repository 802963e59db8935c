#!/usr/bin/env bash
# Sets up, builds and runs the whole test suite; ends with the line "N passed, N failed".
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
echo "${ok:-0} passed, ${fail:-0} failed, ${skipped:-0} skipped"
exit $status
