#!/usr/bin/env bash
# Installs mgpu's build prerequisites from Debian/Ubuntu packages when any is missing.
# Runs apt-get as root (directly, or through sudo). Safe to run again: it installs nothing twice.
#   scripts/setup.sh          install what is missing
#   scripts/setup.sh --list   print the packages, one a line (scripts/check-deps.sh reads them)
# Packages are installed without their Recommends, so every package the build reads from must be
# named here or be a Depends of one named here: scripts/check-deps.sh fails CI otherwise.
set -euo pipefail

packages=(cmake ninja-build g++ libeigen3-dev libxxhash-dev catch2 libbenchmark-dev libcli11-dev
  libdnnl-dev ocl-icd-opencl-dev  # oneDNN's CMake package finds OpenCL (a Recommends of libdnnl-dev)
  nlohmann-json3-dev  # tests read trace JSON back
  python3 python3-venv  # scripts' checks (standard library) and their own venvs (scripts/venv.sh)
  openmpi-bin libopenmpi-dev  # mgpu::dist across processes (MGPU_WITH_MPI), its mpirun tests, a baseline of bench_collectives
  libgloo-dev  # a baseline of bench_collectives
  iproute2  # the test across network namespaces (tests/dist/netns.sh)
  libglpk-dev  # GLPK: the cluster simulator's offline bound (src/cluster/bound.cpp), a linear/integer program
  clang-14 libclang-rt-14-dev)  # the second compiler in CI, and libFuzzer (scripts/fuzz.sh)
if [ "${1:-}" = --list ]; then
  printf '%s\n' "${packages[@]}"
  exit 0
fi
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0

echo "mgpu setup: installing ${missing[*]}" >&2
as_root=()
[ "$(id -u)" -eq 0 ] || as_root=(sudo)
export DEBIAN_FRONTEND=noninteractive
"${as_root[@]}" apt-get update -qq
"${as_root[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
