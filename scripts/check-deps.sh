#!/usr/bin/env bash
# CI's check that a fresh machine gets everything the build needs, on a machine that has more:
#  1. configures as scripts/test.sh does, with CMake's trace, and fails when the build reads a file
#     of a Debian package that scripts/setup.sh neither names nor gets through Depends
#     (scripts/check_deps.py; the headers of the build directories given as arguments count too);
#  2. shows that this check bites: with ocl-icd-opencl-dev left out of the list it must fail;
#  3. configures once with each optional dependency disabled (CMAKE_DISABLE_FIND_PACKAGE_<name>),
#     which must succeed and name the fallback. (CI runs the Clang test suite on one such fallback.)
# Usage: scripts/check-deps.sh [BUILT_DIR...]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
work=build/ci-deps
rm -rf "$work"
mkdir -p "$work"
configure() {  # configure DIR ARGS...: the configure of scripts/test.sh, into DIR
  local dir=$1
  shift
  cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMGPU_WITH_CUDA=AUTO -DMGPU_NATIVE=ON \
    -DMGPU_BUILD_TESTS=ON -DMGPU_BUILD_EXAMPLES=ON -DMGPU_BUILD_BENCH=ON "$@"
}
configure "$work/traced" --trace-format=json-v1 --trace-redirect="$work/trace.json" >"$work/traced.log" 2>&1 ||
  { cat "$work/traced.log"; exit 1; }
built=()
for dir in "$@"; do built+=(--built "$dir"); done
check() {  # check PACKAGE_LIST
  python3 scripts/check_deps.py --packages "$1" --trace "$work/trace.json" --build "$work/traced" "${built[@]}"
}

echo "-- 1. every package the build reads from is installed by scripts/setup.sh"
scripts/setup.sh --list >"$work/packages"
check "$work/packages"

echo "-- 2. the check fails when a package the build needs is left out (ocl-icd-opencl-dev)"
grep -vx ocl-icd-opencl-dev "$work/packages" >"$work/packages-without-opencl"
if check "$work/packages-without-opencl" >"$work/without-opencl.log"; then
  cat "$work/without-opencl.log"
  echo "check-deps: FAILED: the check passed with ocl-icd-opencl-dev left out"
  exit 1
fi
grep -q "ocl-icd-opencl-dev is not installed by scripts/setup.sh" "$work/without-opencl.log" ||
  { cat "$work/without-opencl.log"; echo "check-deps: FAILED: the failure does not name ocl-icd-opencl-dev"; exit 1; }
echo "check-deps: ok, it failed naming ocl-icd-opencl-dev"

echo "-- 3. each optional dependency may be missing: the configure falls back and says so"
declare -A fallback=(  # what each one's absence must leave
  [dnnl]="mgpu host GEMM: Eigen" [OpenCL]="mgpu host GEMM: Eigen" [OpenMP]="mgpu host GEMM: Eigen"
  [CUDAToolkit]="mgpu: CUDA backend OFF" [NCCL]="NCCL OFF"
  [MPI]="no target bench_mpi_allreduce" [Gloo]="no target bench_gloo_allreduce"
  [PkgConfig]="metrics over HTTP OFF")  # cpp-httplib's flags come through pkg-config
for package in dnnl OpenCL OpenMP CUDAToolkit NCCL MPI Gloo PkgConfig; do
  log="$work/without-$package.log"
  configure "$work/fallback" --fresh -DCMAKE_DISABLE_FIND_PACKAGE_"$package"=ON >"$log" 2>&1 ||
    { cat "$log"; echo "check-deps: FAILED: the configure without $package failed"; exit 1; }
  for target in bench_mpi_allreduce bench_gloo_allreduce; do
    grep -q "^build $target:" "$work/fallback/build.ninja" || echo "-- no target $target" >>"$log"
  done
  grep -q "${fallback[$package]}" "$log" ||
    { cat "$log"; echo "check-deps: FAILED: without $package, expected '${fallback[$package]}'"; exit 1; }
  echo "check-deps: without $package: $(grep -m1 "${fallback[$package]}" "$log" | sed 's/^-- //')"
done
