#!/usr/bin/env bash
# Builds and runs tests/consumer two ways: against an installed mgpu through find_package, and
# through FetchContent pointed at this source tree. Extra arguments go to mgpu's configure steps.
# MGPU_INSTALL_FROM names a build directory already built (e.g. build/release, which scripts/test.sh
# made) to install instead of building the library once more; the extra arguments then go to the
# FetchContent build only.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
work=$(realpath -m "${MGPU_BUILD_DIR:-build/consumer}")  # absolute: the consumers are configured from elsewhere
rm -rf "$work"
if [ -n "${MGPU_INSTALL_FROM:-}" ]; then
  cmake --install "$MGPU_INSTALL_FROM" --prefix "$work/prefix" >/dev/null
else
  cmake -S . -B "$work/mgpu" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMGPU_BUILD_TESTS=OFF -DMGPU_BUILD_EXAMPLES=OFF \
    -DMGPU_BUILD_BENCH=OFF -DCMAKE_INSTALL_PREFIX="$work/prefix" "$@" >/dev/null
  cmake --build "$work/mgpu"
  cmake --install "$work/mgpu" >/dev/null
fi

echo "== consumer through find_package"
cmake -S tests/consumer -B "$work/find_package" -G Ninja -DMGPU_CONSUME=find_package \
  -DCMAKE_PREFIX_PATH="$work/prefix" >/dev/null
cmake --build "$work/find_package"
"$work/find_package/consumer"

echo "== consumer through FetchContent"
cmake -S tests/consumer -B "$work/fetchcontent" -G Ninja -DMGPU_CONSUME=fetchcontent -DMGPU_SOURCE_DIR="$root" "$@" >/dev/null
cmake --build "$work/fetchcontent"
"$work/fetchcontent/consumer"
