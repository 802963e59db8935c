#!/usr/bin/env bash
# torchrun launching a real corpc program (torchrun --no_python): every rank finds the others through the variables
# it sets. The command is the one docs/launching.md gives for every Debian line: the c10d rendezvous on a FileStore
# (--rdzv_conf store_type=file) and no shared TCP store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1). Debian's PyTorch 2.x
# is built without libuv, and every TCPStore torchrun makes itself (--standalone's, the static backend's, the shared
# one 2.x's c10d backend starts) asks for libuv whatever USE_LIBUV says: "The connection to the C10d store has failed".
# Skipped (exit 77, which Meson reports as SKIP) only when torchrun is not installed (Debian's python3-torch).
#   tests/torchrun.sh RPC_HELLO
set -uo pipefail
hello=$1
work=$(mktemp -d /tmp/torchrun-test.XXXXXX)
trap 'rm -rf "$work"' EXIT
fail() { echo "torchrun test: FAIL: $*" >&2; exit 1; }

command -v torchrun >/dev/null || { echo "torchrun test: skipped (no torchrun: Debian's python3-torch is not installed)"; exit 77; }
# Each run its own rendezvous file (a file left by an earlier run holds that run's state).
# Debian's torchrun 1.13 crashes with its default stream settings on Python 3.11 unless -r/-t are given.
# 2.x's agent gives its ranks MASTER_ADDR=socket.getfqdn() unless --local_addr says otherwise: in the test roots this
# host's name does not resolve (1.13's has no --local_addr and gives localhost).
local_addr=()
torchrun --help 2>&1 | grep -q -- '--local.addr' && local_addr=(--local_addr 127.0.0.1)
runs=0
run_torchrun() {
  runs=$((runs + 1))
  TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 timeout 120 torchrun --nnodes 1 --rdzv_backend c10d \
    --rdzv_conf store_type=file --rdzv_endpoint "$work/rdzv-$runs" --rdzv_id corpc-test "${local_addr[@]}" \
    -r 1 -t 1 --no_python "$@"
}

CORPC_SECRET=$RANDOM$RANDOM run_torchrun --nproc_per_node 3 "$hello" >"$work/out" 2>&1 ||
  { cat "$work/out"; fail "rpc_hello under torchrun"; }
grep -q 'counter on worker2: 15' "$work/out" || { cat "$work/out"; fail "torchrun run's output"; }
# rpc_hello calls launch_processes(3, ...): under torchrun that runs this rank only, not a 3-rank job per rank.
[[ $(grep -c 'counter on worker2: 15' "$work/out") == 1 ]] || { cat "$work/out"; fail "one job, not one per rank"; }

# A wrong task count: torchrun's WORLD_SIZE=2 for a 3-rank program fails every rank, naming the variable.
CORPC_SECRET=$RANDOM$RANDOM run_torchrun --nproc_per_node 2 "$hello" >"$work/out" 2>&1 &&
  { cat "$work/out"; fail "WORLD_SIZE=2 for a 3-rank program gave status 0"; }
grep -q 'WORLD_SIZE=2' "$work/out" || { cat "$work/out"; fail "the world size mismatch is not named"; }
# A rank that fails: the agent stops the other (which would sleep past the 120 s bound) and fails.
run_torchrun --nproc_per_node 2 sh -c '[ "$RANK" = 1 ] && exit 3; exec sleep 1000' >"$work/out" 2>&1
status=$?
[[ $status != 0 && $status != 124 ]] || { cat "$work/out"; fail "a killed rank: status $status"; }
echo "torchrun test: passed"
