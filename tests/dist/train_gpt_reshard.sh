#!/bin/sh
# A ZeRO-3 grid's checkpoint across processes resharded into other layouts (ctest's
# dist_train_gpt_reshard):
#   train_gpt_reshard.sh TRAIN_GPT MGPU_CKPT TEXT_FILE DIR MPIRUN... NUMPROC_FLAG
# train_gpt's DP 2 x TP 2 x PP 2 grid with --zero 3 over 2 processes stops at step 5 of 10 with
# --checkpoint (a folder of each rank's boxes, a shard per process) and resumes (a) in one process
# on one device, (b) on --tp 4 over 2 processes and (c) on a 2-stage pipeline x DP 2 with --zero 1
# over 2 processes; each says it resumed at step 5 and continues the uninterrupted run's losses
# (steps 6 to 10 as printed, the final train and validation losses within 1e-5 relative). The
# uninterrupted run and a second save give each process half the devices (4): the mesh's replica 0
# then lies in process 0, which writes every box. The save resumed in other layouts gives process 0
# 2 devices and process 1 6 (mpirun's MPMD form), so that replica 0's tensor-parallel ranks lie in
# both processes and each process writes its rank's boxes. `mgpu_ckpt info` on that folder lists
# its 2 shards and the tensors' boxes in each; `mgpu_ckpt convert` joins it into one file that one
# device resumes with the same losses; a damaged shard is refused naming its file and record.
set -eu
exe=$1
ckpt=$2
text=$3
dir=$4
shift 4
. "$(dirname "$0")/common.sh"
common="--data $text --n-layer 2 --n-head 4 --n-embd 32 --block-size 16 --batch-size 4 --lr 3e-3 --warmup 3
        --eval-iters 4 --eval-every 0 --seed 7 --iters 10 --json"
grid="--dp 2 --tp 2 --stages 2 --zero 3"

# run NAME [MPIRUN... N] TRAIN_GPT_ARGS...: NAME.json and NAME.log, failing with the log.
run() {
  name=$1
  shift
  "$@" >"$dir/$name.json" 2>"$dir/$name.log" || { cat "$dir/$name.log"; fail "$name: $*"; }
}
# losses LOG: the step losses LOG prints ("step N/10  loss X", 4 decimals), one "N X" a line.
losses() { sed -n 's|^step \([0-9]*\)/[0-9]*  loss \([0-9.]*\) .*|\1 \2|p' "$1"; }
# close NAME: NAME.log's losses of steps 6 to 10 those of the uninterrupted run (as printed, give or
# take the last digit's rounding), NAME.json's final train and validation losses within 1e-5
# relative of its.
close() {
  grep -q "resumed from .* at step 5" "$dir/$1.log" || { cat "$dir/$1.log"; fail "$1: did not resume at step 5"; }
  losses "$dir/full.log" | sed -n '6,$p' >"$dir/$1.want"
  losses "$dir/$1.log" >"$dir/$1.got"
  [ "$(wc -l <"$dir/$1.want")" -eq 5 ] || fail "full.log: $(wc -l <"$dir/$1.want") losses of steps 6 to 10 (expected 5)"
  paste "$dir/$1.want" "$dir/$1.got" | awk '{ d = $2 - $4; if (d < 0) d = -d; if ($1 != $3 || d > 1.5e-4) exit 1 }' || {
    paste "$dir/$1.want" "$dir/$1.got"
    fail "$1: step losses (right) are not the uninterrupted run's (left)"
  }
  for key in train_loss val_loss; do
    want=$(field "$key" "$dir/full.json") got=$(field "$key" "$dir/$1.json")
    awk -v w="$want" -v g="$got" 'BEGIN { d = w - g; if (d < 0) d = -d; a = w < 0 ? -w : w; exit !(g != "" && d <= 1e-5 * a) }' ||
      fail "$1: $key $got (expected the uninterrupted run's $want within 1e-5 relative)"
    echo "$1: $key $got (uninterrupted $want)"
  done
}

