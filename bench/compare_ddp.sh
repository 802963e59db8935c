#!/usr/bin/env bash
# DDP steps/s on 2 ranks x 1 thread: corpc (overlapped buckets), corpc with one allreduce after backward, and
# PyTorch's DDP, interleaved round by round so machine noise hits all three alike. Prints the median of each.
#   bench/compare_ddp.sh [rounds] [steps]      (from the repository root, after ninja -C build bench/ddp_bench)
set -euo pipefail
python=${PYTHON:-/usr/bin/python3}  # Debian's python3-torch; a pyenv python3 first on PATH has no torch
rounds=${1:-3}
steps=${2:-20}
tmp=$(mktemp)
for model in linear cnn; do
  for ((r = 0; r < rounds; r++)); do
    ./build/bench/ddp_bench "$model" overlap "$steps" >>"$tmp"
    ./build/bench/ddp_bench "$model" after "$steps" >>"$tmp"
    "$python" bench/pytorch_ddp_bench.py "$model" "$steps" 2>/dev/null >>"$tmp"
  done
done
python3 - "$tmp" <<'PY'
import statistics, sys
runs = {}
for line in open(sys.argv[1]):
    who, model, rate = line.split()
    runs.setdefault(model, {}).setdefault(who, []).append(float(rate))
print(f"| model | corpc DDP (overlap) | corpc allreduce after backward | PyTorch DDP | corpc / PyTorch |")
print(f"|---|---|---|---|---|")
for model, r in runs.items():
    m = {k: statistics.median(v) for k, v in r.items()}
    print(f"| {model} | {m['corpc-overlap']:.2f} | {m['corpc-after']:.2f} | {m['pytorch']:.2f} | "
          f"{m['corpc-overlap'] / m['pytorch']:.2f} |")
PY
rm -f "$tmp"
