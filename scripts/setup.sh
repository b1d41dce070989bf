#!/usr/bin/env bash
# Installs mgpu's build prerequisites from Debian/Ubuntu packages when any is missing, and the
# optional packages some tests use where it can (a test without them skips, naming them).
# Runs apt-get as root (directly, or through sudo). Safe to run again: it installs nothing twice.
#   scripts/setup.sh                   install what is missing
#   scripts/setup.sh --list            print the build's packages, one a line (scripts/check-deps.sh reads them)
#   scripts/setup.sh --list-optional   print the optional packages, one a line
#   MGPU_SETUP_OPTIONAL=0 scripts/setup.sh   leave the optional packages out
# Packages are installed without their Recommends, so every package the build reads from must be
# named here or be a Depends of one named here: scripts/check-deps.sh fails CI otherwise. The
# build reads nothing from the optional ones: where they cannot be installed (not packaged, no
# network), setup says so and goes on.
set -euo pipefail

packages=(cmake ninja-build g++ libeigen3-dev libxxhash-dev catch2 libbenchmark-dev libcli11-dev
  libdnnl-dev ocl-icd-opencl-dev  # oneDNN's CMake package finds OpenCL (a Recommends of libdnnl-dev)
  nlohmann-json3-dev  # tests read trace JSON back
  python3 python3-venv  # scripts' checks (standard library) and their own venvs (scripts/venv.sh)
  openmpi-bin libopenmpi-dev  # mgpu::dist across processes (MGPU_WITH_MPI), its mpirun tests, a baseline of bench_collectives
  libgloo-dev  # host devices across torchrun-style processes; a baseline of bench_collectives
  iproute2  # the test across network namespaces (tests/dist/netns.sh)
  libcpp-httplib-dev pkgconf  # the metrics module's /metrics endpoint (cpp-httplib; its flags from its pkg-config file)
  doxygen  # the API reference (scripts/docs.sh)
  libglpk-dev  # GLPK: the cluster simulator's offline bound (src/cluster/bound.cpp), a linear/integer program
  clang-14 libclang-rt-14-dev)  # the second compiler in CI, and libFuzzer (scripts/fuzz.sh)
optional=(slurm-wlm munge  # a one-node Slurm cluster for ctest's dist_slurm (tests/dist/slurm.sh)
  prometheus prometheus-node-exporter)  # ctest's metrics_prometheus: a real server scrapes train_gpt (tests/metrics/prometheus.sh)
[ "${MGPU_SETUP_OPTIONAL:-1}" = 0 ] && optional=()
if [ "${1:-}" = --list ]; then
  printf '%s\n' "${packages[@]}"
  exit 0
fi
if [ "${1:-}" = --list-optional ]; then
  [ ${#optional[@]} -eq 0 ] || printf '%s\n' "${optional[@]}"
  exit 0
fi
installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
missing=()
for p in "${packages[@]}"; do
  installed "$p" || missing+=("$p")
done
missing_optional=()
for p in "${optional[@]}"; do
  installed "$p" || missing_optional+=("$p")
done
# NVML's header for the CUDA build's GPU utilisation (cmake/mgpuNvml.cmake): the CUDA toolkit's
# where it ships one, else PyPI's nvidia-nvml-dev-cu12 wheel (Debian main packages none) under
# MGPU_NVML_ROOT through a throwaway venv's pip. The build compiles without it (MGPU_WITH_NVML=AUTO
# leaves the metric out), so a failure only says so.
as_root=()
[ "$(id -u)" -eq 0 ] || as_root=(sudo)
nvml_root=${MGPU_NVML_ROOT:-/opt/mgpu-nvml}
cuda_include=${CUDA_HOME:-/usr/local/cuda}/include
if [ -d "$cuda_include" ] && [ ! -f "$cuda_include/nvml.h" ] && [ ! -f "$nvml_root/nvidia/nvml_dev/include/nvml.h" ]; then
  echo "mgpu setup: installing NVML's header (nvidia-nvml-dev-cu12) under $nvml_root" >&2
  venv=$(mktemp -d)
  if ! { python3 -m venv "$venv/venv" && "$venv/venv/bin/pip" install -q --target "$venv/nvml" nvidia-nvml-dev-cu12==12.9.79 &&
    "${as_root[@]}" mkdir -p "$nvml_root" && "${as_root[@]}" cp -r "$venv/nvml/nvidia" "$nvml_root/"; }; then
    echo "mgpu setup: could not install NVML's header: the CUDA build exports no GPU utilisation" >&2
  fi
  rm -rf "$venv"
fi
[ ${#missing[@]} -eq 0 ] && [ ${#missing_optional[@]} -eq 0 ] && exit 0

export DEBIAN_FRONTEND=noninteractive
install=("${as_root[@]}" apt-get -o DPkg::Lock::Timeout=900 install -y -qq --no-install-recommends)
if [ ${#missing[@]} -gt 0 ]; then
  echo "mgpu setup: installing ${missing[*]}" >&2
  "${as_root[@]}" apt-get update -qq
  "${install[@]}" "${missing[@]}" >/dev/null
elif ! "${as_root[@]}" apt-get update -qq; then
  echo "mgpu setup: apt-get update failed; the optional ${missing_optional[*]} not installed" >&2
  exit 0
fi
if [ ${#missing_optional[@]} -gt 0 ]; then
  echo "mgpu setup: installing the optional ${missing_optional[*]}" >&2
  "${install[@]}" "${missing_optional[@]}" >/dev/null ||
    echo "mgpu setup: could not install the optional ${missing_optional[*]}: the tests that need them skip" >&2
fi
