#!/bin/sh
# The real torchrun starts a torchrun-style job (ctest's dist_torchrun_pytorch):
#   pytorch_torchrun.sh TRAIN_GPT TEXT_FILE
# `torchrun --nproc-per-node 2 --no-python train_gpt --devices host:1` gives `train_gpt --devices
# host:2`'s losses (the same reductions in the same order). Skipped (status 77) where PyTorch is
# not importable.
set -eu
exe=$1
text=$2
python3 -c "import torch.distributed.run" 2>/dev/null || { echo "skipped: PyTorch is not installed (torchrun comes with it)"; exit 77; }
fail() { echo "FAIL: $*" >&2; exit 1; }
field() { sed -E "s/.*\"$1\": (\[[^]]*\]|[^,}]*).*/\1/" "$2"; }
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
common="--data $text --n-layer 1 --n-head 2 --n-embd 16 --block-size 8 --batch-size 4 --iters 8 --eval-iters 2 --seed 3 --json"
# shellcheck disable=SC2086
"$exe" $common --devices host:2 >"$dir/one.json" || fail "train_gpt --devices host:2"
# shellcheck disable=SC2086
python3 -m torch.distributed.run --standalone --nproc-per-node 2 --no-python "$exe" $common --devices host:1 \
  >"$dir/two.json" || fail "torchrun --nproc-per-node 2 --no-python train_gpt --devices host:1"
cat "$dir/one.json" "$dir/two.json"
for key in train_loss val_loss; do
  [ "$(field "$key" "$dir/one.json")" = "$(field "$key" "$dir/two.json")" ] ||
    fail "$key $(field "$key" "$dir/two.json") under torchrun (expected host:2's $(field "$key" "$dir/one.json"))"
done
echo "ok: torchrun --no-python train_gpt over 2 processes gives one process's losses"
