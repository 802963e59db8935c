#!/usr/bin/env bash
# Debian roots for the libtorch lines this machine's Debian 12 lacks, made with mmdebstrap from the Debian mirror this
# machine's apt is configured with, and a way to run commands in them with this repository mounted at /corpc.
#   scripts/root.sh make RELEASE [--cuda|--pytorch]       make the root if it is missing or its package list changed
#                                                         (idempotent)
#   scripts/root.sh run RELEASE [--cuda|--pytorch] CMD…   run CMD in the root, in /corpc (the repository), as root
# RELEASE is one of
#   trixie  Debian 13: libtorch 2.6, g++ 14, Meson 1.7 (what Debian's stable users have)
#   forky   Debian testing: libtorch 2.14.1, g++ 16, Meson 1.12 (what a user installing today gets). Its root also
#           holds python3-torch 2.14, so that PyTorch's side of every comparison runs on the same libtorch, BLAS and
#           oneDNN as corpc's. The mirror's forky Release file is past its Valid-Until date: apt is told not to check it.
# The plain trixie root has Debian's CPU libtorch-dev; --cuda makes a second trixie root with libtorch-cuda-dev
# (contrib, built on CUDA 12.4 from non-free: about 2.3 GB installed), for compiling and linking corpc's CUDA path
# without a GPU. The two cannot share a root: libtorch-cuda-dev conflicts with libtorch-dev. --pytorch makes a third
# trixie root, with Debian's python3-torch 2.6 (CPU) and no compiler, for the 2.6 comparisons.
# Roots live under $CORPC_ROOTS (default /var/tmp/corpc-roots), outside any clone, so that later runs on the same
# machine reuse them. Needs root (mmdebstrap's chroot mode, mounts in a private mount namespace).
# CORPC_MMDEBSTRAP_QUIET= (set, empty) shows mmdebstrap's own output: why a package set cannot be installed.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ $(id -u) -ne 0 ]]; then exec sudo -E "$0" "$@"; fi
repo=$PWD
roots=${CORPC_ROOTS:-/var/tmp/corpc-roots}

usage() { echo "usage: scripts/root.sh make|run trixie|forky [--cuda|--pytorch] [command…]"; exit 2; }
verb=${1:-}; release=${2:-}; shift 2 || usage
[[ $release == trixie || $release == forky ]] || usage
flavour=cpu
case ${1:-} in
  --cuda) flavour=cuda; shift ;;
  --pytorch) flavour=pytorch; shift ;;
esac
[[ $release == forky && $flavour != cpu ]] && { echo "root: forky has one root (libtorch and python3-torch)"; exit 2; }
root=$roots/$release-$flavour

common=(build-essential meson ninja-build pkg-config cmake git python3 ca-certificates
        libasio-dev libfmt-dev doctest-dev libssl-dev libopenblas0-pthread)
aptopts=()
if [[ $release == forky ]]; then
  # python3-torch: the PyTorch 2.14 peers (bench/pytorch_*.py) and torchrun; procps for ps/kill when a run hangs;
  # gnuplot-nox draws the pipeline benchmark's Gantt chart.
  packages=("${common[@]}" libtorch-dev libgloo-dev iproute2 python3-torch python3-numpy procps gnuplot-nox)
  components="main"
  aptopts=(--aptopt='Acquire::Check-Valid-Until "false"')
elif [[ $flavour == cpu ]]; then
  # iproute2: test_multihost's network namespaces; python3-torch: torchrun (tests/torchrun.sh, test_ddp's torchrun
  # cases), 44 MB more to fetch, about 30 s more to make the root.
  packages=("${common[@]}" libtorch-dev libgloo-dev iproute2 python3-torch)
  components="main"
elif [[ $flavour == pytorch ]]; then
  # Python only: the interpreter, torch, numpy; OpenBLAS as in the CPU root (python3-torch pulls in the reference BLAS,
  # several times slower for the Linear layer and what oneDNN leaves to BLAS); procps for ps/kill when a run hangs.
  packages=(python3 python3-torch python3-numpy libopenblas0-pthread ca-certificates procps)
  components="main"
else
  # libtorch-cuda-2.6 depends on nvidia-cudnn, an installer that downloads cuDNN from NVIDIA's servers at install
  # time, which cannot be reached from here. A placeholder package of that name stands in for it: this root compiles
  # and links corpc against libtorch_cuda (linking with --allow-shlib-undefined for libtorch's own cuDNN symbols, see
  # scripts/cuda_build.sh); it never runs CUDA code.
  packages=("${common[@]}" libtorch-cuda-dev libgloo-cuda-dev nvidia-cuda-dev)  # nvidia-cuda-dev: cudart headers
  components="main contrib non-free"
