#!/usr/bin/env bash
# Steps/s of the tutorials' training systems: corpc's examples beside PyTorch's versions of the same programs
# (bench/pytorch_systems.py: tutorial code, same model, batch and one intra-op thread), interleaved round by round so
# that machine noise hits both alike. Prints the median rates, the median of the per-round ratios and the number of
# rounds in which both ran (a failed run is left out; PyTorch's stderr goes to $LOG, /dev/null by default).
#   bench/compare_systems.sh [rounds] [ps steps per trainer] [hybrid steps]
# (from the repository root, after ninja -C $BUILD examples/param_server examples/ddp_rpc_hybrid; BUILD defaults to
# build)
# PYTHON is the command that runs PyTorch's side, words split on spaces: by default /usr/bin/python3. On libtorch 2.14,
# both sides in the root that scripts/root.sh make forky makes:
#   scripts/root.sh run forky 'BUILD=build-forky USE_LIBUV=0 bench/compare_systems.sh 2 200 100'
# PyTorch 2.6 in its root, beside the host's build:
#   PYTHON="scripts/root.sh run trixie --pytorch env USE_LIBUV=0 python3" bench/compare_systems.sh 2 200 100
set -euo pipefail
# A pyenv python3 first on PATH has no torch: Debian's by its path.
read -ra python <<<"${PYTHON:-/usr/bin/python3}"
rounds=${1:-3}
steps=${2:-200}
hybrid_steps=${3:-100}
tmp=$(mktemp)
trap 'rm -f "$tmp"' EXIT
echo "# PyTorch: $("${python[@]}" bench/pytorch_systems.py --version 2>/dev/null || echo '?'); load before: $(uptime)"
for ((r = 0; r < rounds; r++)); do
  for c in "async 1" "async 2" "batch 2"; do
    set -- $c
    ./${BUILD:-build}/examples/param_server --mode "$1" --trainers "$2" --steps "$steps" |
      sed -n "s/.* \([0-9.]*\) steps\/s.*/corpc ps-$1 $2 \1 $r/p" >>"$tmp"
    "${python[@]}" bench/pytorch_systems.py "ps-$1" "$2" "$steps" 2>>"${LOG:-/dev/null}" | sed "s/\$/ $r/" >>"$tmp"
  done
  ./${BUILD:-build}/examples/ddp_rpc_hybrid --steps "$hybrid_steps" |
    sed -n "s/.* \([0-9.]*\) steps\/s.*/corpc hybrid 2 \1 $r/p" >>"$tmp"
  "${python[@]}" bench/pytorch_systems.py hybrid 2 "$hybrid_steps" 2>>"${LOG:-/dev/null}" | sed "s/\$/ $r/" >>"$tmp"
done
echo "# load after: $(uptime)"
python3 - "$tmp" <<'PY'
import statistics, sys
rates = {}
for line in open(sys.argv[1]):
    who, case, trainers, rate, rnd = line.split()
    rates.setdefault((case, trainers), {}).setdefault(who, {})[rnd] = float(rate)
print("| program | trainers | corpc steps/s | PyTorch steps/s | corpc / PyTorch | rounds |")
print("|---|---:|---:|---:|---:|---:|")
for (case, trainers), r in rates.items():
    both = sorted(set(r.get("corpc", {})) & set(r.get("pytorch", {})))
    ratio = statistics.median(r["corpc"][k] / r["pytorch"][k] for k in both) if both else float("nan")
    med = {who: statistics.median(v.values()) for who, v in r.items()}
    print(f"| {case} | {trainers} | {med.get('corpc', float('nan')):.1f} | {med.get('pytorch', float('nan')):.1f} | {ratio:.2f} | {len(both)} |")
PY
