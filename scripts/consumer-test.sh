#!/usr/bin/env bash
# Builds and runs tests/consumer two ways: against an installed mgpu through find_package, and
# through FetchContent pointed at this source tree. Extra arguments go to mgpu's configure step.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
work=${MGPU_BUILD_DIR:-build/consumer}
rm -rf "$work"
cmake -S . -B "$work/mgpu" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMGPU_BUILD_TESTS=OFF -DMGPU_BUILD_EXAMPLES=OFF \
  -DMGPU_BUILD_BENCH=OFF -DCMAKE_INSTALL_PREFIX="$root/$work/prefix" "$@" >/dev/null
cmake --build "$work/mgpu"
cmake --install "$work/mgpu" >/dev/null

echo "== consumer through find_package"
cmake -S tests/consumer -B "$work/find_package" -G Ninja -DMGPU_CONSUME=find_package \
  -DCMAKE_PREFIX_PATH="$root/$work/prefix" >/dev/null
cmake --build "$work/find_package"
"$work/find_package/consumer"

echo "== consumer through FetchContent"
cmake -S tests/consumer -B "$work/fetchcontent" -G Ninja -DMGPU_CONSUME=fetchcontent -DMGPU_SOURCE_DIR="$root" "$@" >/dev/null
cmake --build "$work/fetchcontent"
"$work/fetchcontent/consumer"
