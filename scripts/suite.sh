#!/usr/bin/env bash
# Configures (once), builds and runs the plain test suite in one build directory, then prints one line
#   suite NAME: N passed, N failed, N skipped
# counting test cases: doctest's own summary of each test binary ("[doctest] test cases: 12 | 11 passed | 1 failed |
# 0 skipped", the last one in its output: forked ranks print none), and one case for a test without one (scripts, or
# a binary that crashed or timed out before its summary, which counts as failed). Exits non-zero if anything failed.
#   scripts/suite.sh NAME BUILD_DIR [meson setup arguments…]
#   CORPC_SUITE_TESTS=rpc,rref,… scripts/suite.sh …   builds every library and what those tests need, runs them
#   CORPC_SUITE_TESTS=all scripts/suite.sh …          the same for every test: examples no test runs are not built
#   CORPC_SUITE_EXCLUDE=pipeline,… scripts/suite.sh …   builds everything, runs every test but those
# scripts/test.sh runs it for Debian 12's libtorch 1.13 on this machine (build/), and in the roots that
# scripts/root.sh makes for Debian testing's libtorch 2.14 (build-forky/) and Debian 13's libtorch 2.6 (build-trixie/).
set -euo pipefail
cd "$(dirname "$0")/.."
name=$1 dir=$2
shift 2
if [[ ! -f $dir/build.ninja ]]; then
  meson setup "$dir" --buildtype=release "$@" >/dev/null
fi
chosen=()
if [[ -n ${CORPC_SUITE_TESTS:-} ]]; then
  [[ $CORPC_SUITE_TESTS == all ]] || IFS=, read -r -a chosen <<<"$CORPC_SUITE_TESTS"
  # Every library (each layer, ddp, the examples' shared code), the build's checks, what `meson install` installs,
  # and what the chosen tests run: their executables and the programs they start (meson's `depends`).
  mapfile -t targets < <(scripts/test_targets.py "$dir" "$CORPC_SUITE_TESTS" --libraries)
  echo "suite $name: building the libraries and what ${chosen[*]:-every test} needs (${#targets[@]} targets)"
  ninja -C "$dir" "${targets[@]}"
else
  ninja -C "$dir"
  if [[ -n ${CORPC_SUITE_EXCLUDE:-} ]]; then  # every test but these
    mapfile -t chosen < <(meson introspect --tests "$dir" | python3 -c '
import json, sys
left_out = set(sys.argv[1].split(","))
print("\n".join(t["name"] for t in json.load(sys.stdin) if t["name"] not in left_out))' "$CORPC_SUITE_EXCLUDE")
  fi
fi
set +e
meson test -C "$dir" --no-rebuild --print-errorlogs --num-processes 2 "${chosen[@]}"
status=$?
set -e
read -r ok fail skipped < <(python3 - "$dir/meson-logs/testlog.json" <<'PY'
import json, re, sys
passed = failed = skipped = 0
for line in open(sys.argv[1]):
    test = json.loads(line)
    out = re.sub(r"\x1b\[[0-9;]*m", "", test.get("stdout") or "")
    # tests/main.cpp's line for the run's own file first; doctest's summary counts other files' cases as skipped
    cases = re.findall(r"^\[corpc\] \S+: test cases:\s*(\d+) \|\s*(\d+) passed \|\s*(\d+) failed \|\s*(\d+) skipped", out, re.M)
    cases = cases or re.findall(r"\[doctest\] test cases:\s*(\d+) \|\s*(\d+) passed \|\s*(\d+) failed(?: \|\s*(\d+) skipped)?", out)
    result = test["result"]
    if cases and result in ("OK", "FAIL"):
        _, p, f, s = cases[-1]
        passed, failed, skipped = passed + int(p), failed + int(f), skipped + int(s or 0)
        failed += result == "FAIL" and int(f) == 0  # failed outside any test case (exit status, leak report)
    elif result in ("OK", "EXPECTEDFAIL"):
        passed += 1
    elif result == "SKIP":
        skipped += 1
    else:
        failed += 1
print(passed, failed, skipped)
PY
)
# CORPC_SUITE_SKIP="test: why" leaves a chosen test out as skipped, with its reason.
if [[ -n ${CORPC_SUITE_SKIP:-} ]]; then
  echo "suite $name: ${CORPC_SUITE_SKIP%%:*} skipped:${CORPC_SUITE_SKIP#*:}"
  skipped=$((skipped + 1))
fi
# What each failed test said where it failed, in a file scripts/test.sh prints again at the end of its run.
if [[ $status -ne 0 || $fail -ne 0 ]]; then
  scripts/failed_tests.py "$dir/meson-logs/testlog.json" >"$dir/meson-logs/failed-tests.txt"
  echo "suite $name: why it failed: $dir/meson-logs/failed-tests.txt"
fi
echo "suite $name: $ok passed, $fail failed, $skipped skipped"
[[ $status -eq 0 && $fail -eq 0 ]]
