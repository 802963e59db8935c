#!/usr/bin/env bash
# DDP steps/s on 2 ranks x 1 thread: corpc (overlapped buckets), corpc with one allreduce after backward, and
# PyTorch's DDP, interleaved round by round so machine noise hits all three alike. Prints the median of each and
# the median of the per-round ratios.
#   bench/compare_ddp.sh [rounds] [steps] [models]   (from the repository root, after ninja -C $BUILD bench/ddp_bench;
#   BUILD defaults to build). On libtorch 2.14, both sides in the root of scripts/root.sh make forky:
#   scripts/root.sh run forky 'BUILD=build-forky bench/compare_ddp.sh 3 10 "linear cnn resnet18"'
#   models: space-separated, default "linear resnet18" (also: cnn)
set -euo pipefail
python=${PYTHON:-/usr/bin/python3}  # Debian's python3-torch; a pyenv python3 first on PATH has no torch
rounds=${1:-3}
steps=${2:-10}
models=${3:-linear resnet18}
tmp=$(mktemp)
uptime | sed 's/^/# load at start:/' >&2
for model in $models; do
  for ((r = 0; r < rounds; r++)); do
    # A run that fails or hangs (a rank killed under load) loses its round, not the table.
    timeout 300 ./${BUILD:-build}/bench/ddp_bench "$model" overlap "$steps" >>"$tmp" || echo "# round $r: corpc overlap failed" >&2
    timeout 300 ./${BUILD:-build}/bench/ddp_bench "$model" after "$steps" >>"$tmp" || echo "# round $r: corpc after failed" >&2
    timeout 300 "$python" bench/pytorch_ddp_bench.py "$model" "$steps" 2>/dev/null >>"$tmp" ||
      echo "# round $r: pytorch failed" >&2
    echo "round $model $r" >>"$tmp"
  done
done
uptime | sed 's/^/# load at end:/' >&2
grep '^# threads' "$tmp" | sort -u >&2 || true
python3 - "$tmp" <<'PY'
import statistics, sys
runs, params, rounds, cur = {}, {}, {}, {}
for line in open(sys.argv[1]):
    f = line.split()
    if f[:2] == ["#", "params"]:
        params.setdefault(f[2], set()).add(int(f[3]))
    elif f[0] == "round":
        rounds.setdefault(f[1], []).append(cur)
        cur = {}
    elif not line.startswith("#"):
        runs.setdefault(f[1], {}).setdefault(f[0], []).append(float(f[2]))
        cur[f[0]] = float(f[2])
print("| model | parameters (corpc = PyTorch) | corpc DDP (overlap) | corpc allreduce after backward | PyTorch DDP "
      "| overlap / after | corpc / PyTorch |")
print("|---|---|---|---|---|---|---|")
def ratio(rs, a, b):
    v = [r[a] / r[b] for r in rs if a in r and b in r]
    return f"{statistics.median(v):.2f}" if v else "n/a"
for model, r in runs.items():
    m = {k: f"{statistics.median(v):.2f}" for k, v in r.items()}
    p = params.get(model, set())
    print(f"| {model} | {'/'.join(f'{n:,}' for n in sorted(p))} | {m.get('corpc-overlap', 'n/a')} | "
          f"{m.get('corpc-after', 'n/a')} | {m.get('pytorch', 'n/a')} | "
          f"{ratio(rounds[model], 'corpc-overlap', 'corpc-after')} | {ratio(rounds[model], 'corpc-overlap', 'pytorch')} |")
PY
rm -f "$tmp"
