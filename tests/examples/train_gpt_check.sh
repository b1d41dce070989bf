#!/usr/bin/env bash
# train_gpt end to end on a small text file (tests/data/corpus.txt, byte-tokenized, 90/10
# split), a tiny model: the validation loss falls; a run resumed from its checkpoint ends with the
# uninterrupted run's losses to the last printed digit; --save-llmc then --init-from --eval-only
# gives the trained model's validation loss; --sample prints text; data parallel over host:2 and
# host:3 (uneven shards of the 4 sequences) follows the one-device run's losses, and resumes, with
# --zero 0 and --zero 2 as with the default ZeRO-1 (and --zero 3 as --zero 2, to the last digit); so
# do the pipeline schedules (1F1B, interleaved, ZB-H1, GPipe, layer split) and a data x pipeline
# grid, and resume (on their layout, and from a data-parallel checkpoint); so does tensor
# parallelism (--tp 2), which also starts from an llm.c model file, and its data-parallel replicas
# (--dp 2 --tp 2), and with --sequence-parallel; so do the data x tensor x pipeline grids --tp 2
# --stages 2 (1F1B, and with --sequence-parallel) and --dp 2 --tp 2 --stages 2 (GPipe); --recompute
# selective and full
# give the same losses in each kind of layout; --trace writes the last step's timeline; bad flags
# fail with exit code 2 and a message. Usage: train_gpt_check.sh TRAIN_GPT TEXT_FILE DIR
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

# Data parallel: the one-device losses within float32 rounding (relative 1e-4 after 40 steps), and
# a resumed data-parallel run ends as the uninterrupted one.
close() { awk -v a="$1" -v b="$2" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(d <= 1e-4 * (a < 0 ? -a : a)) }'; }
like_one_device() {  # like_one_device JSON HOW: the run's train and val losses are the one-device run's
  local key
  for key in train_loss val_loss; do
    close "$(field $key "$1")" "$(field $key "$dir/full.json")" ||
      fail "$key $(field $key "$1") $2 (expected $(field $key "$dir/full.json") as on one device)"
  done
}
for devices in host:2 host:3; do
  "$exe" "${common[@]}" --iters 40 --devices $devices > "$dir/dp.json" 2> "$dir/dp.log"
  like_one_device "$dir/dp.json" "on $devices"
done
grep -q '"devices": \["host:0", "host:1", "host:2"\]' "$dir/dp.json" || fail "devices in the JSON line: $(cat "$dir/dp.json")"
"$exe" "${common[@]}" --iters 40 --devices host:2 > "$dir/dp2.json" 2> /dev/null
"$exe" "${common[@]}" --iters 40 --devices host:2 --until-step 25 --checkpoint "$dir/dp.ckpt" > /dev/null 2>&1
"$exe" "${common[@]}" --iters 40 --devices host:2 --checkpoint "$dir/dp.ckpt" --resume > "$dir/dp-resumed.json" 2> /dev/null
for key in train_loss val_loss; do
  [ "$(field $key "$dir/dp-resumed.json")" = "$(field $key "$dir/dp2.json")" ] ||
    fail "$key $(field $key "$dir/dp-resumed.json") after resuming on host:2 (expected $(field $key "$dir/dp2.json"))"
done
# --zero 0 (every replica updates every weight and keeps the whole AdamW state) against the
# default --zero 1 (ZeRO-1): the same losses within float32 rounding.
"$exe" "${common[@]}" --iters 40 --devices host:2 --zero 0 > "$dir/dp-zero0.json" 2> /dev/null
for key in train_loss val_loss; do
  close "$(field $key "$dir/dp-zero0.json")" "$(field $key "$dir/dp2.json")" ||
    fail "$key $(field $key "$dir/dp-zero0.json") with --zero 0 (expected $(field $key "$dir/dp2.json") as with --zero 1)"
