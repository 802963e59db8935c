#!/usr/bin/env bash
# Builds consumer.cpp out of tree the three ways a user's project gets corpc, and runs each build across two local
# processes:
#   1. `meson install` of this build into a temporary prefix, then g++ with `pkg-config --cflags --libs corpc`;
#   2. a CMake project with find_package(corpc) from that prefix;
#   3. a Meson project with corpc as a subproject, the install above in its search paths (built only with CORPC_CONSUMER_SUBPROJECT_BUILD=1), checking that only the library is built (no tests, benchmarks or
#      examples, none of corpc's tests in the user's `meson test`, no nvcc probe, no Asio defines in user flags).
#   tests/consumer/run.sh SOURCE_ROOT BUILD_DIR
set -euo pipefail
src=$(cd "$1" && pwd)
build=$(cd "$2" && pwd)
here="$src/tests/consumer"
work=$(mktemp -d /tmp/corpc-consumer.XXXXXX)
trap 'rm -rf "$work"' EXIT
fail() { echo "consumer: FAIL: $*" >&2; exit 1; }
step() { echo "== $* ($(date +%T))"; }

step "meson install into a temporary prefix"
meson install -C "$build" --no-rebuild --quiet --destdir "$work/root" >/dev/null
pc=$(find "$work/root" -name corpc.pc | head -1)
[[ -n "$pc" ]] || fail "meson install wrote no corpc.pc"
prefix="$work/root$(sed -n 's/^prefix=//p' "$pc")"
mkdir "$work/pkgconfig"
for f in "$(dirname "$pc")"/corpc*.pc; do  # the prefix it will be used from (a DESTDIR install keeps the real one)
  sed "s|^prefix=.*|prefix=$prefix|" "$f" >"$work/pkgconfig/$(basename "$f")"
done
[[ -f "$prefix/include/corpc/corpc.hpp" ]] || fail "headers not installed"

step "1. g++ with pkg-config"
export PKG_CONFIG_PATH="$work/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
# shellcheck disable=SC2046  # pkg-config's output is a list of flags
g++ -std=c++20 "$here/consumer.cpp" -o "$work/consumer_pkgconfig" $(pkg-config --cflags --libs corpc)
"$work/consumer_pkgconfig"

step "2. CMake, find_package(corpc)"
cmake -S "$here" -B "$work/cmake" -G Ninja -DCMAKE_PREFIX_PATH="$prefix" >"$work/cmake.log" 2>&1 ||
  { cat "$work/cmake.log"; fail "cmake configure"; }
cmake --build "$work/cmake" >"$work/cmake-build.log" 2>&1 || { cat "$work/cmake-build.log"; fail "cmake build"; }
"$work/cmake/consumer"

step "3. Meson, corpc as a subproject"
mkdir -p "$work/meson/subprojects"
cp "$here/consumer.cpp" "$here/meson.build" "$work/meson/"
ln -s "$src" "$work/meson/subprojects/corpc"
# With the install of step 0 in both search paths, as on a machine where the README's install was done: the subproject
# must still be what the project gets.
CMAKE_PREFIX_PATH="$prefix" meson setup "$work/meson/build" "$work/meson" >"$work/meson.log" 2>&1 ||
  { cat "$work/meson.log"; fail "meson setup"; }
grep -q "subprojects/corpc/include" "$work/meson/build/compile_commands.json" &&
  ! grep -q "$prefix/include" "$work/meson/build/compile_commands.json" ||
  fail "consumer.cpp is not compiled against the subproject's headers alone"
! grep -qi "nvcc" "$work/meson/build/meson-logs/meson-log.txt" || fail "the subproject probed nvcc"
tests=$(meson test -C "$work/meson/build" --list --no-rebuild 2>/dev/null)
# Meson 1.12 names a test by its project too ("corpc_consumer:consumer"); earlier releases by itself.
[[ "$tests" == "consumer" || "$tests" == "corpc_consumer:consumer" ]] ||
  fail "the user's meson test lists more than its own test: $tests"
targets=$(ninja -C "$work/meson/build" -t targets all | grep -oE '^subprojects/corpc/[^:]*(tests|bench|examples)/[^:]*' || true)
[[ -z "$targets" ]] || fail "the subproject defines test/bench/example targets: $targets"
# Building libcorpc again from source costs minutes of CPU (no ccache hits from another tree): CI checks the
# subproject's configuration and the user's compile flags; CORPC_CONSUMER_SUBPROJECT_BUILD=1 also builds and runs it.
grep -q 'consumer.cpp' "$work/meson/build/compile_commands.json" || fail "no compile command for consumer.cpp"
python3 -c 'import json,sys; sys.exit(any("ASIO" in c["command"] for c in json.load(open(sys.argv[1])) if c["file"].endswith("consumer.cpp")))' \
  "$work/meson/build/compile_commands.json" || fail "Asio defines leak into the user's compile flags"
if [[ "${CORPC_CONSUMER_SUBPROJECT_BUILD:-0}" == 1 ]]; then
  ninja -C "$work/meson/build" >"$work/ninja.log" 2>&1 || { cat "$work/ninja.log"; fail "ninja"; }
  "$work/meson/build/consumer"
  echo "consumer: all three builds ran"
else
  echo "consumer: pkg-config and CMake builds ran; subproject configuration checked (set CORPC_CONSUMER_SUBPROJECT_BUILD=1 to build it)"
fi
