#!/usr/bin/env bash
# Builds the library and the tests that exercise the runtime under AddressSanitizer + UndefinedBehaviorSanitizer
# (build-asan/) and under ThreadSanitizer (build-tsan/), runs them, and prints one line per build:
#   sanitize asan: N passed, N failed
# Exits non-zero if any sanitized test failed; the last line has the form scripts/test.sh adds to its own count.
#   scripts/sanitize.sh             both builds
#   scripts/sanitize.sh asan|tsan   one of them
# Only the library and the chosen tests are built, at -O0: instrumented optimisation passes over libtorch's headers
# would double the compile time, and the tests wait on sockets more than they compute. No benchmarks or examples.
# The ASan build compiles each library as one unit (as scripts/test.sh's lines do); the TSan build compiles every file
# on its own, the suite's check that each source file includes what it uses.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

# The tests that drive the runtime's threads and sockets: everything but ddp and pipeline, which add libtorch's own
# code and little of ours (and whose example-running cases need the examples, not built here). The soak runs under
# TSan only: ASan's quarantine of freed memory grows RSS by design, which is what the soak checks stays flat.
tests=(core rpc rref core_faults dist_autograd tls shm_channel cancel flow fault_matrix multihost)
which=("${@:-asan}")
[[ $# -eq 0 ]] && which=(asan tsan)

# Reports go to stderr of the failing process; a child rank's report reaches the test log through its launcher.
# UBSan by default reports and carries on: make every finding fatal. LeakSanitizer runs at the test process's exit
# (ranks leave through _exit, see src/rpc/launch.cpp, and are checked by launch.cpp's explicit leak check).
export ASAN_OPTIONS="halt_on_error=1:abort_on_error=0:detect_leaks=1:strict_init_order=1:detect_stack_use_after_return=0"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:suppressions=$root/tests/sanitizers/ubsan.supp"
export LSAN_OPTIONS="suppressions=$root/tests/sanitizers/lsan.supp:print_suppressions=0"
# Sanitized ranks run several times slower and check for leaks as they exit: the tests' launcher bounds stretch.
export CORPC_TEST_TIME_SCALE=4
export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:report_signal_unsafe=0:suppressions=$root/tests/sanitizers/tsan.supp"

total_pass=0
total_fail=0
for kind in "${which[@]}"; do
  case "$kind" in
    asan) sanitize=address,undefined; chosen=("${tests[@]}"); unity=(-Dunity=on -Dunity_size=1000) ;;
    tsan) sanitize=thread; chosen=("${tests[@]}" soak); unity=() ;;
    *) echo "sanitize: unknown build '$kind' (asan or tsan)" >&2; exit 2 ;;
  esac
  dir=build-$kind
  if [[ ! -f $dir/build.ninja ]]; then
    meson setup "$dir" --buildtype=plain -Doptimization=0 -Db_sanitize="$sanitize" \
      -Dcpp_args=-fno-omit-frame-pointer -Dbenchmarks=disabled -Dexamples=disabled "${unity[@]}" >/dev/null
  fi
  mapfile -t targets < <(scripts/test_targets.py "$dir" "$(IFS=,; echo "${chosen[*]}")")
  # A build that fails says why here (the compiler's errors are in ninja's output) and counts as a failed part.
  if ! ninja -C "$dir" "${targets[@]}" >"$dir/build.log" 2>&1; then
    grep -E -A8 'error|FAILED' "$dir/build.log" | head -60 || true
    echo "sanitize $kind: the build failed (whole log: $dir/build.log)"
    total_fail=$((total_fail + 1))
    continue
  fi
  set +e
  meson test -C "$dir" --no-rebuild --print-errorlogs --num-processes 2 --timeout-multiplier 3 "${chosen[@]}"
  set -e
  log=$dir/meson-logs/testlog.txt
  pass=$(awk '/^Ok:/ {print $2}' "$log" | tail -1)
  fail=$(awk '/^(Fail|Timeout|Unexpected Pass):/ {s += $NF} END {print s + 0}' "$log")
  if [[ ${fail:-0} -ne 0 ]]; then  # printed again at the end of scripts/test.sh's run
    scripts/failed_tests.py "$dir/meson-logs/testlog.json" >"$dir/meson-logs/failed-tests.txt"
    echo "sanitize $kind: why it failed: $dir/meson-logs/failed-tests.txt"
  fi
  echo "sanitize $kind: ${pass:-0} passed, ${fail:-0} failed"
  total_pass=$((total_pass + ${pass:-0}))
  total_fail=$((total_fail + ${fail:-0}))
done
echo "sanitize: ${total_pass} passed, ${total_fail} failed"
[[ $total_fail -eq 0 ]]
