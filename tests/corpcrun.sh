#!/usr/bin/env bash
# corpcrun launching real corpc programs on this host (torchrun: tests/torchrun.sh).
#   tests/corpcrun.sh CORPCRUN RPC_HELLO
set -uo pipefail
corpcrun=$1 hello=$2
work=$(mktemp -d /tmp/corpcrun-test.XXXXXX)
trap 'rm -rf "$work"' EXIT
fail() { echo "corpcrun test: FAIL: $*" >&2; exit 1; }

# Three ranks of an example: every rank's output carries its prefix, and the run succeeds.
"$corpcrun" -n 3 --timeout 120 "$hello" >"$work/out" 2>"$work/err" || { cat "$work/out" "$work/err"; fail "rpc_hello under corpcrun"; }
grep -q '^\[rank 0\] counter on worker2: 15$' "$work/out" || { cat "$work/out"; fail "rank 0's output"; }
# rpc_hello calls launch_processes(3, ...): under a launcher that runs this rank only, not a 3-rank job per rank.
[[ $(grep -c 'counter on worker2: 15' "$work/out") == 1 ]] || { cat "$work/out"; fail "one job, not one per rank"; }
"$corpcrun" -n 2 --timeout 120 "$hello" >"$work/out" 2>&1 && { cat "$work/out"; fail "WORLD_SIZE=2 for a 3-rank program gave status 0"; }
grep -q 'WORLD_SIZE=2' "$work/out" || { cat "$work/out"; fail "the world size mismatch is not named"; }

# A failing rank: non-zero status, the failure named, the rank still running killed after the grace period.
"$corpcrun" -n 2 --grace 1 --timeout 120 sh -c '[ "$RANK" = 1 ] && exit 3; sleep 100' 2>"$work/err" && fail "a failed rank gave status 0"
grep -q 'rank 1 exited with code 3' "$work/err" || { cat "$work/err"; fail "the failed rank is not named"; }
grep -q 'rank 0 killed' "$work/err" || { cat "$work/err"; fail "the surviving rank was not killed"; }

# SIGTERM to corpcrun reaches every rank.
"$corpcrun" -n 2 --timeout 120 sh -c 'trap "echo got TERM; exit 0" TERM; echo ready; sleep 100 & wait' >"$work/out" 2>&1 &
pid=$!
for _ in $(seq 600); do [[ $(grep -c ready "$work/out") == 2 ]] && break; sleep 0.1; done
kill -TERM $pid
wait $pid || { cat "$work/out"; fail "ranks that exit 0 on SIGTERM gave a failure"; }
[[ $(grep -c 'got TERM' "$work/out") == 2 ]] || { cat "$work/out"; fail "SIGTERM not forwarded to both ranks"; }

# CORPC_LOG: the library's warning (no secret) names the worker and function by default, and is gone with "error".
"$corpcrun" -n 3 --timeout 60 sh -c 'CORPC_SECRET= exec "$0"' "$hello" >"$work/out" 2>&1
grep -q '^\[rank 0\] corpc warn \[master, init_rpc\]: no shared secret' "$work/out" || { cat "$work/out"; fail "default log level"; }
CORPC_LOG=error "$corpcrun" -n 3 --timeout 60 sh -c 'CORPC_SECRET= exec "$0"' "$hello" >"$work/out" 2>&1
! grep -q 'corpc warn' "$work/out" || { cat "$work/out"; fail "CORPC_LOG=error still prints warnings"; }

echo "corpcrun test: passed"
