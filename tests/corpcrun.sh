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

# --max-rank-restarts: rank 1 killed in its first process is started again in place with CORPC_REJOIN=1 and
# CORPC_RANK_RESTART=1, while rank 0 keeps running (it waits for the second process of rank 1); the run succeeds.
"$corpcrun" -n 3 --max-rank-restarts 1 --timeout 120 sh -c '
  echo "process restart=${CORPC_RANK_RESTART:--} rejoin=${CORPC_REJOIN:--}"
  if [ "$RANK" = 1 ]; then [ -z "$CORPC_RANK_RESTART" ] && kill -KILL $$; touch "$0/rejoined"; fi
  if [ "$RANK" = 0 ]; then while [ ! -e "$0/rejoined" ]; do sleep 0.05; done; fi' "$work" >"$work/out" 2>"$work/err" ||
  { cat "$work/out" "$work/err"; fail "a restarted rank failed the run"; }
[[ $(grep -c '^\[rank 1\] process' "$work/out") == 2 ]] || { cat "$work/out"; fail "rank 1 did not run twice"; }
grep -q '^\[rank 1\] process restart=1 rejoin=1$' "$work/out" || { cat "$work/out"; fail "the restart's variables"; }
[[ $(grep -c '^\[rank [02]\] process restart=- rejoin=-$' "$work/out") == 2 ]] || { cat "$work/out"; fail "ranks 0, 2 ran once"; }
grep -q 'warning: rank 1 killed by signal Killed; restarting it in place (restart 1 of 1)' "$work/err" ||
  { cat "$work/err"; fail "the restart's warning"; }
# A rank that always fails is restarted twice, then fails the run; rank 0 is never restarted.
"$corpcrun" -n 2 --max-rank-restarts 2 --timeout 120 sh -c '[ "$RANK" = 1 ] && exit 3; exit 0' 2>"$work/err" &&
  fail "a rank that always fails gave status 0"
[[ $(grep -c 'restarting it in place' "$work/err") == 2 ]] || { cat "$work/err"; fail "two restarts"; }
grep -q 'rank 1 exited with code 3 (after 2 restart(s))' "$work/err" || { cat "$work/err"; fail "the exhausted rank"; }
"$corpcrun" -n 2 --max-rank-restarts 2 --timeout 120 sh -c '[ "$RANK" = 0 ] && exit 4; exit 0' 2>"$work/err" &&
  fail "a failed rank 0 gave status 0"
! grep -q 'restarting' "$work/err" && grep -q 'rank 0 exited with code 4$' "$work/err" || { cat "$work/err"; fail "rank 0"; }

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
