#!/usr/bin/env bash
# Sets up, builds and runs the whole test suite on both libtorch lines — Debian 12's libtorch 1.13 (g++ 12) on this
# machine, Debian 13's libtorch 2.6 (g++ 14) in a root that scripts/debian13.sh makes or reuses — then a bounded
# fuzzing run (scripts/fuzz.sh), then the runtime's tests under AddressSanitizer + UBSan and under ThreadSanitizer
# (scripts/sanitize.sh). Each part prints "NAME: N passed, N failed[, N skipped]"; the last line adds them up:
# "N passed, N failed, N skipped".
#   scripts/test.sh           everything (what CI runs)
#   scripts/test.sh --quick   the plain suite on libtorch 1.13 only (no libtorch 2.6, fuzzing or sanitized builds)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
mkdir -p build
log=build/parts.log
: >"$log"

# With a CUDA toolkit on the machine, the 1.13 build compiles the CUDA data path against its runtime API (Debian's
# libtorch is CPU-only, so Meson's `auto` would build the stub): the path keeps compiling in CI.
cuda_arg=
if [[ -e ${CUDA_HOME:-/usr/local/cuda}/include/cuda_runtime_api.h ]]; then cuda_arg=-Dcuda=enabled; fi
parts=("scripts/suite.sh libtorch-1.13 build $cuda_arg")
if [[ "${1:-}" != "--quick" ]]; then
  # The root is made before anything is built so that a failure to make it shows at once.
  scripts/debian13.sh make
  # Benchmarks are left out of the 2.6 build: nothing in the suite runs them.
  parts+=("scripts/debian13.sh run scripts/suite.sh libtorch-2.6 build-debian13 -Dbenchmarks=disabled" scripts/fuzz.sh scripts/sanitize.sh)
fi

ok=0 fail=0 skipped=0 status=0
for part in "${parts[@]}"; do
  echo "=== $part ($(date +%T))"
  set +e
  $part 2>&1 | tee build/part.log
  part_status=${PIPESTATUS[0]}
  set -e
  line=$(grep -E '^[a-z0-9. -]+: [0-9]+ passed, [0-9]+ failed(, [0-9]+ skipped)?$' build/part.log | tail -1)
  if [[ -z $line ]]; then
    echo "$part ended without its summary line (status $part_status)"
    fail=$((fail + 1))
    status=1
    continue
  fi
  echo "$line" >>"$log"
  read -r p f s < <(sed -E 's/.*: ([0-9]+) passed, ([0-9]+) failed(, ([0-9]+) skipped)?$/\1 \2 \4/' <<<"$line")
  ok=$((ok + p)) fail=$((fail + f)) skipped=$((skipped + ${s:-0}))
  [[ $part_status -ne 0 ]] && status=1
done
echo "=== parts ($(date +%T))"
cat "$log"
echo "$ok passed, $fail failed, $skipped skipped"
exit $status
