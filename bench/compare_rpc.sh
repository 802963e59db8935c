#!/usr/bin/env bash
# corpc vs PyTorch RPC (TensorPipe) on this machine: runs bench/rpc_bench, then bench/pytorch_rpc_bench.py, and prints
# the medians side by side. PyTorch runs in two configurations: TCP only (TensorPipe's uv transport and basic channel,
# every case) and its default one on a single host (shared-memory transport, cross-memory-attach channel; the 1, 16
# and 64 MiB echoes), shown in the last columns.
#
#   bench/compare_rpc.sh [path/to/rpc_bench] [extra rpc_bench args...]
#
# Default binary: build/bench/rpc_bench. PYTORCH_BENCH_ARGS adds arguments to the Python benchmark (e.g.
# "--iters-scale 0.5"). Needs Debian's python3-torch for /usr/bin/python3.
# The two runs are sequential (corpc first, then PyTorch), not interleaved: a VM's vCPUs move between fast and slow
# placements, so treat the cross-framework speedups as approximate; corpc's own floor ratios (rpc_bench) are
# interleaved.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bench=${1:-$root/build/bench/rpc_bench}
[[ $# -gt 0 ]] && shift
if [[ ! -x $bench ]]; then
  echo "compare_rpc.sh: no rpc_bench at '$bench' (build it, or pass its path)" >&2
  exit 2
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

echo "== corpc: $bench $*"
timeout 600 "$bench" --json "$tmp/corpc.json" "$@"
echo
echo "== PyTorch RPC: /usr/bin/python3 bench/pytorch_rpc_bench.py ${PYTORCH_BENCH_ARGS:-}"
# shellcheck disable=SC2086  # word splitting of the extra arguments is intended
timeout 900 /usr/bin/python3 "$root/bench/pytorch_rpc_bench.py" ${PYTORCH_BENCH_ARGS:-} | tee "$tmp/pytorch.txt"
grep '^JSON: ' "$tmp/pytorch.txt" | tail -n 1 | sed 's/^JSON: //' > "$tmp/pytorch.json"
if [[ ! -s $tmp/pytorch.json ]]; then
  echo "compare_rpc.sh: the PyTorch benchmark printed no JSON line" >&2
  exit 1
fi

echo
/usr/bin/python3 - "$tmp/corpc.json" "$tmp/pytorch.json" <<'EOF'
import json
import sys

corpc = json.load(open(sys.argv[1]))
torch = json.load(open(sys.argv[2]))
cases = [c for c in ["noop", "4KiB", "1MiB", "16MiB", "64MiB", "async64", "remote", "chain"] if c in corpc or c in torch]

def fmt(v, spec):
    return "-" if v is None else format(v, spec)

hdr = f"{'case':>8} | {'corpc med us':>13} {'PyTorch med us':>15} {'PyTorch/corpc':>14} | " \
      f"{'corpc p99 us':>13} {'PyTorch p99 us':>15} | {'corpc/raw':>9} | {'PyT default us':>14} {'default/corpc':>13}"
print(hdr)
print("-" * len(hdr))
for c in cases:
    a, b = corpc.get(c, {}), torch.get(c, {})
    ratio = a.get("ratio")
    if c == "async64":
        ca, cb = a.get("calls_per_s"), b.get("calls_per_s")
        speed = cb and ca and ca / cb  # throughput: corpc calls/s over PyTorch's
        print(f"{c:>8} | {fmt(ca, '>9.0f') + ' c/s':>13} {fmt(cb, '>11.0f') + ' c/s':>15} {fmt(speed, '>13.2f') + 'x':>14} | "
              f"{'':>13} {'':>15} | {fmt(ratio, '>9.2f')}")
        continue
    ma, mb = a.get("median_us"), b.get("median_us")
    speed = ma and mb and mb / ma
    md = torch.get(c + "@default", {}).get("median_us")
    dspeed = ma and md and md / ma
    print(f"{c:>8} | {fmt(ma, '>13.1f')} {fmt(mb, '>15.1f')} {fmt(speed, '>13.2f') + 'x':>14} | "
          f"{fmt(a.get('p99_us'), '>13.1f')} {fmt(b.get('p99_us'), '>15.1f')} | {fmt(ratio, '>9.2f')} | "
          f"{fmt(md, '>14.1f')} {fmt(dspeed, '>12.2f') + 'x':>13}")
print("-" * len(hdr))
print("PyTorch/corpc > 1: corpc is faster (latency: PyTorch median / corpc median; async64: corpc calls/s / PyTorch's).")
print("PyTorch (med, p99): TensorPipe over TCP only; PyT default: its default same-host configuration (shm + CMA).")
print("Not interleaved: PyTorch ran after corpc, minutes apart, and a VM's vCPUs switch between fast and slow")
print("placements, so these cross-framework ratios are approximate. corpc/raw is rpc_bench's interleaved ratio to a")
print("raw Asio TCP echo (median of per-block ratios), the reliable measure of corpc's own overhead.")
EOF
