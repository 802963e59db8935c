#!/usr/bin/env bash
# Sets up, builds and runs the main job: ResNet50 in pipeline stages on two local worker processes (CPU), under every
# schedule (GPipe, 1F1B, Interleaved 1F1B, ZB-H1) and 1/2/4/8 micro-batches, each split followed by PyTorch's RPC
# tutorial on the same split. Writes the timelines of the last timed step of each run as a Chrome trace
# (pipeline_trace.json; open in https://ui.perfetto.dev) and the 8-split ones as a Gantt chart (pipeline_gantt.png).
# Extra arguments go to pipeline_bench (e.g. --tutorial, --splits 1,2,4, --schedules 1f1b,zbh1, --balance tutorial;
# see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --pytorch
scripts/build.sh >/dev/null
exec build/bench/pipeline_bench --compare-pytorch --trace pipeline_trace.json --gantt pipeline_gantt.png "$@"
