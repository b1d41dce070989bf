#!/usr/bin/env bash
# The main job: builds mgpu (Release) and trains the example MLP (train_mlp) on the default devices
# ($MGPU_DEVICES, else every GPU, else one host device per hardware thread).
# Extra arguments go to train_mlp, e.g. scripts/run.sh --devices host:4 --epochs 5 --precision bf16
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
build=${MGPU_BUILD_DIR:-build/release}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMGPU_BUILD_TESTS=OFF -DMGPU_BUILD_BENCH=OFF >/dev/null
cmake --build "$build" --target train_mlp
exec "$build/examples/train_mlp" "$@"
