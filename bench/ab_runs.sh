# Sourced by the A/B cost scripts (flow_cost.sh, tls_cost.sh): the arguments they share, and the alternating order
# of their runs. Only ratios taken in one run, interleaved, mean anything on a VM whose vCPUs move between fast and
# slow placements:
# A, B in even rounds and B, A in odd ones, so neither side always runs first.
#
# ab_init <script name> <default rounds> "$@" sets bench, rounds, seconds (from [path/to/rpc_bench] [rounds]
# [seconds]) and tmp (removed at exit); ab_alternate <A> <B> calls the script's run <A|B> <round> for every round.

ab_init() {
  local name=$1 default_rounds=$2
  shift 2
  local root
  root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  bench=${1:-$root/build/bench/rpc_bench}
  rounds=${2:-$default_rounds}
  seconds=${3:-2}
  if [[ ! -x $bench ]]; then
    echo "$name: no rpc_bench at '$bench' (build it, or pass its path)" >&2
    exit 2
  fi
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
}

ab_alternate() {
  local r
  for ((r = 0; r < rounds; ++r)); do
    if ((r % 2 == 0)); then run "$1" "$r"; run "$2" "$r"; else run "$2" "$r"; run "$1" "$r"; fi
  done
}