done
[ "$(field zero "$dir/dp2.json")" = 1 ] && [ "$(field zero "$dir/dp-zero0.json")" = 0 ] || fail "zero in the JSON lines: $(cat "$dir/dp2.json" "$dir/dp-zero0.json")"
# --zero 2 (ZeRO-2: each replica keeps only its reduced gradients), with small buckets: the
# default --zero 1's losses within float32 rounding.
"$exe" "${common[@]}" --iters 40 --devices host:2 --zero 2 --bucket-kb 16 > "$dir/dp-zero2.json" 2> /dev/null
for key in train_loss val_loss; do
  close "$(field $key "$dir/dp-zero2.json")" "$(field $key "$dir/dp2.json")" ||
    fail "$key $(field $key "$dir/dp-zero2.json") with --zero 2 (expected $(field $key "$dir/dp2.json") as with --zero 1)"
done
[ "$(field zero "$dir/dp-zero2.json")" = 2 ] || fail "zero in the JSON line: $(cat "$dir/dp-zero2.json")"
# --zero 3 (ZeRO-3: the parameters sharded too, each bucket gathered before its forward and
# backward; evaluation gathers the whole model): --zero 2's losses exactly.
"$exe" "${common[@]}" --iters 40 --devices host:2 --zero 3 --bucket-kb 16 > "$dir/dp-zero3.json" 2> /dev/null
for key in train_loss val_loss; do
  [ "$(field $key "$dir/dp-zero3.json")" = "$(field $key "$dir/dp-zero2.json")" ] ||
    fail "$key $(field $key "$dir/dp-zero3.json") with --zero 3 (expected $(field $key "$dir/dp-zero2.json") as with --zero 2)"
done
[ "$(field zero "$dir/dp-zero3.json")" = 3 ] || fail "zero in the JSON line: $(cat "$dir/dp-zero3.json")"

# Pipelined: the one-device losses within float32 rounding, every schedule and a 2 x 2 grid; the
# plan names each chunk's layers; --trace writes the last step's actions of both devices.
pipelines=("--schedule 1f1b --stages 2 --micro-batches 4" "--schedule interleaved --stages 2 --micro-batches 2"
           "--schedule zb --stages 2 --micro-batches 2" "--schedule gpipe --stages 2 --micro-batches 3"
           "--schedule layer-split --stages 2" "--stages 2 --micro-batches 2 --dp 2")
for layout in "${pipelines[@]}"; do
  read -r -a flags <<<"$layout"
  "$exe" "${common[@]}" --iters 40 "${flags[@]}" > "$dir/pp.json" 2> "$dir/pp.log"
  like_one_device "$dir/pp.json" "with $layout"
  grep -q "chunk 1 on device 1: layers \[" "$dir/pp.log" || fail "no plan printed with $layout: $(head -3 "$dir/pp.log")"
done
grep -q '"devices": \["host:0", "host:1", "host:2", "host:3"\]' "$dir/pp.json" || fail "devices of the grid: $(cat "$dir/pp.json")"
# Resumed pipelined: bit for bit on its layout; from the data-parallel run's checkpoint (the same
# format), within float32 rounding.
pp=(--stages 2 --micro-batches 2)
"$exe" "${common[@]}" --iters 40 "${pp[@]}" > "$dir/pp1.json" 2> /dev/null
"$exe" "${common[@]}" --iters 40 "${pp[@]}" --until-step 25 --checkpoint "$dir/pp.ckpt" > /dev/null 2>&1
"$exe" "${common[@]}" --iters 40 "${pp[@]}" --checkpoint "$dir/pp.ckpt" --resume > "$dir/pp-resumed.json" 2> /dev/null
"$exe" "${common[@]}" --iters 40 --devices host:2 --until-step 25 --checkpoint "$dir/dp-to-pp.ckpt" > /dev/null 2>&1
"$exe" "${common[@]}" --iters 40 "${pp[@]}" --checkpoint "$dir/dp-to-pp.ckpt" --resume > "$dir/dp-to-pp.json" 2> "$dir/dp-to-pp.log"
grep -q "resumed from .* at step 25" "$dir/dp-to-pp.log" || fail "the pipeline did not resume the data-parallel run at step 25"
for key in train_loss val_loss; do
  [ "$(field $key "$dir/pp-resumed.json")" = "$(field $key "$dir/pp1.json")" ] ||
    fail "$key $(field $key "$dir/pp-resumed.json") after resuming the pipeline (expected $(field $key "$dir/pp1.json"))"
  close "$(field $key "$dir/dp-to-pp.json")" "$(field $key "$dir/full.json")" ||
    fail "$key $(field $key "$dir/dp-to-pp.json") resumed pipelined from host:2 (expected $(field $key "$dir/full.json"))"
