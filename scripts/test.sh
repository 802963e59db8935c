#!/usr/bin/env bash
# Sets up, builds and runs the test suite on the three libtorch lines users have — Debian 12's libtorch 1.13 (g++ 12)
# on this machine, Debian testing's libtorch 2.14 (g++ 16) and Debian 13's libtorch 2.6 (g++ 14) in roots that
# scripts/root.sh makes or reuses — then the layout check (scripts/format.sh), a bounded fuzzing run (scripts/fuzz.sh),
# then the runtime's tests under AddressSanitizer + UBSan and under ThreadSanitizer (scripts/sanitize.sh). Each part prints
# "NAME: N passed, N failed[, N skipped]"; the last line adds them up: "N passed, N failed, N skipped".
#   scripts/test.sh           everything (what CI runs)
#   scripts/test.sh --quick   the plain suite on libtorch 1.13 only (no other line, fuzzing or sanitized builds)
# Where the time goes: docs/testing.md#what-ci-costs.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
mkdir -p build
log=build/parts.log
: >"$log"
: >build/why.log  # the files in which failed parts say what failed (scripts/failed_tests.py)

# With a CUDA toolkit on the machine, the 1.13 build compiles the CUDA data path against its runtime API (Debian's
# libtorch is CPU-only, so Meson's `auto` would build the stub): the path keeps compiling in CI.
cuda_arg=
if [[ -e ${CUDA_HOME:-/usr/local/cuda}/include/cuda_runtime_api.h ]]; then cuda_arg=-Dcuda=enabled; fi
# Every line builds each library as one translation unit (a unity build, of any size: Debian 12's Meson 1.0 links a
# missing object when a library's source count is a multiple of unity_size): the code that libtorch's and Asio's
# inline functions and templates emit is compiled once per library instead of once per file, which halves the CPU a
# line costs. The ThreadSanitizer build (scripts/sanitize.sh) still compiles the libraries file by file, so a missing
# include still shows. No test runs the benchmarks: scripts/benchmark.sh turns them on where it runs them.
unity="-Dunity=on -Dunity_size=1000"
# The 1.13 line builds what its tests run, not the examples that no test runs (the 2.14 line builds those).
parts=("CORPC_SUITE_TESTS=all scripts/suite.sh libtorch-1.13 build $cuda_arg $unity -Dbenchmarks=disabled")
roots_pid=
trixie_exclude=
trixie_skip=
if grep -q AuthenticAMD /proc/cpuinfo; then
  # Debian 13's libtorch 2.6 (oneDNN 3.6) on AMD CPUs: a pipeline of micro-batches of other shapes than the whole
  # batch trains to other parameters than one process (test_pipeline, beyond rtol 1e-4), unless oneDNN is held to
  # SSE4.1 (ONEDNN_MAX_CPU_ISA=SSE41), where its scratch memory breaks the suite's peak-memory case instead; its
  # convolution backward also dies with SIGFPE in the benchmark's ResNet50 there. 1.13 and 2.14 pass the same suite
  # on the same CPUs. docs/libtorch-versions.md#known-differences-on-2x
  trixie_exclude=pipeline
  trixie_skip="pipeline: libtorch 2.6's oneDNN on an AMD CPU (docs/libtorch-versions.md#known-differences-on-2x)"
fi
if [[ "${1:-}" != "--quick" ]]; then
  # The roots are made (or reused) while libtorch 1.13's line builds: making them is mostly download and unpacking,
  # the build is compiling. A root that cannot be made fails its line's part, with mmdebstrap's reason in its log.
  (scripts/root.sh make forky && scripts/root.sh make trixie) >build/roots.log 2>&1 &
  roots_pid=$!
  parts+=("wait_roots"
          "scripts/root.sh run forky scripts/suite.sh libtorch-2.14 build-forky $unity -Dbenchmarks=disabled"
          'CORPC_SUITE_EXCLUDE=$trixie_exclude CORPC_SUITE_SKIP=$trixie_skip scripts/root.sh run trixie scripts/suite.sh libtorch-2.6 build-trixie $unity -Dbenchmarks=disabled'
          scripts/format.sh scripts/fuzz.sh scripts/sanitize.sh)
fi
# The multi-process suites on a busy machine (issue 62): 2 rounds of flow, rpc, soak and systems on the 1.13 build
# under a CPU hog with a second corpc job beside them (scripts/load_test.sh; docs/testing.md#load). Not in --quick.
if [[ "${1:-}" != "--quick" ]]; then parts+=("CORPC_LOAD_SUITES=flow,rpc,soak,systems scripts/load_test.sh 2 build"); fi

wait_roots() {
  if wait "$roots_pid"; then
    grep -h '^root:' build/roots.log
    echo "roots: 0 passed, 0 failed"
  else
    cat build/roots.log
    echo "roots: 0 passed, 1 failed"
    return 1
  fi
}

ok=0 fail=0 skipped=0 status=0
for part in "${parts[@]}"; do
  echo "=== $part ($(date +%T))"
  set +e
  if [[ $part == wait_roots ]]; then  # not in a pipeline: only this shell can wait for its child
    wait_roots >build/part.log 2>&1
    part_status=$?
    cat build/part.log
  else
    eval "$part" 2>&1 | tee build/part.log
    part_status=${PIPESTATUS[0]}
  fi
  set -e
  sed -nE 's/^.*: why it failed: (\S+)$/\1/p' build/part.log >>build/why.log
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
  if [[ $part == wait_roots && $part_status -ne 0 ]]; then
    echo "=== the other lines' parts are not run: no root"
    fail=$((fail + 2))
    break
  fi
done
# A CI's report may keep only the end of this output: each failed test's reason comes again here, beside the counts.
if [[ -s build/why.log ]]; then
  echo "=== why the failed parts failed"
  while read -r file; do
    if [[ -f $file ]]; then head -200 "$file"; fi
  done <build/why.log
fi
echo "=== parts ($(date +%T))"
cat "$log"
echo "$ok passed, $fail failed, $skipped skipped"
exit $status
