#!/bin/sh
# mgpu_ckpt against train_gpt's checkpoints (ctest's mgpu_ckpt_check):
#   mgpu_ckpt_check.sh MGPU_CKPT TRAIN_GPT TEXT_FILE DIR
# - info on a one-device file and on a data-parallel ZeRO-1 folder names the layout, the GPT's
#   config, the step, the optimizer and the records (the folder's optimizer state split);
# - convert of the folder to one file resumes as the folder does: the same losses, as printed;
# - convert --llmc writes the parameters as an llm.c file that train_gpt --init-from evaluates to
#   the checkpoint's validation loss;
# - a damaged file is refused, naming the file, with a non-zero exit.
set -eu
ckpt=$1
exe=$2
text=$3
dir=$4
fail() { echo "FAIL: $*" >&2; exit 1; }
rm -rf "$dir" && mkdir -p "$dir/folder"
common="--data $text --n-layer 2 --n-head 2 --n-embd 32 --block-size 16 --batch-size 4 --lr 3e-3 --eval-iters 2 --eval-every 0 --seed 7 --json"
# shellcheck disable=SC2086
"$exe" $common --iters 6 --checkpoint "$dir/one-device.ckpt" >/dev/null 2>&1 || fail "train_gpt --checkpoint FILE"
# shellcheck disable=SC2086
"$exe" $common --iters 6 --devices host:2 --zero 1 --checkpoint "$dir/folder" >/dev/null 2>&1 || fail "train_gpt --zero 1 --checkpoint FOLDER"

"$ckpt" info "$dir/one-device.ckpt" >"$dir/info-file.txt" || fail "info on a file"
"$ckpt" info "$dir/folder" >"$dir/info-folder.txt" || fail "info on a folder"
cat "$dir/info-file.txt" "$dir/info-folder.txt"
for f in info-file info-folder; do
  for want in "model: GPT, n_layer 2, n_head 2, n_embd 32, block 16, vocab 256" "training: step 6," "optimizer: adamw, 6 steps" \
              "model.parameters .*float32 .*\[34176\]"; do
    grep -q "$want" "$dir/$f.txt" || fail "$f: no line matching '$want'"
  done
done
grep -q "one file" "$dir/info-file.txt" || fail "info-file: not said to be one file"
grep -q "a folder of 1 shard(s), save 1" "$dir/info-folder.txt" || fail "info-folder: no folder line"
grep -q "optimizer.m .*element ranges \[0:" "$dir/info-folder.txt" || fail "info-folder: optimizer.m not split"

# A tensor-parallel folder: each rank's boxes of the named tensors; converted to one file and to an
# llm.c file, both evaluating to the same validation loss.
mkdir -p "$dir/tp"
# shellcheck disable=SC2086
"$exe" $common --iters 6 --devices host:2 --tp 2 --checkpoint "$dir/tp" >/dev/null 2>&1 || fail "train_gpt --tp 2 --checkpoint FOLDER"
"$ckpt" info "$dir/tp" >"$dir/info-tp.txt" || fail "info on a TP folder"
cat "$dir/info-tp.txt"
for want in "a folder of 2 shard(s), save 1, format version 2" "model.parameters .*\[34176\] .*the 28 tensors below laid end to end" \
            "model.parameters/h.0.attn_qkv.weight .*\[32, 96\] .*boxes \[0:32, 0:16\]@0 \[0:32, 16:32\]@1" \
            "optimizer.v/0.wte.weight .*\[256, 32\] .*boxes \[0:128, 0:32\]@0 \[128:256, 0:32\]@1"; do
  grep -q "$want" "$dir/info-tp.txt" || fail "info-tp: no line matching '$want'"
done
"$ckpt" convert "$dir/tp" "$dir/tp-joined.ckpt" || fail "convert TP FOLDER FILE"
"$ckpt" convert "$dir/tp" "$dir/tp.bin" --llmc || fail "convert TP FOLDER --llmc"
# shellcheck disable=SC2086
tp_file=$("$exe" $common --iters 6 --checkpoint "$dir/tp-joined.ckpt" --resume --eval-only 2>/dev/null | tail -1)
# shellcheck disable=SC2086
tp_llmc=$("$exe" $common --init-from "$dir/tp.bin" --eval-only 2>/dev/null | tail -1)
tp_val() { echo "$1" | sed -n 's/.*"val_loss": \([^,]*\),.*/\1/p'; }
[ -n "$(tp_val "$tp_file")" ] && [ "$(tp_val "$tp_llmc")" = "$(tp_val "$tp_file")" ] ||
  fail "the TP folder's llm.c file evaluates to $tp_llmc (expected the joined file's $tp_file)"

"$ckpt" convert "$dir/folder" "$dir/joined.ckpt" || fail "convert FOLDER FILE"
cp -r "$dir/folder" "$dir/folder2"
# shellcheck disable=SC2086
from_folder=$("$exe" $common --iters 10 --devices host:2 --zero 1 --checkpoint "$dir/folder2" --resume 2>/dev/null | tail -1)
# shellcheck disable=SC2086
from_file=$("$exe" $common --iters 10 --devices host:2 --zero 1 --checkpoint "$dir/joined.ckpt" --resume 2>/dev/null | tail -1)
loss() { echo "$1" | sed -n 's/.*"train_loss": \([^,]*\),.*"val_loss": \([^,]*\),.*/\1 \2/p'; }
[ -n "$(loss "$from_folder")" ] && [ "$(loss "$from_folder")" = "$(loss "$from_file")" ] ||
  fail "resumed from the converted file: $(loss "$from_file") (expected the folder's $(loss "$from_folder"))"

"$ckpt" convert "$dir/one-device.ckpt" "$dir/gpt.bin" --llmc || fail "convert --llmc"
# shellcheck disable=SC2086
from_llmc=$("$exe" $common --init-from "$dir/gpt.bin" --eval-only 2>/dev/null | tail -1)
# shellcheck disable=SC2086
from_ckpt=$("$exe" $common --iters 6 --checkpoint "$dir/one-device.ckpt" --resume --eval-only 2>/dev/null | tail -1)
val() { echo "$1" | sed -n 's/.*"val_loss": \([^,]*\),.*/\1/p'; }
[ -n "$(val "$from_ckpt")" ] && [ "$(val "$from_llmc")" = "$(val "$from_ckpt")" ] ||
  fail "the llm.c file evaluates to $(val "$from_llmc") (expected the checkpoint's $(val "$from_ckpt"))"

cp "$dir/one-device.ckpt" "$dir/damaged.ckpt"
size=$(wc -c <"$dir/damaged.ckpt")
printf 'X' | dd of="$dir/damaged.ckpt" bs=1 seek=$((size / 2)) conv=notrunc 2>/dev/null
if "$ckpt" info "$dir/damaged.ckpt" >/dev/null 2>"$dir/damaged.err"; then fail "info accepted a damaged file"; fi
grep -q "damaged.ckpt.*checksum mismatch" "$dir/damaged.err" || { cat "$dir/damaged.err"; fail "the damaged file's error does not name it"; }
echo "ok: mgpu_ckpt info and convert (one file, llm.c) on a file and a folder; a damaged file refused"
