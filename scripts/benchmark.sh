#!/usr/bin/env bash
# Sets up, builds and runs the main job: ResNet50 in pipeline stages on two local worker processes (CPU), under every
# schedule (GPipe, 1F1B, Interleaved 1F1B, ZB-H1, LoopedBFS, interleaved zero bubble, ZBV, DualPipeV) and 1/2/4/8
# micro-batches, each split followed by PyTorch's RPC
# tutorial on the same split and by every schedule of torch.distributed.pipelining (PyTorch 2.6, in the Debian 13
# root of `scripts/debian13.sh make --pytorch`, made here when this user is root or has password-less sudo; without
# it the tables say that the pipelining comparison did not run, and why). Writes the timelines of the last timed step
# of each run as a Chrome trace (pipeline_trace.json; open in https://ui.perfetto.dev) and the 8-split ones as a
# Gantt chart (pipeline_gantt.png).
# Extra arguments go to pipeline_bench (e.g. --tutorial, --splits 1,2,4, --schedules 1f1b,zbh1, --balance tutorial;
# see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --pytorch
# PyTorch 2.6 for the torch.distributed.pipelining comparison (Debian 12 has 1.13, which lacks it): a root of its own.
roots=${CORPC_ROOTS:-/var/tmp/corpc-roots}
if [[ $(id -u) -eq 0 ]] || sudo -n true 2>/dev/null; then
  [[ -f $roots/trixie-pytorch/.corpc-stamp ]] ||
    echo "benchmark: making a Debian 13 root with PyTorch 2.6 for the torch.distributed.pipelining comparison" \
      "(scripts/debian13.sh make --pytorch: the first time downloads Debian 13 packages, about 1.3 GB installed" \
      "under $roots)" >&2
  scripts/debian13.sh make --pytorch >&2 ||  # reuses the root unless its package list changed
    echo "benchmark: could not make the root; the pipelining comparison will be missing" >&2
elif [[ ! -f $roots/trixie-pytorch/.corpc-stamp ]]; then
  echo "benchmark: no PyTorch 2.6 root and no password-less sudo to make one: the pipelining comparison will be" \
    "missing (scripts/debian13.sh make --pytorch makes it, asking for sudo)" >&2
fi  # else: the root is there; running in it asks for sudo once, when pipeline_bench starts
# Build progress goes to stderr ("[12/87] Compiling ..."), so that stdout stays the benchmark's tables.
echo "benchmark: building corpc (the first build takes several minutes)" >&2
scripts/build.sh >&2
exec build/bench/pipeline_bench --compare-pytorch --trace pipeline_trace.json --gantt pipeline_gantt.png "$@"
