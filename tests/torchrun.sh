#!/usr/bin/env bash
# torchrun launching a real corpc program (torchrun --no_python): every rank finds the others through the variables
# it sets. Skipped (exit 77, which Meson reports as SKIP) when torchrun is missing or cannot start ranks at all:
# Debian 13's cannot (its TCPStore asks for libuv, which Debian's build lacks; pytorch#148283).
#   tests/torchrun.sh RPC_HELLO
set -uo pipefail
hello=$1
work=$(mktemp -d /tmp/torchrun-test.XXXXXX)
trap 'rm -rf "$work"' EXIT
fail() { echo "torchrun test: FAIL: $*" >&2; exit 1; }

command -v torchrun >/dev/null || { echo "torchrun test: skipped (no torchrun)"; exit 77; }
# What --standalone sets up, on a port the OS chooses: --standalone always uses 29400, which another job on the host
# may hold. Each run gets its own port (the probe's agent may still hold its own when the next starts).
# Debian's torchrun 1.13 crashes with its default stream settings on Python 3.11 unless -r/-t are given.
run_torchrun() {
  local port
  port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  timeout 120 torchrun --nnodes 1 --rdzv_backend c10d --rdzv_endpoint "localhost:$port" \
    --rdzv_id "corpc-test-$$-$port" -r 1 -t 1 --no_python "$@"
}
run_torchrun --nproc_per_node 1 true >"$work/probe" 2>&1 ||
  { tail -3 "$work/probe"; echo "torchrun test: skipped (torchrun cannot start ranks here)"; exit 77; }

CORPC_SECRET=$RANDOM$RANDOM run_torchrun --nproc_per_node 3 "$hello" >"$work/out" 2>&1 ||
  { cat "$work/out"; fail "rpc_hello under torchrun"; }
grep -q 'counter on worker2: 15' "$work/out" || { cat "$work/out"; fail "torchrun run's output"; }
echo "torchrun test: passed"