# shellcheck disable=SC2086
run full "$@" 2 "$exe" $common --devices host:4 $grid
# shellcheck disable=SC2086
run half-even "$@" 2 "$exe" $common --devices host:4 $grid --checkpoint "$dir/even.ckpt" --until-step 5
# shellcheck disable=SC2086
run half "$@" 1 "$exe" $common --devices host:2 $grid --checkpoint "$dir/grid.ckpt" --until-step 5 \
  : "$np" 1 "$exe" $common --devices host:6 $grid --checkpoint "$dir/grid.ckpt" --until-step 5
for folder in even grid; do [ -f "$dir/$folder.ckpt/manifest.ckpt" ] || fail "no folder of shards at $dir/$folder.ckpt"; done
for layout in one tp4 pp-dp; do cp -r "$dir/grid.ckpt" "$dir/$layout.ckpt"; done

# shellcheck disable=SC2086
run one "$exe" $common --devices host:1 --checkpoint "$dir/one.ckpt" --resume
# shellcheck disable=SC2086
run one-even "$exe" $common --devices host:1 --checkpoint "$dir/even.ckpt" --resume
# shellcheck disable=SC2086
run tp4 "$@" 2 "$exe" $common --devices host:2 --tp 4 --checkpoint "$dir/tp4.ckpt" --resume
# shellcheck disable=SC2086
run pp-dp "$@" 2 "$exe" $common --devices host:2 --stages 2 --dp 2 --zero 1 --checkpoint "$dir/pp-dp.ckpt" --resume
for name in one one-even tp4 pp-dp; do close "$name"; done

"$ckpt" info "$dir/grid.ckpt" >"$dir/info.txt" || fail "mgpu_ckpt info on the grid's folder"
cat "$dir/info.txt"
# Replica 0's ranks: process 0 holds tensor-parallel rank 0 of both stages, process 1 rank 1; a
# block's q, k and v are a column box per rank (heads 0-1 and 2-3), wte's rows a box per rank.
for want in "a folder of 2 shard(s), save 1, format version 2" "model: GPT, n_layer 2, n_head 4, n_embd 32, block 16, vocab 256" \
            "training: step 5," "optimizer: adamw, 5 steps" \
            "model.parameters/h.0.attn_qkv.weight .*\[32, 96\] .*boxes \[0:32, 0:16\]@0 \[0:32, 16:32\]@1 \[0:32, 32:48\]@0" \
            "model.parameters/h.1.mlp_proj.weight .*\[128, 32\] .*boxes \[0:64, 0:32\]@0 \[64:128, 0:32\]@1" \
            "optimizer.v/0.wte.weight .*\[256, 32\] .*boxes \[0:128, 0:32\]@0 \[128:256, 0:32\]@1"; do
  grep -q "$want" "$dir/info.txt" || fail "info: no line matching '$want'"
done
"$ckpt" convert "$dir/grid.ckpt" "$dir/joined.ckpt" || fail "mgpu_ckpt convert of the grid's folder"
# shellcheck disable=SC2086
run joined "$exe" $common --devices host:1 --checkpoint "$dir/joined.ckpt" --resume
close joined
# A byte of process 1's shard flipped: one device refuses the folder, naming the shard file and record.
cp -r "$dir/grid.ckpt" "$dir/damaged.ckpt"
shard="$dir/damaged.ckpt/shard-1-1-of-2.ckpt"
[ -f "$shard" ] || fail "no shard file $shard"
printf 'X' | dd of="$shard" bs=1 seek=$(($(wc -c <"$shard") / 2)) conv=notrunc 2>/dev/null
# shellcheck disable=SC2086
if "$exe" $common --devices host:1 --checkpoint "$dir/damaged.ckpt" --resume >/dev/null 2>"$dir/damaged.log"; then
  fail "one device resumed from a damaged shard"
fi
grep -q "shard-1-1-of-2.ckpt: checksum mismatch in record 'box:[0-9,]*:[a-z.]*/" "$dir/damaged.log" ||
  { cat "$dir/damaged.log"; fail "the damaged shard's error does not name its file and record"; }
echo "ok: DP 2 x TP 2 x PP 2 ZeRO-3 checkpoints of 2 processes resume on one device, on TP 4 and on PP 2 x DP 2 ZeRO-1 across 2 processes, and converted to one file, with the uninterrupted run's losses"
