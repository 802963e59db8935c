#!/usr/bin/env bash
# Builds the libFuzzer targets in tests/fuzz/ with clang (the decoders they cover need no libtorch) and runs each for a
# bounded time, starting from its corpus in tests/fuzz/corpus/<target>/ (which also holds every input that once
# crashed, so each run replays them first). Prints "fuzz: N passed, N failed" and exits non-zero on a crash.
#   scripts/fuzz.sh            each target for $FUZZ_SECONDS (default 15) seconds
#   FUZZ_SECONDS=600 scripts/fuzz.sh fuzz_codec    one target, longer
# New inputs that reach new code land in build-fuzz/new/<target>/ (copy the interesting ones into the corpus);
# a crashing input is written to build-fuzz/crash-<target>-*.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${FUZZ_SECONDS:-15}
targets=("$@")
[[ $# -eq 0 ]] && targets=(fuzz_frame_header fuzz_hello fuzz_codec fuzz_tensor_meta)
# The library sources each target needs besides its own file (all torch-free).
declare -A sources=([fuzz_hello]=src/rpc/hello.cpp [fuzz_tensor_meta]=src/wire/tensor_meta.cpp)
mkdir -p build-fuzz
pass=0
fail=0
for t in "${targets[@]}"; do
  exe=build-fuzz/$t
  srcs=(tests/fuzz/$t.cpp ${sources[$t]:-})
  if [[ ! -x $exe ]] || [[ -n $(find "${srcs[@]}" include src -name "*.hpp" -newer "$exe" -print -quit) ]]; then
    clang++ -std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all -Iinclude -Isrc \
      "${srcs[@]}" -o "$exe"
  fi
  mkdir -p "build-fuzz/new/$t"
  # -malloc_limit_mb: one allocation above it is a finding (a length field trusted before the bytes are there).
  if "$exe" "build-fuzz/new/$t" "tests/fuzz/corpus/$t" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=1024 \
       -malloc_limit_mb=256 -print_final_stats=0 -artifact_prefix="build-fuzz/crash-$t-" >"build-fuzz/$t.log" 2>&1; then
    echo "fuzz $t: ok ($(grep -o 'stat::number_of_executed_units: [0-9]*\|#[0-9]*\s*DONE' "build-fuzz/$t.log" | tail -1))"
    pass=$((pass + 1))
  else
    echo "fuzz $t: FAILED, see build-fuzz/$t.log:"
    grep -m1 -A12 'ERROR\|==ABORT\|deadly signal\|out-of-memory\|malloc(' "build-fuzz/$t.log" || tail -20 "build-fuzz/$t.log"
    fail=$((fail + 1))
  fi
done
echo "fuzz: $pass passed, $fail failed"
[[ $fail -eq 0 ]]