done
"$exe" "${common[@]}" --iters 3 --stages 2 --micro-batches 2 --trace "$dir/trace.json" > /dev/null 2>&1
python3 - "$dir/trace.json" <<'EOF' || fail "the trace lacks a device's actions"
import json, sys
trace = json.load(open(sys.argv[1]))
events = trace["traceEvents"] if isinstance(trace, dict) else trace
sys.exit(0 if {e["pid"] for e in events if e.get("ph") == "X"} == {0, 1} else 1)
EOF

# Activation recomputation: the losses of the run without it, to the last printed digit, in every
# layout (one device, data parallel, 1F1B, ZB-H1 with its split backward); the JSON line names it.
same() {  # same LABEL GOT WANT
  for key in train_loss val_loss; do
    [ "$(field $key "$2")" = "$(field $key "$3")" ] || fail "$key $(field $key "$2") with $1 (expected $(field $key "$3"))"
  done
}
zb=(--schedule zb --stages 2 --micro-batches 2)
"$exe" "${common[@]}" --iters 40 "${zb[@]}" > "$dir/zb.json" 2> /dev/null
for recompute in selective full; do
  "$exe" "${common[@]}" --iters 40 --recompute $recompute > "$dir/rc.json" 2> /dev/null
  same "--recompute $recompute" "$dir/rc.json" "$dir/full.json"
  grep -q "\"recompute\": \"$recompute\"" "$dir/rc.json" || fail "no recompute $recompute in: $(cat "$dir/rc.json")"
done
"$exe" "${common[@]}" --iters 40 --devices host:2 --recompute full > "$dir/rc-dp.json" 2> /dev/null
same "--recompute full on host:2" "$dir/rc-dp.json" "$dir/dp2.json"
"$exe" "${common[@]}" --iters 40 "${pp[@]}" --recompute full > "$dir/rc-pp.json" 2> /dev/null
same "--recompute full on ${pp[*]}" "$dir/rc-pp.json" "$dir/pp1.json"
"$exe" "${common[@]}" --iters 40 "${zb[@]}" --recompute selective > "$dir/rc-zb.json" 2> /dev/null
same "--recompute selective on ${zb[*]}" "$dir/rc-zb.json" "$dir/zb.json"
grep -q '"recompute": "none"' "$dir/full.json" || fail "no recompute none in: $(cat "$dir/full.json")"

# Tensor parallel over host:2 (each block's heads and MLP split): the one-device losses within
# float32 rounding; from the llm.c model file, the trained model's validation loss.
"$exe" "${common[@]}" --iters 40 --tp 2 > "$dir/tp.json" 2> "$dir/tp.log"
like_one_device "$dir/tp.json" "with --tp 2"
[ "$(field tp "$dir/tp.json")" = 2 ] || fail "tp in the JSON line: $(cat "$dir/tp.json")"
# With sequence parallelism (each device 1/2 of the tokens between the split regions): the same.
"$exe" "${common[@]}" --iters 40 --tp 2 --sequence-parallel > "$dir/sp.json" 2> /dev/null
like_one_device "$dir/sp.json" "with --tp 2 --sequence-parallel"
[ "$(field sequence_parallel "$dir/sp.json")" = true ] && [ "$(field sequence_parallel "$dir/tp.json")" = false ] ||
  fail "sequence_parallel in the JSON lines: $(cat "$dir/sp.json" "$dir/tp.json")"
# Two replicas of it over host:4 (each its two rows of the batch): the one-device losses too.
"$exe" "${common[@]}" --iters 40 --dp 2 --tp 2 > "$dir/dptp.json" 2> /dev/null
like_one_device "$dir/dptp.json" "with --dp 2 --tp 2"
[ "$(field dp "$dir/dptp.json")" = 2 ] && [ "$(field tp "$dir/dptp.json")" = 2 ] ||
  fail "dp and tp in the JSON line: $(cat "$dir/dptp.json")"
