#!/usr/bin/env bash
# The GPU check in one command: builds corpc against the CUDA libtorch of a PyTorch wheel (<site-packages>/torch/
# {include,lib}) and runs, on one GPU:
#   (a) tests/test_device_map and tests/test_cuda: CUDA tensors between two processes sharing cuda:0 through device
#       maps (calls, remote()/to_here(), RemoteModule, distributed autograd), each compared with the CPU's result;
#       test_cuda twice: as corpc chooses (CUDA IPC between the two processes) and with CORPC_CUDA_IPC=0 (staged
#       through host memory);
#   (b)+(c) CUDA echo, 1/16/64 MiB device to device between two processes on the GPU: corpc (bench/cuda_echo, both
#       data paths) and PyTorch's RPC with device maps (bench/pytorch_cuda_rpc.py, TensorPipe's own choice and its
#       staged channel), alternating round by round;
#   (d) the pipeline benchmark with every stage on cuda:0 (bench/pipeline_bench --device cuda:0), PyTorch's
#       pipeline (bench/pytorch_pipeline.py --device cuda:0, the RPC tutorial) after each split.
# and writes a markdown table of the results (default <build dir>/gpu_check.md), printed at the end too, with the
# GPU, driver, CUDA and torch versions.
#
#   scripts/gpu_check.sh [options] [TORCH]
#     TORCH             a Python environment's root (bin/python inside) or the site-packages folder that holds
#                       torch/; default /opt/torch/.venv (the GPU machines' PyTorch 2.11 + CUDA 13)
#     --quick           build and run the tests (a) only
#     --build-only      configure and build, run nothing: needs no GPU and takes a CPU libtorch too (checks the
#                       recipe where there is no GPU; the binaries then say there is none)
#     --no-build        use the build folder as it is
#     --build-dir DIR   default build-gpu
#     --jobs N          ninja's parallel jobs (default: ninja's own choice)
#     --out FILE        the results table; default <build dir>/gpu_check.md
#     --rounds N        echo rounds, corpc and PyTorch alternating (default 3); --iters N timed round trips per size
#                       and round (default 20) after --warmup N (default 3); --sizes-mib 1,16,64
#     --pipeline-args "ARGS"   pipeline_bench's arguments besides --device/--compare-pytorch/--python
#                       (default "--tutorial --num-batches 5 --warmup 2 --balance time")
#     --skip-tests, --skip-echo, --skip-pipeline   leave (a), (b)+(c) or (d) out
#
# The GPU machines have the wheel, a compiler, CMake, Meson and ninja, and no package registry: what corpc needs
# beyond the wheel (Asio, fmt, doctest, OpenSSL; pkgconf for a machine without pkg-config) comes in .gpu-carry/,
# made by scripts/gpu_carry.sh on a Debian machine and carried with the working tree. Nothing is downloaded.
# Through the device tool, a command runs for 10 minutes at most: run --quick first (build and tests), then the
# benchmarks with --no-build --skip-tests in a second call while the machine is still warm (it keeps build-gpu/
# between calls then), e.g.
#   run(command: "scripts/gpu_check.sh --quick --out $OUT/tests.md", carry: [".gpu-carry"])
#   run(command: "scripts/gpu_check.sh --no-build --skip-tests --out $OUT/bench.md", carry: [".gpu-carry"])
# Exit status: 0 when everything ran and passed, 1 when a test or benchmark failed (the table says which), 2 when
# the check could not start (no wheel, no GPU, no carry folder, no toolkit: one line says which).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD

die() { echo "gpu_check: $*" >&2; exit 2; }

torch_arg=/opt/torch/.venv
quick=0 build_only=0 no_build=0 skip_tests=0 skip_echo=0 skip_pipeline=0
build_dir=build-gpu out="" jobs=()
rounds=3 iters=20 warmup=3 sizes=1,16,64
pipeline_args="--tutorial --num-batches 5 --warmup 2 --balance time"
while (($#)); do
  case $1 in
    --quick) quick=1 ;;
    --build-only) build_only=1 ;;
    --no-build) no_build=1 ;;
    --skip-tests) skip_tests=1 ;;
    --skip-echo) skip_echo=1 ;;
    --skip-pipeline) skip_pipeline=1 ;;
    --build-dir) build_dir=${2:?}; shift ;;
    --jobs) jobs=(-j "${2:?}"); shift ;;
    --out) out=${2:?}; shift ;;
    --rounds) rounds=${2:?}; shift ;;
    --iters) iters=${2:?}; shift ;;
    --warmup) warmup=${2:?}; shift ;;
    --sizes-mib) sizes=${2:?}; shift ;;
    --pipeline-args) pipeline_args=${2?}; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    -*) die "unknown option $1 (--help lists them)" ;;
    *) torch_arg=$1 ;;
  esac
  shift
