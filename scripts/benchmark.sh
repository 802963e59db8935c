#!/usr/bin/env bash
# Sets up, builds and runs the main job: the pipeline split-size benchmark (ResNet50 in two shards on two local
# worker processes, CPU), followed by the same configuration through PyTorch's torch.distributed.rpc.
# Extra arguments go to pipeline_bench (e.g. --tutorial, --splits 1,2,4, --schedule 1f1b; see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --pytorch
scripts/build.sh >/dev/null
exec build/bench/pipeline_bench --compare-pytorch "$@"
