#!/usr/bin/env bash
# Installs what building and testing corpc needs on Debian 12; skips what is already there. Idempotent.
#   scripts/setup.sh              build + test dependencies
#   scripts/setup.sh --pytorch    also gnuplot-nox, which draws the pipeline benchmark's Gantt chart
#                                 (scripts/benchmark.sh; python3-torch, for the PyTorch comparisons, is always installed)
set -euo pipefail

packages=(g++ meson ninja-build pkg-config cmake libtorch-dev libgloo-dev libasio-dev libfmt-dev doctest-dev libssl-dev
          # libtorch sends small convolutions through libblas.so.3; Debian's default is the slow reference BLAS.
          libopenblas0-pthread
          # scripts/fuzz.sh: clang and its libFuzzer runtime (the fuzzed decoders need no libtorch).
          clang libclang-rt-14-dev
          # scripts/format.sh: the layout check (.clang-format).
          clang-format-14
          # scripts/docs.sh (meson test docs): the reference docs, which fail on any undocumented public name.
          doxygen
          # The launchers' tests (tests/torchrun.sh, mpirun.sh, slurm.sh): torchrun, Open MPI's mpirun, MPICH's
          # mpiexec (mpirun stays Open MPI's), and the Slurm clusters the test starts (slurmctld, slurmd, munged).
          python3-torch openmpi-bin mpich slurm-wlm munge)
if [[ "${1:-}" == "--pytorch" ]]; then
  packages+=(gnuplot-nox)
fi

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  sudo_cmd=()
  [[ $(id -u) -ne 0 ]] && sudo_cmd=(sudo)
  "${sudo_cmd[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
echo "setup: all dependencies present (BLAS: $(readlink -f /usr/lib/x86_64-linux-gnu/libblas.so.3))"
