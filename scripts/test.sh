#!/usr/bin/env bash
# Sets up, builds and runs the whole test suite, then a bounded fuzzing run (scripts/fuzz.sh), then the runtime's
# tests under AddressSanitizer + UBSan and under ThreadSanitizer (scripts/sanitize.sh); ends with the line
# "N passed, N failed, N skipped" over all three.
#   scripts/test.sh           everything (what CI runs)
#   scripts/test.sh --quick   the plain suite only (no fuzzing, no sanitized builds)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh
set +e
meson test -C build --print-errorlogs --num-processes 2
status=$?
set -e
# The one closing line CI reads counts test cases: doctest's own summary of each test binary ("[doctest] test cases:
# 12 | 11 passed | 1 failed | 0 skipped", the last one in its output: forked ranks print none), and one case for a
# test without one (scripts, or a binary that crashed or timed out before its summary, which counts as failed).
read -r ok fail skipped < <(python3 - build/meson-logs/testlog.json <<'PY'
import json, re, sys
passed = failed = skipped = 0
for line in open(sys.argv[1]):
    test = json.loads(line)
    out = re.sub(r"\x1b\[[0-9;]*m", "", test.get("stdout") or "")
    cases = re.findall(r"\[doctest\] test cases:\s*(\d+) \|\s*(\d+) passed \|\s*(\d+) failed(?: \|\s*(\d+) skipped)?", out)
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
if [[ "${1:-}" != "--quick" ]]; then
  # Each prints a last line "<name>: N passed, N failed"; their counts join the suite's.
  for extra in scripts/fuzz.sh scripts/sanitize.sh; do
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