for grid in "--tp 2 --stages 2" "--dp 2 --tp 2 --stages 2 --schedule gpipe --micro-batches 2" "--tp 2 --stages 2 --sequence-parallel"; do
  # shellcheck disable=SC2086
  "$exe" "${common[@]}" --iters 40 $grid > "$dir/tpp.json" 2> /dev/null
  like_one_device "$dir/tpp.json" "with $grid"
  [ "$(field tp "$dir/tpp.json")" = 2 ] && [ "$(field stages "$dir/tpp.json")" = 2 ] ||
    fail "tp and stages in the JSON line: $(cat "$dir/tpp.json")"
done
# The executor's ranks are pipeline-major (rank t's pipeline on [2 t, 2 t + 2) for 2 stages): each
# stage's tensor-parallel pair lands on neighbouring devices (equal links keep the given order).
"$exe" "${common[@]}" --iters 1 --tp 2 --stages 2 > "$dir/tpp.json" 2> /dev/null
grep -q '"devices": \["host:0", "host:2", "host:1", "host:3"\]' "$dir/tpp.json" ||
  fail "devices of --tp 2 --stages 2 in the JSON line: $(cat "$dir/tpp.json")"
"$exe" "${common[@]}" --tp 2 --init-from "$dir/model.bin" --eval-only > "$dir/tp-llmc.json" 2> /dev/null
[ "$(field val_loss "$dir/tp-llmc.json")" = "$end" ] || fail "val loss $(field val_loss "$dir/tp-llmc.json") from --init-from with --tp 2 (expected $end)"

# Refused: micro-batches without a pipeline, a layout that does not match the devices, --dp
# other than the device count, --tp not dividing the heads, with --dp x --tp (x --stages)
# other than the device count, --sequence-parallel without --tp or with a block size --tp does not divide, a ZeRO stage other than 0 or 1, a damaged model file, more validation windows than the data holds.
expect_error() {
  local message=$1
  shift
  local rc=0
  "$exe" "$@" > /dev/null 2> "$dir/error.log" || rc=$?
  [ "$rc" -eq 2 ] || fail "exit code $rc for $* (expected 2)"
  grep -q -- "$message" "$dir/error.log" || fail "no '$message' in: $(cat "$dir/error.log")"
}
expect_error "--micro-batches 2 without a pipeline" "${common[@]}" --micro-batches 2
expect_error "--devices host:3 has 3 devices (expected --stages x --dp = 4)" "${common[@]}" --stages 2 --dp 2 --devices host:3
expect_error "--dp 3 with --devices host:2 (expected the number of devices, 2" "${common[@]}" --devices host:2 --dp 3
expect_error "--tp 3 with --n-head 2 (expected --tp dividing --n-head: each device holds whole heads)" "${common[@]}" --tp 3
expect_error "--devices host:3 has 3 devices (expected --dp x --tp x --stages = 4)" "${common[@]}" --tp 2 --stages 2 --devices host:3
expect_error "--devices host:3 has 3 devices (expected --dp x --tp = 4)" "${common[@]}" --tp 2 --dp 2 --devices host:3
expect_error "--zero 4 (expected 0, the replicated update, 1" "${common[@]}" --devices host:2 --zero 4
expect_error "--bucket-kb with a pipeline (expected --bucket-kb with data or tensor parallelism" "${common[@]}" --stages 2 --bucket-kb 16
expect_error "--sequence-parallel with --tp 1 (expected --tp 2 or more" "${common[@]}" --sequence-parallel
expect_error "--sequence-parallel with --block-size 15 over --tp 2 (expected a block size divisible by --tp)" \
  "${common[@]}" --tp 2 --sequence-parallel --block-size 15
head -c 2000 "$dir/model.bin" > "$dir/short.bin"
expect_error "short.bin:byte 2000: truncated" "${common[@]}" --init-from "$dir/short.bin"
expect_error "over 39996 windows (expected 1 to the" "${common[@]}" --eval-only --eval-iters 9999
echo "train_gpt check passed: val loss $start -> $end"
