#!/usr/bin/env bash
# The cost of frame integrity (RpcOptions::seal_frames): rpc_bench's noop, async64, 1 MiB and 64 MiB cases with every
# frame tagged (the default) and with CORPC_SEAL_FRAMES=0, in alternating runs (sealed, open, open, sealed, ...), on
# the default connection between two workers of one host (Unix socket, large tensors through the same-host ring, whose
# bytes are not tagged) and over TCP alone (CORPC_SAME_HOST_CHANNEL=0 CORPC_SAME_HOST_SOCKET=0: every byte tagged, as
# between hosts). Each run's figure is its own corpc/raw ratio (raw Asio blocks interleaved with corpc's in the same
# processes), so a run that lands on a slow vCPU placement is normalised by its floor; the cost is the median over
# rounds of ratio(sealed) / ratio(open), with the rounds' spread.
#
#   bench/seal_cost.sh [path/to/rpc_bench] [rounds] [seconds per case]
set -euo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/ab_runs.sh"
ab_init seal_cost.sh 4 "$@"
cases=noop,async64,1MiB,64MiB

run() {  # run <sealed|open>-<host|tcp> <round>
  local seal=${1%%-*} path=${1##*-}
  local env=(CORPC_SEAL_FRAMES=$([[ $seal == sealed ]] && echo 1 || echo 0))
  [[ $path == tcp ]] && env+=(CORPC_SAME_HOST_CHANNEL=0 CORPC_SAME_HOST_SOCKET=0)
  env "${env[@]}" timeout 600 "$bench" --cases "$cases" --cancel-samples 0 --seconds-per-case "$seconds" \
    --json "$tmp/$1.$2.json" > "$tmp/$1.$2.txt"
}
for path in host tcp; do ab_alternate "sealed-$path" "open-$path"; done

/usr/bin/python3 - "$tmp" "$rounds" "$cases" <<'PY'
import json, statistics, sys
tmp, rounds, cases = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(",")
for path in ("host", "tcp"):
    runs = {k: [json.load(open(f"{tmp}/{k}-{path}.{r}.json")) for r in range(rounds)] for k in ("sealed", "open")}
    print(f"{path}: {'case':>7} | {'open us':>9} {'sealed us':>9} | {'open/raw':>8} {'sealed/raw':>10} | "
          f"{'sealed/open':>11} {'rounds min-max':>15}")
    for c in cases:
        med = lambda k, f: statistics.median(run[c][f] for run in runs[k])
        q = [s[c]["ratio"] / o[c]["ratio"] for o, s in zip(runs["open"], runs["sealed"])]
        print(f"{path}: {c:>7} | {med('open', 'median_us'):9.1f} {med('sealed', 'median_us'):9.1f} | "
              f"{med('open', 'ratio'):8.2f} {med('sealed', 'ratio'):10.2f} | {statistics.median(q):11.3f} "
              f"{min(q):7.3f}-{max(q):<7.3f}")
print("host: the default between workers of one host (Unix socket; 1 MiB and 64 MiB through the same-host ring);")
print("tcp: TCP only, every byte on the socket and tagged. us: corpc's median time per call (async64: per call at 64")
print(f"in flight); x/raw: over the raw floor of the same run; sealed/open: median over {rounds} rounds of")
print("ratio(sealed) / ratio(open), > 1 is the cost of frame integrity")
PY