done
[[ $build_dir = /* ]] || build_dir=$repo/$build_dir
out=${out:-$build_dir/gpu_check.md}
logs=$build_dir/gpu_check-logs

# ---- the wheel ------------------------------------------------------------------------------------------------------
python=""
if [[ -d $torch_arg/torch/include && -d $torch_arg/torch/lib ]]; then
  site=$(cd "$torch_arg" && pwd)
  # A virtual environment's site-packages is <env>/lib/pythonX.Y/site-packages: its interpreter is <env>/bin/python.
  for p in "$site/../../../bin/python" "$site/../../../bin/python3"; do
    [[ -x $p ]] && { python=$(cd "$(dirname "$p")" && pwd)/$(basename "$p"); break; }
  done
elif [[ -x $torch_arg/bin/python ]]; then
  python=$torch_arg/bin/python
  site=$(timeout 120 "$python" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))' 2>/dev/null) \
    || die "$python cannot import torch"
  [[ -d $site/torch/include && -d $site/torch/lib ]] \
    || die "the torch that $python imports ($site/torch) has no include/ and lib/: not a wheel's layout"
else
  die "no PyTorch at $torch_arg: give a Python environment (bin/python) or a site-packages folder holding torch/include and torch/lib"
fi
torch_dir=$site/torch
cuda_libtorch=0
[[ -e $torch_dir/lib/libtorch_cuda.so && -e $torch_dir/lib/libc10_cuda.so ]] && cuda_libtorch=1
if ((!cuda_libtorch && !build_only)); then
  die "the libtorch in $torch_dir is a CPU build (no lib/libtorch_cuda.so, lib/libc10_cuda.so): the GPU check needs PyTorch's CUDA wheel"
fi
# The environment's bin holds meson, ninja and cmake from pip. Only an interpreter that imports this very torch gives
# its facts and runs PyTorch's side; without one (a bare libtorch), they are left out.
env_bin=""
if [[ -n $python ]]; then env_bin=$(dirname "$python"); fi
if [[ -n $python ]]; then
  imported=$(timeout 120 "$python" -c 'import os, torch; print(os.path.realpath(os.path.dirname(torch.__file__)))' 2>/dev/null || true)
  [[ $imported == "$(readlink -f "$torch_dir")" ]] || python=""
fi

# ---- the GPU --------------------------------------------------------------------------------------------------------
smi=""
for c in nvidia-smi /usr/local/nvidia/bin/nvidia-smi /usr/bin/nvidia-smi; do
  if command -v "$c" >/dev/null; then smi=$(command -v "$c"); break; fi
done
if ((!build_only)); then
  [[ -n $smi ]] || die "no nvidia-smi here: no NVIDIA driver, so no GPU to check on (--build-only builds without one)"
  gpus=$(timeout 60 "$smi" -L 2>&1) || die "nvidia-smi found no GPU: ${gpus//$'\n'/ }"
  grep -q '^GPU ' <<<"$gpus" || die "nvidia-smi lists no GPU: ${gpus//$'\n'/ }"
fi

# ---- what comes with the working tree -------------------------------------------------------------------------------
carry=$repo/.gpu-carry
[[ -f $carry/MANIFEST && -d $carry/pkgconfig ]] \
  || die "no $carry: make it with scripts/gpu_carry.sh on a Debian machine with libasio-dev, libfmt-dev, doctest-dev and libssl-dev, and carry it with the tree (device tool: carry [\".gpu-carry\"])"

# ---- tools ----------------------------------------------------------------------------------------------------------
if [[ -n $env_bin ]]; then PATH=$env_bin:$PATH; fi
cxx=""
for c in "${CXX:-}" c++ g++ clang++; do
  if [[ -n $c ]] && command -v "$c" >/dev/null; then cxx=$c; break; fi
done
[[ -n $cxx ]] || die "no C++ compiler on PATH (c++, g++, clang++; or set CXX)"
export CXX=$cxx
command -v meson >/dev/null || die "no meson on PATH${env_bin:+ nor in $env_bin}"
command -v ninja >/dev/null || die "no ninja on PATH${env_bin:+ nor in $env_bin}"
if ! command -v pkg-config >/dev/null; then
  PATH=$carry/pkgconf/bin:$PATH  # Debian's pkgconf, carried
  pkg-config --version >/dev/null 2>&1 || die "no pkg-config here, and the carried one does not run"
fi
export PATH

# The CUDA toolkit: headers and an unversioned libcudart (the wheel's nvidia/cuda_runtime has only libcudart.so.13).
toolkit_ok() { [[ -f $1/include/cuda_runtime_api.h ]] && compgen -G "$1/lib*/libcudart.so" >/dev/null; }
cuda_home=""
tried=()
nvcc=$(command -v nvcc || true)
for dir in "${CUDA_HOME:-}" "${CUDA_PATH:-}" "${nvcc:+$(dirname "$(dirname "$(readlink -f "$nvcc")")")}" /usr/local/cuda; do
  [[ -z $dir ]] && continue
  tried+=("$dir")
  if toolkit_ok "$dir"; then cuda_home=$(readlink -f "$dir"); break; fi
done
[[ -n $cuda_home ]] || die "no CUDA toolkit (include/cuda_runtime_api.h, lib64/libcudart.so) in: ${tried[*]:-nothing to try (no nvcc on PATH, no CUDA_HOME)}"
if [[ -z $nvcc && -x $cuda_home/bin/nvcc ]]; then nvcc=$cuda_home/bin/nvcc; fi

mkdir -p "$build_dir" "$logs"

# ---- facts ----------------------------------------------------------------------------------------------------------
fact_lines=()
fact() { fact_lines+=("- $1"); }
fact "date: $(date -u '+%Y-%m-%d %H:%M UTC'); host: $(uname -n), $(uname -r); $(nproc) cores"
fact "corpc: $(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo '?')$(git -C "$repo" diff --quiet HEAD 2>/dev/null || echo ' + local changes')"
if ((!build_only)); then
  q=$(timeout 60 "$smi" --query-gpu=name,driver_version,memory.total,compute_mode --format=csv,noheader 2>/dev/null | head -1 || true)
  smi_cuda=$(timeout 60 "$smi" 2>/dev/null | grep -o 'CUDA Version: *[0-9.]*' | head -1 | sed 's/.*: *//' || true)
  fact "GPU: ${q:-?} (name, driver, memory, compute mode); CUDA version the driver supports: ${smi_cuda:-?}; GPUs: $(grep -c '^GPU ' <<<"$gpus")"
fi
abi=""
if [[ -n $python ]]; then
  torch_facts=$(timeout 120 "$python" -c 'import sys, torch
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}), Python {sys.version.split()[0]}")
print(int(torch.compiled_with_cxx11_abi()))' 2>/dev/null) || torch_facts=""
  if [[ -n $torch_facts ]]; then
    fact "$(head -1 <<<"$torch_facts") at $torch_dir"
    abi=$(tail -1 <<<"$torch_facts")
  fi
else
  fact "libtorch at $torch_dir (no Python imports it: version unknown)"
fi
toolkit_version=$(grep -o '"version" *: *"[0-9.]*"' "$cuda_home/version.json" 2>/dev/null | head -1 | grep -o '[0-9][0-9.]*' || true)
if [[ -z $toolkit_version && -n $nvcc ]]; then
  toolkit_version=$("$nvcc" --version 2>/dev/null | grep -o 'release [0-9.]*' | grep -o '[0-9][0-9.]*' || true)
fi
fact "CUDA toolkit: $cuda_home (${toolkit_version:-version unknown})"
torch_cuda_version=$(sed -n 's/.*(CUDA \([0-9.]*\),.*/\1/p' <<<"${torch_facts:-}" | head -1)
if [[ -n $toolkit_version && -n $torch_cuda_version && ${toolkit_version%%.*} != "${torch_cuda_version%%.*}" ]]; then
  fact "**warning**: corpc links the toolkit's libcudart $toolkit_version, torch its own $torch_cuda_version: two CUDA runtimes in one process"
fi
fact "compiler: $("$cxx" --version | head -1); meson $(meson --version); ninja $(ninja --version); pkg-config: $(command -v pkg-config)"
fact "carried: $(grep -v '^#' "$carry/MANIFEST" | tr '\n' ';' | sed 's/;$//; s/;/; /g')"

# ---- configure and build --------------------------------------------------------------------------------------------
targets=(tests/test_data bench/cuda_echo bench/pipeline_bench)  # test_data holds test_device_map.cpp and test_cuda.cpp
if ((!no_build)); then
  cpp_args=("-isystem$carry/include")
  if [[ -n $abi ]]; then cpp_args+=("-D_GLIBCXX_USE_CXX11_ABI=$abi"); fi
  # libtorch_cuda needs the wheel's nvidia/*/lib libraries (it finds them at run time through its own RUNPATH): the
  # linker is shown where they are, and does not fail on symbols inside the wheel's libraries it cannot check.
  link_args=("-Wl,-rpath-link,$torch_dir/lib")
  for d in "$site"/nvidia/*/lib; do
    if [[ -d $d ]]; then link_args+=("-Wl,-rpath-link,$d"); fi
  done
  link_args+=("-Wl,--allow-shlib-undefined")
  list() { local s="" a; for a in "$@"; do s+="${s:+,}'$a'"; done; echo "[$s]"; }
  setup=(--buildtype=release --wrap-mode=nodownload
         "-Dlibtorch_dir=$torch_dir" -Dcuda=enabled "-Dcudatoolkit_dir=$cuda_home"
         -Dtests=enabled -Dbenchmarks=enabled -Dexamples=enabled
         "-Dpkg_config_path=$carry/pkgconfig"
         "-Dcpp_args=$(list "${cpp_args[@]}")" "-Dcpp_link_args=$(list "${link_args[@]}")")
  if [[ -f $build_dir/build.ninja ]]; then setup=(--reconfigure "${setup[@]}"); fi
  echo "gpu_check: configuring $build_dir (log: $logs/configure.log)"
  PKG_CONFIG_PATH=$carry/pkgconfig timeout 600 meson setup "$build_dir" "${setup[@]}" >"$logs/configure.log" 2>&1 \
    || { tail -30 "$logs/configure.log" >&2; die "meson setup failed (whole log: $logs/configure.log)"; }
  echo "gpu_check: building ${targets[*]} (log: $logs/build.log)"
  timeout 1800 ninja -C "$build_dir" "${jobs[@]}" "${targets[@]}" >"$logs/build.log" 2>&1 \
    || { tail -40 "$logs/build.log" >&2; die "the build failed (whole log: $logs/build.log)"; }
fi
for t in "${targets[@]}"; do [[ -x $build_dir/$t ]] || die "$build_dir/$t is missing (build without --no-build)"; done
cuda_path=$(grep -h 'CUDA data path' "$logs/configure.log" 2>/dev/null | tail -1 | sed 's/^ *//; s/  */ /g' || true)
fact "build: $build_dir, ${cuda_path:-CUDA data path: see $build_dir/meson-logs}"

failures=0
report() {
  {
    echo "# corpc GPU check"
    echo
    printf '%s\n' "${fact_lines[@]}"
    for section in "${sections[@]}"; do echo; printf '%s\n' "$section"; done
  } >"$out"
  echo
  cat "$out"
  echo
  echo "gpu_check: results in $out, logs in $logs"
}
sections=()

if ((build_only)); then
  sections+=("Built only (--build-only): nothing was run.")
  report
  exit 0
fi

timed_out() { if (($1 == 124 || $1 == 137)); then echo ", timed out"; fi; }

# ---- (a) tests ------------------------------------------------------------------------------------------------------
# The file's summary line (tests/main.cpp): "[corpc] test_cuda.cpp: test cases: 8 | 7 passed | 1 failed | 0 skipped".
if ((!skip_tests)); then
  table="## (a) Tests: device maps with a real device (two processes sharing cuda:0)"$'\n\n'
  table+="| binary | status | test cases passed | failed | skipped | seconds |"$'\n'"|---|---|---:|---:|---:|---:|"$'\n'
  failed_cases=""
  for run in test_device_map test_cuda test_cuda:CORPC_CUDA_IPC=0; do
    t=${run%%:*} env_set=()
    name=$t log=$logs/$t.log
    if [[ $run == *:* ]]; then
      env_set=("${run#*:}") name="$t (${run#*:})" log=$logs/$t.${run#*:}.log
    fi
    echo "gpu_check: (a) $name"
    start=$SECONDS
    set +e
    env "${env_set[@]}" CORPC_TEST_FILE="$t.cpp" timeout -k 10 600 "$build_dir/tests/test_data" --source-file="*/$t.cpp" \
      >"$log" 2>&1
    rc=$?
    set -e
    summary=$(grep -a '^\[corpc\] .*test cases:' "$log" | tail -1 || true)  # this file's cases (tests/main.cpp)
    num() { grep -o "[0-9]* $1" <<<"$summary" | grep -o '^[0-9]*' || echo '?'; }
    status=passed
    if ((rc != 0)); then status="failed (exit $rc$(timed_out $rc))"; failures=$((failures + 1)); fi
    table+="| $name | $status | $(num passed) | $(num failed) | $(num skipped) | $((SECONDS - start)) |"$'\n'
    while IFS= read -r c; do
      failed_cases+="- $name: ${c#*TEST CASE: }"$'\n'
    done < <(grep -a 'TEST CASE:' "$log" | sed 's/  */ /g' | sort -u)
  done
  if [[ -n $failed_cases ]]; then table+=$'\n'"Failed cases (logs in $logs):"$'\n'"$failed_cases"; fi
  sections+=("$table")
fi

if ((quick)); then
  sections+=("Benchmarks left out (--quick).")
  report
  exit $((failures ? 1 : 0))
fi

# ---- (b)+(c) CUDA echo, corpc and PyTorch alternating ---------------------------------------------------------------
if ((!skip_echo)); then
  declare -A results=()   # "<implementation> <MiB>" -> the medians of the rounds, space-separated
  declare -A not_run=()   # implementation -> why
  impls=(corpc corpc-staged pytorch-default pytorch-staged)
  collect() {  # RESULT lines of one run's log
    local kind impl mib median rest
    while read -r kind impl mib median rest; do
      if [[ $kind == RESULT ]]; then results["$impl $mib"]+="$median "
      elif [[ $kind == RESULT-NA ]]; then not_run[$impl]="$mib $median $rest"; fi
    done < <(grep -a -E '^RESULT(-NA)? ' "$1" || true)
  }
  echo_failures=""
  for ((r = 1; r <= rounds; r++)); do
    for label in corpc corpc-staged; do
      echo "gpu_check: (b) $label CUDA echo, round $r/$rounds"
      ipc=()
      if [[ $label == corpc-staged ]]; then ipc=(CORPC_CUDA_IPC=0); fi
      if ! env "${ipc[@]}" timeout -k 10 600 "$build_dir/bench/cuda_echo" --label "$label" --sizes-mib "$sizes" \
          --iters "$iters" --warmup "$warmup" >"$logs/$label.$r.log" 2>&1; then
        echo_failures+="- cuda_echo --label $label round $r: $(tail -1 "$logs/$label.$r.log")"$'\n'
      fi
      collect "$logs/$label.$r.log"
    done
    if [[ -n $python ]]; then
      echo "gpu_check: (c) PyTorch RPC CUDA echo, round $r/$rounds"
      if ! PYTHONUNBUFFERED=1 timeout -k 10 900 "$python" bench/pytorch_cuda_rpc.py --sizes-mib "$sizes" --iters "$iters" \
          --warmup "$warmup" --timeout 400 >"$logs/pytorch_cuda_rpc.$r.log" 2>&1; then
        echo_failures+="- pytorch_cuda_rpc.py round $r: $(grep -a -v '^RESULT' "$logs/pytorch_cuda_rpc.$r.log" | tail -1 || true)"$'\n'
      fi
      collect "$logs/pytorch_cuda_rpc.$r.log"
    fi
  done
  median() { tr -s ' ' '\n' | sed '/^$/d' | sort -g | awk '{v[NR]=$1} END {if (NR) printf "%.3f\n", NR % 2 ? v[(NR+1)/2] : (v[NR/2]+v[NR/2+1])/2}'; }
  table="## (b)+(c) CUDA echo between two processes on one GPU"$'\n\n'
  table+="Round trip of a float32 tensor on cuda:0, master -> worker1 -> master, device maps cuda:0 -> cuda:0, ended by a "
  table+="device synchronize; each cell is the median over $rounds rounds of the median of $iters round trips (after $warmup "
  table+="warm-up), in ms, corpc and PyTorch alternating round by round. corpc: \`default\` = its own choice (CUDA IPC "
  table+="between two workers on one host when both can), \`staged\` = CORPC_CUDA_IPC=0 (through pinned host memory). "
  table+="PyTorch: torch.distributed.rpc, TensorPipe, \`default\` = the channels TensorPipe picks on one host, "
  table+="\`staged\` = its cuda_basic channel only (through host memory). Ratios: PyTorch's time over corpc's, same "
  table+="kind of path (> 1: corpc is faster)."$'\n\n'
  table+="| MiB | corpc default (ms) | corpc staged (ms) | PyTorch default (ms) | PyTorch staged (ms) | corpc default GB/s | "
  table+="PyTorch / corpc, default | PyTorch / corpc, staged |"$'\n'
  table+="|---:|---:|---:|---:|---:|---:|---:|---:|"$'\n'
  IFS=, read -ra size_list <<<"$sizes"
  for mib in "${size_list[@]}"; do
    c=$(median <<<"${results[corpc $mib]:-}")
    cs=$(median <<<"${results[corpc-staged $mib]:-}")
    d=$(median <<<"${results[pytorch-default $mib]:-}")
    s=$(median <<<"${results[pytorch-staged $mib]:-}")
    ratio() { if [[ -n $1 && -n $2 ]]; then awk -v a="$1" -v b="$2" 'BEGIN {printf "%.2f", a / b}'; else echo "n/a"; fi; }
    gbps=n/a
    if [[ -n $c ]]; then gbps=$(awk -v m="$mib" -v t="$c" 'BEGIN {printf "%.2f", 2 * m * 1048576 / (t * 1e6)}'); fi
    table+="| $mib | ${c:-n/a} | ${cs:-n/a} | ${d:-n/a} | ${s:-n/a} | $gbps | $(ratio "$d" "$c") | $(ratio "$s" "$cs") |"$'\n'
  done
  table+=$'\n'"Per round (ms):"$'\n'
  for impl in "${impls[@]}"; do
    for mib in "${size_list[@]}"; do
      if [[ -n ${results[$impl $mib]:-} ]]; then table+="- $impl $mib MiB: ${results[$impl $mib]% }"$'\n'; fi
    done
    if [[ -n ${not_run[$impl]:-} ]]; then table+="- $impl did not run: ${not_run[$impl]}"$'\n'; fi
  done
  if [[ -z $python ]]; then table+="- PyTorch's side did not run: no Python here imports this torch"$'\n'; fi
  if [[ -n $echo_failures ]]; then
    table+=$'\n'"Failures:"$'\n'"$echo_failures"
    failures=$((failures + 1))
fi
if [[ -z ${results[corpc ${size_list[0]}]:-} ]]; then failures=$((failures + 1)); fi
sections+=("$table")
fi

# ---- (d) the pipeline with stages on cuda:0 -------------------------------------------------------------------------
if ((!skip_pipeline)); then
  echo "gpu_check: (d) pipeline_bench --device cuda:0 $pipeline_args (PyTorch's pipeline after each split)"
  compare=()
  if [[ -n $python ]]; then compare=(--compare-pytorch --python "$python" --pytorch-script bench/pytorch_pipeline.py); fi
  set +e
  # shellcheck disable=SC2086  # pipeline_args is a list of words
  PYTHONUNBUFFERED=1 timeout -k 10 1800 "$build_dir/bench/pipeline_bench" --device cuda:0 "${compare[@]}" $pipeline_args \
    >"$logs/pipeline_bench.log" 2>"$logs/pipeline_bench.err"
  rc=$?
  set -e
  table="## (d) Pipeline: ResNet50 in stages, every stage on cuda:0"$'\n\n'
  table+="\`pipeline_bench --device cuda:0 $pipeline_args\`. corpc: stages on two worker processes sharing cuda:0, "
  table+="activations and gradients between them through device maps (corpc RPC, TCP + same-host channel). PyTorch: "
  table+="\`bench/pytorch_pipeline.py --device cuda:0\`, the RPC tutorial's two shards on cuda:0 with distributed "
  table+="autograd, tensors crossing torch.distributed.rpc (TensorPipe) on the CPU. No c10d process group (NCCL or "
  table+="Gloo) is used on either side."$'\n\n'
  if ((rc == 0)); then
    table+=$(grep -a -v '^# cores' "$logs/pipeline_bench.log" || true)$'\n'
  else
    table+="pipeline_bench failed (exit $rc$(timed_out $rc)): $(tail -3 "$logs/pipeline_bench.err" | tr '\n' ' ')"$'\n'
    failures=$((failures + 1))
  fi
  if grep -qE '\| nan \|' "$logs/pipeline_bench.log" 2>/dev/null; then
    table+=$'\n'"PyTorch's column is nan where its run failed: its output is in $logs/pipeline_bench.err ([pytorch] lines)."$'\n'
  fi
  sections+=("$table")
fi

report
exit $((failures ? 1 : 0))
