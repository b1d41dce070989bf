#!/usr/bin/env bash
# Builds mgpu with its tests and runs them through ctest. CUDA is compiled in when nvcc is found
# (override with MGPU_WITH_CUDA=ON|OFF); CUDA tests skip with a message when no GPU is visible.
# Extra arguments go to ctest, e.g. scripts/test.sh -R shard
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
build=${MGPU_BUILD_DIR:-build/test}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE="${MGPU_BUILD_TYPE:-RelWithDebInfo}" \
  -DMGPU_WITH_CUDA="${MGPU_WITH_CUDA:-AUTO}" -DMGPU_WERROR=ON -DMGPU_NATIVE=OFF \
  -DMGPU_BUILD_EXAMPLES=ON -DMGPU_BUILD_BENCH=ON ${MGPU_HOST_GEMM:+-DMGPU_HOST_GEMM=$MGPU_HOST_GEMM} >/dev/null
cmake --build "$build"
cd "$build"
exec ctest --output-on-failure -j "$(nproc)" "$@"
