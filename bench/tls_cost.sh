#!/usr/bin/env bash
# The cost of TLS (RpcOptions::tls): rpc_bench's noop, 4 KiB and 16 MiB echo cases over plain TCP and over TLS 1.3,
# in alternating runs (plain, tls, tls, plain, ...). Each run's figure is its own corpc/raw ratio (raw Asio TCP blocks
# interleaved with corpc blocks in the same processes; the raw floor is plain TCP in both), so a run that lands on a
# slow vCPU placement is normalised by its floor; the cost is the median over rounds of ratio(tls) / ratio(plain).
# The TLS runs use a throwaway CA and certificate made for each run (rpc_bench --tls generate).
#
#   bench/tls_cost.sh [path/to/rpc_bench] [rounds] [seconds per case]
set -euo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/ab_runs.sh"
ab_init tls_cost.sh 4 "$@"
cases=noop,4KiB,16MiB
# TLS is for links that leave the host: both sides go over TCP. (On one host the same-host channel would carry the
# 16 MiB tensors of both, outside TLS, and the comparison would measure the ring twice; and the plain runs would take
# the Unix socket, which TLS never does.)
export CORPC_SAME_HOST_CHANNEL=0 CORPC_SAME_HOST_SOCKET=0

run() {  # run <plain|tls> <round>
  local extra=()
  [[ $1 == tls ]] && extra=(--tls generate)
  timeout 600 "$bench" --cases "$cases" --cancel-samples 0 --seconds-per-case "$seconds" "${extra[@]}" \
    --json "$tmp/$1.$2.json" > "$tmp/$1.$2.txt"
}
ab_alternate plain tls

/usr/bin/python3 - "$tmp" "$rounds" "$cases" <<'PY'
import json, statistics, sys
tmp, rounds, cases = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(",")
runs = {k: [json.load(open(f"{tmp}/{k}.{r}.json")) for r in range(rounds)] for k in ("plain", "tls")}
print(f"{'case':>6} | {'plain us':>10} {'tls us':>10} | {'plain/raw':>9} {'tls/raw':>8} | {'tls/plain':>9} {'rounds min-max':>15}")
for c in cases:
    med = lambda k, f: statistics.median(run[c][f] for run in runs[k])
    q = [t[c]["ratio"] / p[c]["ratio"] for p, t in zip(runs["plain"], runs["tls"])]
    print(f"{c:>6} | {med('plain', 'median_us'):10.1f} {med('tls', 'median_us'):10.1f} | "
          f"{med('plain', 'ratio'):9.2f} {med('tls', 'ratio'):8.2f} | {statistics.median(q):9.2f} "
          f"{min(q):7.2f}-{max(q):<7.2f}")
print(f"us: corpc's median time per call (the case's echo, both ways); x/raw: that over the raw TCP floor of the same run;")
print(f"tls/plain: median over {rounds} rounds of ratio(tls) / ratio(plain), > 1 is the cost of TLS")
PY
