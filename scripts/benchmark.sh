#!/usr/bin/env bash
# Sets up, builds and runs the main job: ResNet50 in pipeline stages on two local worker processes (CPU), under every
# schedule (GPipe, 1F1B, Interleaved 1F1B, ZB-H1, LoopedBFS, interleaved zero bubble, ZBV, DualPipeV) and 2/4/8
# micro-batches, each stage cut for the schedule that runs and refined by real steps (--balance schedule).
#
# Figures a newcomer can trust: every (schedule, split) cell runs 3 times (--repeats), corpc's schedules and
# pipelining's alternating per split (A B A B A B), and the two one-process references (C++, Python) alternate the
# same way after the splits; every cell shows the median and the range, and the summary compares medians. Each
# process's CPU time and threads are in the tables. To pay for the repeats, each run times 2 batches (after 1 warm-up)
# instead of 3, the split of 1 micro-batch (no pipelining: every schedule's bubble is half the step) is left out, and
# the libtorch 1.13 column runs once per cell. On a 2-vCPU VM (2026-12-07): 19 min with the root made and the builds
# up to date, most of it the 2.14 run's repeats; the first time about 15 min more (the root, the two builds).
#
# The comparison runs on the libtorch a user installs today: corpc built against Debian testing's libtorch 2.14, and
# after each split PyTorch 2.14's RPC tutorial and every schedule of its torch.distributed.pipelining, all in the
# root `scripts/root.sh make forky` makes (same kernels, BLAS and oneDNN on both sides). Before it, the same job runs
# on this machine's libtorch 1.13 (corpc alone); its best run per split is a column of the summary. Without root or
# password-less sudo no root can be made: the job then runs on libtorch 1.13 beside PyTorch 1.13's RPC tutorial, and
# says why pipelining is missing.
# Writes the timelines of the last timed step of each 2.14 run as a Chrome trace (pipeline_trace.json; open in
# https://ui.perfetto.dev) and the 8-split ones as a Gantt chart (pipeline_gantt.png); the 1.13 run's own tables go to
# build/pipeline-1.13.md.
# Both sides keep freed memory instead of giving it back to the kernel: corpc by its host cache (on by default), the
# Python side by glibc's tunables (GLIBC_TUNABLES below: large blocks from the heap, not mmap, and no trimming), as
# PyTorch's CPU performance guide advises a caching allocator (jemalloc, TCMalloc). Where page faults are dear, the
# allocator alone moves one process by a third (docs/benchmarks.md, the main job): that is not the pipeline's.
# Extra arguments go to pipeline_bench, in both runs, before the defaults above, so they win (e.g. --tutorial,
# --splits 1,2,4,8, --repeats 5, --num-batches 3, --schedules 1f1b,zbh1, --balance measured; see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
defaults=(--splits 2,4,8 --num-batches 2 --repeats 3)
scripts/setup.sh --pytorch
roots=${CORPC_ROOTS:-/var/tmp/corpc-roots}
forky=
if [[ $(id -u) -eq 0 ]] || sudo -n true 2>/dev/null; then
  [[ -f $roots/forky-cpu/.corpc-stamp ]] ||
    echo "benchmark: making a Debian testing root with libtorch 2.14 and PyTorch 2.14 (scripts/root.sh make forky:" \
      "the first time downloads Debian testing's packages, about 2.1 GB installed under $roots, ~5 min)" >&2
  if scripts/root.sh make forky >&2; then forky=yes; else
    echo "benchmark: could not make the root: the job runs on libtorch 1.13 only" >&2
  fi
else
  echo "benchmark: no root and no password-less sudo to make the libtorch 2.14 root (scripts/root.sh make forky):" \
    "the job runs on libtorch 1.13 only, without torch.distributed.pipelining (PyTorch 1.13 lacks it)" >&2
fi

# Build progress goes to stderr ("[12/87] Compiling ..."), so that stdout stays the benchmark's tables.
echo "benchmark: building corpc on libtorch 1.13 (the first build takes several minutes)" >&2
# scripts/test.sh configures build/ and build-forky/ without benchmarks: turn them on (a no-op when they are).
if [[ -f build/build.ninja ]]; then meson configure build -Dbenchmarks=enabled >&2; else
  meson setup build --buildtype=release >&2
fi
ninja -C build bench/pipeline_bench >&2
if [[ -z $forky ]]; then
  exec build/bench/pipeline_bench --compare-pytorch --pipelining-python off --trace pipeline_trace.json \
    --gantt pipeline_gantt.png "$@" "${defaults[@]}"
fi

echo "benchmark: building corpc on libtorch 2.14, in the root" >&2
scripts/root.sh run forky \
  'if [[ -f build-forky/build.ninja ]]; then meson configure build-forky -Dbenchmarks=enabled; else
     meson setup build-forky --buildtype=release -Dunity=on; fi && ninja -C build-forky bench/pipeline_bench' >&2
echo "benchmark: corpc on libtorch 1.13 (its tables: build/pipeline-1.13.md)" >&2
build/bench/pipeline_bench --results build/pipeline-1.13.txt "$@" --repeats 1 "${defaults[@]}" >build/pipeline-1.13.md
echo "benchmark: corpc on libtorch 2.14 beside PyTorch 2.14" >&2
tunables=glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=4294967296
args=$(printf " %q" "$@" "${defaults[@]}" --pipelining-python "env GLIBC_TUNABLES=$tunables /usr/bin/python3")
exec scripts/root.sh run forky "build-forky/bench/pipeline_bench --compare-pytorch --column build/pipeline-1.13.txt \
  --trace pipeline_trace.json --gantt pipeline_gantt.png$args"
