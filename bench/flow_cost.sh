#!/usr/bin/env bash
# The cost of flow control at 64 calls in flight: rpc_bench's async64 case with RpcOptions' default limits (per-peer
# call limit, receive budgets, held requests, write backlog) against the same limits set so high that they never
# bind, in alternating runs (on, off, off, on, ...). Each run's figure is its own corpc/raw ratio (raw Asio blocks
# interleaved with corpc blocks in the same processes), so a run that lands on a slow vCPU placement is normalised by
# its floor; the cost is the median over rounds of ratio(on) / ratio(off) - 1.
#
#   bench/flow_cost.sh [path/to/rpc_bench] [rounds] [seconds per run]
set -euo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/ab_runs.sh"
ab_init flow_cost.sh 6 "$@"

run() {  # run <on|off> <round>
  timeout 300 "$bench" --cases async64 --cancel-samples 0 --seconds-per-case "$seconds" --flow-control "$1" \
    --json "$tmp/$1.$2.json" > "$tmp/$1.$2.txt"
}
ab_alternate on off

/usr/bin/python3 - "$tmp" "$rounds" <<'PY'
import json, statistics, sys
tmp, rounds = sys.argv[1], int(sys.argv[2])
rows = []
for r in range(rounds):
    on = json.load(open(f"{tmp}/on.{r}.json"))["async64"]
    off = json.load(open(f"{tmp}/off.{r}.json"))["async64"]
    rows.append((r, on["calls_per_s"], off["calls_per_s"], on["ratio"], off["ratio"], on["ratio"] / off["ratio"]))
print(f"{'round':>5} | {'on calls/s':>11} {'off calls/s':>11} | {'on/raw':>7} {'off/raw':>7} | {'on/off':>7}")
for r, con, coff, ron, roff, q in rows:
    print(f"{r:>5} | {con:11.0f} {coff:11.0f} | {ron:7.3f} {roff:7.3f} | {q:7.3f}")
q = statistics.median(x[5] for x in rows)
print(f"flow control at 64 in flight: median on/off time-per-call ratio {q:.3f} "
      f"({(q - 1) * 100:+.1f}% throughput cost) over {rounds} rounds")
PY
