#!/usr/bin/env bash
# Builds mgpu with its tests and runs them through ctest, by default the way users run it:
# Release with -march=native (MGPU_BUILD_TYPE, MGPU_NATIVE=OFF to change), in build/release, which
# scripts/bench.sh then reuses. CUDA is compiled in when nvcc is found (override with
# MGPU_WITH_CUDA=ON|OFF); CUDA tests skip with a message when no GPU is visible. MGPU_HOST_GEMM,
# when set, chooses the host GEMM; MGPU_CMAKE_ARGS adds configure arguments (e.g.
# -DCMAKE_DISABLE_FIND_PACKAGE_OpenCL=ON to test a fallback); CXX chooses the compiler of a fresh
# build directory.
# Extra arguments go to ctest, e.g. scripts/test.sh -R shard
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
build=${MGPU_BUILD_DIR:-build/release}
options=()
[ -n "${MGPU_HOST_GEMM:-}" ] && options+=(-DMGPU_HOST_GEMM="$MGPU_HOST_GEMM")
read -r -a extra <<<"${MGPU_CMAKE_ARGS:-}"
options+=("${extra[@]}")
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE="${MGPU_BUILD_TYPE:-Release}" \
  -DMGPU_WITH_CUDA="${MGPU_WITH_CUDA:-AUTO}" -DMGPU_WERROR=ON -DMGPU_NATIVE="${MGPU_NATIVE:-ON}" \
  -DMGPU_BUILD_TESTS=ON -DMGPU_BUILD_EXAMPLES=ON -DMGPU_BUILD_BENCH=ON "${options[@]}" >/dev/null
cmake --build "$build"
cd "$build"
exec ctest --output-on-failure -j "$(nproc)" "$@"
