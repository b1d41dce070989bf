#!/usr/bin/env bash
# The main job: builds mgpu (Release), fetches the Shakespeare corpus as byte-level token shards
# (scripts/example-data.sh: build/data/shakespeare/{train,val}.bin) and trains a small GPT on it
# with train_gpt, data parallel over two host devices (about a minute of training on two cores):
# the validation loss every 300 steps, then 400 sampled characters. Extra arguments go to train_gpt
# and override the defaults below (a later flag wins), e.g. scripts/run.sh --iters 3000 --json.
#
# The second example, the MLP classifier (train_mlp, data parallel over the default devices):
#   scripts/run.sh mlp [train_mlp flags], e.g. scripts/run.sh mlp --devices host:4 --epochs 5
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
build=${MGPU_BUILD_DIR:-build/release}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMGPU_BUILD_TESTS=OFF -DMGPU_BUILD_BENCH=OFF >/dev/null
if [ "${1:-}" = mlp ]; then
  shift
  cmake --build "$build" --target train_mlp
  exec "$build/examples/train_mlp" "$@"
fi
cmake --build "$build" --target train_gpt
scripts/example-data.sh  # prints the sha256 of the corpus it uses
exec "$build/examples/train_gpt" --data build/data/shakespeare --devices host:2 --n-layer 3 --n-head 4 --n-embd 96 --block-size 64 \
  --batch-size 12 --iters 1200 --lr 2e-3 --min-lr 2e-4 --warmup 50 --eval-every 300 --eval-iters 20 \
  --sample 400 --temperature 0.8 --top-k 40 "$@"