fi
stamp="$release $components: ${packages[*]##*/}"

mirror() {  # the URI of the Debian archive apt uses here (deb822 or one-line sources)
  local uri
  uri=$(grep -hE '^URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '{print $2}' | grep -v security | head -1 || true)
  [[ -z $uri ]] && uri=$(grep -hE '^deb ' /etc/apt/sources.list 2>/dev/null | awk '{print $2}' | grep -v security | head -1 || true)
  echo "${uri:-http://deb.debian.org/debian}"
}

make_root() {
  if [[ -f $root/.corpc-stamp && "$(cat "$root/.corpc-stamp")" == "$stamp" ]]; then
    echo "root: reusing $root"
    return
  fi
  if ! command -v mmdebstrap >/dev/null; then
    echo "root: installing mmdebstrap"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends mmdebstrap >/dev/null
  fi
  local uri
  uri=$(mirror)
  echo "root: making $root from $uri ($components; $(date +%T))"
  rm -rf "$root.tmp"
  mkdir -p "$roots"
  if [[ $flavour == cuda ]]; then
    local pkg=$roots/nvidia-cudnn-placeholder
    mkdir -p "$pkg/DEBIAN"
    printf '%s\n' 'Package: nvidia-cudnn' 'Version: 9.0.0.312~cuda12+corpc' 'Architecture: amd64' \
      'Maintainer: corpc <corpc@localhost>' 'Description: placeholder for the cuDNN downloader (no cuDNN inside)' \
      >"$pkg/DEBIAN/control"
    dpkg-deb --build "$pkg" "$pkg.deb" >/dev/null
  fi
  local include hooks=()
  include=$(IFS=,; echo "${packages[*]}")
  if [[ $flavour == cuda ]]; then
    # The placeholder goes in first, from inside the root (mmdebstrap resolves .deb paths there), then the rest.
    include=$(IFS=,; echo "${common[*]}")
    hooks=(--customize-hook="copy-in $roots/nvidia-cudnn-placeholder.deb /tmp"
           --customize-hook="chroot \"\$1\" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends /tmp/nvidia-cudnn-placeholder.deb ${packages[*]:${#common[@]}}")
  fi
  mmdebstrap ${CORPC_MMDEBSTRAP_QUIET---quiet} --variant=apt --components="${components// /,}" --include="$include" \
    --aptopt='APT::Install-Recommends "false"' "${aptopts[@]}" "${hooks[@]}" "$release" "$root.tmp" "$uri"
  echo "$stamp" >"$root.tmp/.corpc-stamp"
  rm -rf "$root"
  mv "$root.tmp" "$root"
  echo "root: $root ready ($(date +%T), $(du -sh "$root" | cut -f1))"
}

run_in_root() {
  local option=""
  [[ $flavour == cpu ]] || option=" --$flavour"
  [[ -f $root/.corpc-stamp ]] || { echo "root: no root at $root (scripts/root.sh make $release$option)"; exit 2; }
  mkdir -p "$root/corpc"
  # A private mount namespace: the mounts vanish with the command, whatever way it ends. The network namespace is
  # the host's, so 127.0.0.1 is the same loopback.
  unshare --mount --propagation private -- bash -c '
    set -e
    root=$1; repo=$2; shift 2
    mount --bind "$root" "$root"  # "/" inside is a mount point: `ip -n` makes it a slave mount there
    mount -t proc proc "$root/proc"
    mount --rbind /dev "$root/dev"
    mount --rbind /sys "$root/sys"
    mount -t tmpfs tmpfs "$root/tmp"
    mount --bind "$repo" "$root/corpc"
    [[ -d /run/netns ]] && mkdir -p "$root/run/netns" && mount --rbind /run/netns "$root/run/netns"
    exec chroot "$root" /usr/bin/env -i HOME=/root PATH=/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin LANG=C.UTF-8 \
      CI="${CI:-}" CORPC_TEST_TIME_SCALE="${CORPC_TEST_TIME_SCALE:-}" CORPC_SUITE_TESTS="${CORPC_SUITE_TESTS:-}" \
      CORPC_SUITE_SKIP="${CORPC_SUITE_SKIP:-}" CORPC_SUITE_EXCLUDE="${CORPC_SUITE_EXCLUDE:-}" bash -c "cd /corpc && $*"
  ' bash "$root" "$repo" "$@"
}

case $verb in
  make) make_root ;;
  run) run_in_root "$@" ;;
  *) usage ;;
esac
