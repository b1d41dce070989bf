#!/usr/bin/env bash
# train_gpt end to end on a small text file (the repository's README.md, byte-tokenized, 90/10
# split), a tiny model: the validation loss falls; a run resumed from its checkpoint ends with the
# uninterrupted run's losses to the last printed digit; --save-llmc then --init-from --eval-only
# gives the trained model's validation loss; --sample prints text; bad flags fail with exit code 2
# and a message. Usage: train_gpt_check.sh TRAIN_GPT TEXT_FILE DIR
set -euo pipefail
exe=$1
text=$2
dir=$3
rm -rf "$dir" && mkdir -p "$dir"
fail() { echo "FAIL: $*" >&2; exit 1; }
field() { sed -E "s/.*\"$1\": ([^,}]*).*/\1/" "$2"; }
common=(--data "$text" --n-layer 2 --n-head 2 --n-embd 32 --block-size 16 --batch-size 4 --lr 3e-3 --warmup 5
        --eval-iters 4 --eval-every 0 --seed 7 --json)

"$exe" "${common[@]}" --iters 0 > "$dir/start.json" 2> "$dir/start.log"
"$exe" "${common[@]}" --iters 40 --save-llmc "$dir/model.bin" --sample 50 > "$dir/full.json" 2> "$dir/full.log"
start=$(field val_loss "$dir/start.json")
end=$(field val_loss "$dir/full.json")
awk -v a="$start" -v b="$end" 'BEGIN { exit !(b < a - 0.3) }' || fail "val loss $start -> $end (expected a fall of > 0.3)"
grep -q -- "---- 50 sampled tokens" "$dir/full.log" || fail "no sample printed"
for key in tokens_per_s train_loss val_loss params devices iters peak_bytes; do
  grep -q "\"$key\": " "$dir/full.json" || fail "no $key in the JSON line"
done
[ "$(field iters "$dir/full.json")" = 40 ] || fail "iters $(field iters "$dir/full.json") (expected 40)"

# Interrupted at step 25 and resumed: the same data stream and schedule, the same end.
"$exe" "${common[@]}" --iters 40 --until-step 25 --checkpoint "$dir/run.ckpt" > /dev/null 2>&1
"$exe" "${common[@]}" --iters 40 --checkpoint "$dir/run.ckpt" --resume > "$dir/resumed.json" 2> "$dir/resumed.log"
grep -q "resumed from .* at step 25" "$dir/resumed.log" || fail "the run did not resume at step 25"
for key in train_loss val_loss; do
  [ "$(field $key "$dir/resumed.json")" = "$(field $key "$dir/full.json")" ] ||
    fail "$key $(field $key "$dir/resumed.json") after resuming (expected $(field $key "$dir/full.json"))"
done

# The llm.c model file brings back the trained weights: the same val loss without training.
"$exe" "${common[@]}" --init-from "$dir/model.bin" --eval-only > "$dir/llmc.json" 2> /dev/null
[ "$(field val_loss "$dir/llmc.json")" = "$end" ] || fail "val loss $(field val_loss "$dir/llmc.json") from --init-from (expected $end)"

# Refused: more than one device (until the executors take the GPT), a damaged model file, T > data.
expect_error() {
  local message=$1
  shift
  local rc=0
  "$exe" "$@" > /dev/null 2> "$dir/error.log" || rc=$?
  [ "$rc" -eq 2 ] || fail "exit code $rc for $* (expected 2)"
  grep -q -- "$message" "$dir/error.log" || fail "no '$message' in: $(cat "$dir/error.log")"
}
expect_error "names 2 devices (expected one device for now" "${common[@]}" --devices host:2
expect_error "--stages 2 (expected one device for now" "${common[@]}" --stages 2
head -c 2000 "$dir/model.bin" > "$dir/short.bin"
expect_error "short.bin:byte 2000: truncated" "${common[@]}" --init-from "$dir/short.bin"
expect_error "over 39996 windows (expected 1 to the" "${common[@]}" --eval-only --eval-iters 9999
echo "train_gpt check passed: val loss $start -> $end"
