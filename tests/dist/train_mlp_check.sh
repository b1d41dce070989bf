#!/bin/sh
# train_mlp across processes against one process (ctest's dist_train_mlp):
#   train_mlp_check.sh TRAIN_MLP DIR MPIRUN... NUMPROC_FLAG
# - mpirun -np 2 train_mlp --devices host:1 prints exactly the epoch losses and test accuracy of
#   train_mlp --devices host:2 (the same reductions in the same order), and its JSON lists the
#   world's devices;
# - 2 processes x 2 devices, an uneven 1 + 2 split (MPMD: mpirun -np 1 ... : -np 1 ...), and
#   2 x host:1 with --rebalance (rows split by the processes' measured speeds), end within 1e-4 of
#   its last epoch loss and 0.005 of its test accuracy;
# - 2 x host:1 with --checkpoint (a folder of shards) stopped after epoch 1 and resumed, on 2 x host:1
#   and in one process on host:2, end with the uninterrupted run's last epoch loss and accuracy bits.
set -eu
exe=$1
dir=$2
shift 2
. "$(dirname "$0")/common.sh"
args="--layers 32,10 --epochs 2 --batch 49 --json"  # odd batches: the processes get unequal rows

"$exe" --devices host:2 $args >"$dir/one.json" 2>"$dir/one.log" || { cat "$dir/one.log"; fail "train_mlp --devices host:2"; }
"$@" 2 "$exe" --devices host:1 $args >"$dir/two.json" 2>"$dir/two.log" || { cat "$dir/two.log"; fail "mpirun -np 2 train_mlp --devices host:1"; }
cat "$dir/one.json" "$dir/two.json"
for key in epoch_losses test_accuracy; do
  [ "$(field "$key" "$dir/one.json")" = "$(field "$key" "$dir/two.json")" ] ||
    fail "$key: $(field "$key" "$dir/two.json") on 2 processes x host:1, $(field "$key" "$dir/one.json") on host:2 (expected the same bits)"
done
[ "$(field devices "$dir/two.json")" = '["p0:host:0", "p1:host:0"]' ] || fail "devices $(field devices "$dir/two.json") (expected the world's)"
[ "$(field processes "$dir/two.json")" = 2 ] || fail "processes $(field processes "$dir/two.json") (expected 2)"

"$@" 2 "$exe" --devices host:1 $args --checkpoint "$dir/ckpt" --until-epoch 1 >"$dir/half.json" 2>"$dir/half.log" ||
  { cat "$dir/half.log"; fail "2 x host:1 --checkpoint --until-epoch 1"; }
cp -r "$dir/ckpt" "$dir/ckpt-one"
"$@" 2 "$exe" --devices host:1 $args --checkpoint "$dir/ckpt" --resume >"$dir/resumed.json" 2>"$dir/resumed.log" ||
  { cat "$dir/resumed.log"; fail "2 x host:1 --resume"; }
"$exe" --devices host:2 $args --checkpoint "$dir/ckpt-one" --resume >"$dir/resumed-one.json" 2>"$dir/resumed-one.log" ||
  { cat "$dir/resumed-one.log"; fail "host:2 --resume from 2 processes' checkpoint"; }
last_loss() { field epoch_losses "$1" | sed -E 's/.*, *//; s/[][]//g'; }
for run in resumed resumed-one; do
  cat "$dir/$run.json"
  [ "$(last_loss "$dir/$run.json") $(field test_accuracy "$dir/$run.json")" = "$(last_loss "$dir/two.json") $(field test_accuracy "$dir/two.json")" ] ||
    fail "$run: last epoch loss and accuracy $(last_loss "$dir/$run.json") $(field test_accuracy "$dir/$run.json") (expected the uninterrupted run's $(last_loss "$dir/two.json") $(field test_accuracy "$dir/two.json"))"
done

# close NAME FILE: FILE's last epoch loss and test accuracy are those of one.json within the tolerances.
close() {
  cat "$2"
  last() { field epoch_losses "$1" | sed -E 's/.*, *//; s/[][]//g'; }
  awk -v a="$(last "$dir/one.json")" -v b="$(last "$2")" -v c="$(field test_accuracy "$dir/one.json")" \
      -v d="$(field test_accuracy "$2")" 'BEGIN { exit !((a - b) ^ 2 <= 1e-8 && (c - d) ^ 2 <= 0.005 ^ 2) }' ||
    fail "$1: loss $(last "$2"), accuracy $(field test_accuracy "$2") (expected within 1e-4 and 0.005 of host:2's $(last "$dir/one.json"), $(field test_accuracy "$dir/one.json"))"
}
"$@" 2 "$exe" --devices host:2 $args >"$dir/2x2.json" 2>"$dir/2x2.log" || { cat "$dir/2x2.log"; fail "2 processes x host:2"; }
close "2 processes x host:2" "$dir/2x2.json"
[ "$(field devices "$dir/2x2.json")" = '["p0:host:0", "p0:host:1", "p1:host:0", "p1:host:1"]' ] ||
  fail "devices $(field devices "$dir/2x2.json") (expected the world's)"
"$@" 1 "$exe" --devices host:1 $args : "$np" 1 "$exe" --devices host:2 $args >"$dir/1+2.json" 2>"$dir/1+2.log" ||
  { cat "$dir/1+2.log"; fail "host:1 + host:2"; }
close "host:1 + host:2" "$dir/1+2.json"
"$@" 2 "$exe" --devices host:1 $args --rebalance >"$dir/rebalance.json" 2>"$dir/rebalance.log" ||
  { cat "$dir/rebalance.log"; fail "2 x host:1 --rebalance"; }
close "2 x host:1 --rebalance" "$dir/rebalance.json"
echo "ok: 2 x host:1 equals host:2 bit for bit, resumed too; 2 x host:2, host:1 + host:2 and 2 x host:1 --rebalance end within the tolerances"
