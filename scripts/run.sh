#!/usr/bin/env bash
# The main job: builds mgpu (Release) and runs the example on the default devices
# ($MGPU_DEVICES, else every GPU, else one host device per hardware thread).
# Extra arguments go to the example, e.g. scripts/run.sh --devices host:4 --rows 100000
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
build=${MGPU_BUILD_DIR:-build/release}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMGPU_BUILD_TESTS=OFF -DMGPU_BUILD_BENCH=OFF >/dev/null
cmake --build "$build" --target device_group_demo
exec "$build/examples/device_group_demo" "$@"
