#!/usr/bin/env bash
# Compiles and links corpc's CUDA path against a real CUDA build of libtorch, without a GPU: Debian 13's
# libtorch-cuda-dev 2.6 (CUDA 12.4) in the root that `scripts/root.sh make trixie --cuda` makes (about 2.3 GB; kept
# outside CI for that download). Builds, in build-cuda/ with -Dcuda=enabled, both libraries and every program that
# carries CUDA tensors — the tests of device maps and of CUDA (test_device_map, test_cuda), the CUDA echo and
# pipeline benchmarks, an example — so that the CUDA path (c10::cuda streams, the caching allocator, CUDA IPC) is
# compiled by g++ 14 against libtorch 2.6's CUDA headers and linked against libtorch_cuda, libc10_cuda and libcudart.
# Nothing is run: there is no GPU here (scripts/gpu_check.sh runs it on one).
#   scripts/cuda_build.sh            make/reuse the root, configure once, build; log in build-cuda/cuda_build.log
#   scripts/cuda_build.sh --all      every target of the tree
# Linking uses --allow-shlib-undefined: the root has a placeholder for Debian's nvidia-cudnn (an installer that
# downloads cuDNN from NVIDIA, out of reach here), so libtorch_cuda's own cuDNN symbols stay unresolved; every symbol
# that corpc itself references is still resolved against the real libraries.
set -euo pipefail
cd "$(dirname "$0")/.."
targets="libcorpc.a libcorpc_ddp.a tests/test_data bench/cuda_echo bench/pipeline_bench examples/rpc_hello"
[[ "${1:-}" == "--all" ]] && targets=""
scripts/root.sh make trixie --cuda
mkdir -p build-cuda
scripts/root.sh run trixie --cuda '
  set -euo pipefail
  if [[ ! -f build-cuda/build.ninja ]]; then
    meson setup build-cuda --buildtype=release -Dcuda=enabled -Dcpp_link_args=-Wl,--allow-shlib-undefined
  fi
  meson introspect build-cuda --buildoptions | python3 -c "import json,sys; print(\"cuda:\", [o[\"value\"] for o in json.load(sys.stdin) if o[\"name\"] == \"cuda\"][0])"
  grep -E "CUDA data path" build-cuda/meson-logs/meson-log.txt | tail -1
  ninja -C build-cuda '"$targets"'
' 2>&1 | tee build-cuda/cuda_build.log
status=${PIPESTATUS[0]}
if [[ $status -eq 0 ]]; then
  versions=$(scripts/root.sh run trixie --cuda "dpkg-query -W -f '\${Package} \${Version}; ' libtorch-cuda-dev nvidia-cuda-dev g++")
  echo "cuda build: compiled and linked against ${versions% }"
fi
exit "$status"
