#!/usr/bin/env bash
# Open MPI's mpirun launching real corpc programs on this host: each rank reads OMPI_COMM_WORLD_RANK/SIZE, and finds
# rank 0 through MASTER_ADDR/MASTER_PORT passed with -x (mpirun does not say where rank 0 runs). The command is the
# one docs/launching.md gives. Skipped (exit 77, which Meson reports as SKIP) only when mpirun is not installed
# (Debian's openmpi-bin).
#   tests/mpirun.sh RPC_HELLO DDP_TRAIN
set -uo pipefail
hello=$1 ddp=$2
work=$(mktemp -d /tmp/mpirun-test.XXXXXX)
# Every process the test starts carries CORPC_MPIRUN_TEST=$work (not this shell): what is left after a run is found by it.
leftovers() { grep -lsz "^CORPC_MPIRUN_TEST=$work\$" /proc/[0-9]*/environ | cut -d/ -f3 | grep -vx "$$" || true; }
cleanup() { for pid in $(leftovers); do kill -KILL "$pid" 2>/dev/null; done; rm -rf "$work"; }
trap cleanup EXIT
fail() { echo "mpirun test: FAIL: $*" >&2; exit 1; }

command -v mpirun >/dev/null || { echo "mpirun test: skipped (no mpirun: Debian's openmpi-bin is not installed)"; exit 77; }
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
# As root Open MPI wants --allow-run-as-root; --oversubscribe: more ranks than this host's cores. Every rank gets the
# same MASTER_ADDR, MASTER_PORT and CORPC_SECRET (-x NAME passes this shell's value).
run_mpirun() {
  local n=$1
  shift
  CORPC_MPIRUN_TEST=$work MASTER_ADDR=127.0.0.1 MASTER_PORT=$(free_port) CORPC_SECRET=$RANDOM$RANDOM$RANDOM \
    timeout 120 mpirun --allow-run-as-root --oversubscribe -n "$n" \
    -x MASTER_ADDR -x MASTER_PORT -x CORPC_SECRET -x CORPC_MPIRUN_TEST "$@"
}
no_leftovers() {
  local left
  left=$(leftovers)
  [[ -z $left ]] || { ps -o pid,args -p "${left//$'\n'/,}"; fail "processes left after $1"; }
}

# rpc_hello, 3 ranks: the right answers once (one job, not one per rank), every rank exits 0.
run_mpirun 3 sh -c '"$0"; echo "rank $OMPI_COMM_WORLD_RANK exited $?"' "$hello" >"$work/out" 2>&1 ||
  { cat "$work/out"; fail "rpc_hello under mpirun"; }
grep -q '^add on worker1: 5$' "$work/out" && grep -q '^counter on worker2: 15$' "$work/out" ||
  { cat "$work/out"; fail "rpc_hello's answers"; }
[[ $(grep -c 'counter on worker2: 15' "$work/out") == 1 ]] || { cat "$work/out"; fail "one job, not one per rank"; }
for r in 0 1 2; do grep -q "^rank $r exited 0$" "$work/out" || { cat "$work/out"; fail "rank $r's exit status"; }; done
no_leftovers "rpc_hello"

# DDP (examples/ddp_train), 4 ranks: every rank's parameters equal rank 0's (the program checks), status 0.
run_mpirun 4 "$ddp" 5 >"$work/out" 2>&1 || { cat "$work/out"; fail "ddp_train under mpirun"; }
grep -q '^ddp_train: 4 ranks, 5 steps, .*parameters identical$' "$work/out" || { cat "$work/out"; fail "ddp_train's output"; }
no_leftovers "ddp_train"

# A wrong task count: 2 ranks of a 3-rank program fail at once, naming Open MPI's variable; mpirun fails.
run_mpirun 2 "$hello" >"$work/out" 2>&1 && { cat "$work/out"; fail "OMPI_COMM_WORLD_SIZE=2 for a 3-rank program gave status 0"; }
grep -q 'OMPI_COMM_WORLD_SIZE=2 ranks; start it with 3' "$work/out" || { cat "$work/out"; fail "the world size mismatch is not named"; }
no_leftovers "a wrong task count"

# A rank that dies (rank 1 killed before it starts corpc): mpirun aborts the job at once (the other ranks are
# killed), exits with the dead rank's status (137: SIGKILL) and leaves no process.
run_mpirun 3 sh -c '[ "$OMPI_COMM_WORLD_RANK" = 1 ] && kill -KILL $$; exec "$0"' "$hello" >"$work/out" 2>&1
status=$?
[[ $status == 137 ]] || { cat "$work/out"; fail "a job with a killed rank: status $status, not 137"; }
grep -q 'the job has been aborted' "$work/out" || { cat "$work/out"; fail "mpirun's report of the killed rank"; }
no_leftovers "a killed rank"
# A rank 0 that never comes up (it sleeps instead of starting corpc): the other ranks give up within their init
# timeout (CORPC_INIT_TIMEOUT_MS, 3 s here), each naming rank 0's address and where it came from; mpirun then ends
# the job (status 1, not timeout's 124) and leaves no process.
CORPC_INIT_TIMEOUT_MS=3000 run_mpirun 3 -x CORPC_INIT_TIMEOUT_MS \
  sh -c '[ "$OMPI_COMM_WORLD_RANK" = 0 ] && exec sleep 100; exec "$0"' "$hello" >"$work/out" 2>&1
status=$?
[[ $status != 0 && $status != 124 ]] || { cat "$work/out"; fail "a job whose rank 0 never came up: status $status"; }
[[ $(grep -c 'could not reach rank 0 at 127.0.0.1:[0-9]* (MASTER_ADDR, MASTER_PORT) within the init timeout' "$work/out") == 2 ]] ||
  { cat "$work/out"; fail "ranks 1 and 2 do not both say that rank 0 never came up, naming MASTER_ADDR"; }
no_leftovers "a rank 0 that never came up"
echo "mpirun test: passed"
