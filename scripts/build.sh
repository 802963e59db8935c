#!/usr/bin/env bash
# Configures (once) and builds corpc in ./build. Extra arguments go to `meson setup` on the first run.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ ! -f build/build.ninja ]]; then
  meson setup build --buildtype=release "$@" >/dev/null
fi
ninja -C build
