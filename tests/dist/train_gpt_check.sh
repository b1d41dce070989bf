#!/bin/sh
# train_gpt across processes against one process (ctest's dist_train_gpt):
#   train_gpt_check.sh TRAIN_GPT TEXT_FILE DIR MPIRUN... NUMPROC_FLAG
# A tiny GPT on TEXT_FILE (byte-tokenized) with clipping; each job prints the train and validation
# losses of the one-process run over as many devices, and its JSON lists the world's devices:
# - data parallel: mpirun -np 2 --devices host:1 = --devices host:2 (each process its rows), with
#   ZeRO-1 (the default) and ZeRO-3 (each rank keeping its own parameters);
# - pipelined: mpirun -np 2 --devices host:1 --stages 2 = host:2 (the tied LM head's copy of wte
#   in the other process);
# - a data x pipeline grid: mpirun -np 2 --devices host:2 --stages 2 --dp 2 = host:4;
# - tensor parallel across the processes: mpirun -np 2 --devices host:1 --tp 2 = host:2;
# - tensor parallel inside each process, data parallel across them (and sequence parallel):
#   mpirun -np 2 --devices host:2 --dp 2 --tp 2 --sequence-parallel = host:4;
# - a tensor x pipeline grid, each tensor-parallel group across the processes: mpirun -np 2
#   --devices host:2 --tp 2 --stages 2 = host:4.
# Each job's predicted_peak_bytes (the memory model's, of process 0's devices) is within 10% of its
# devices' peak_bytes.
set -eu
exe=$1
text=$2
dir=$3
shift 3
. "$(dirname "$0")/common.sh"
common="--data $text --n-layer 2 --n-head 2 --n-embd 32 --block-size 16 --batch-size 4 --lr 3e-3 --warmup 5
        --eval-iters 4 --eval-every 0 --seed 7 --iters 20 --json"

# check NAME ONE_ARGS -- JOB_ARGS: the job (2 processes) prints what one process prints.
check() {
  name=$1 one=$2 job=$3 devices=$4
  shift 4
  # shellcheck disable=SC2086
  "$exe" $common $one >"$dir/$name.one.json" 2>"$dir/$name.one.log" || { cat "$dir/$name.one.log"; fail "$name: train_gpt $one"; }
  # shellcheck disable=SC2086
  "$@" 2 "$exe" $common $job >"$dir/$name.json" 2>"$dir/$name.log" || { cat "$dir/$name.log"; fail "$name: mpirun train_gpt $job"; }
  cat "$dir/$name.json"
  for key in train_loss val_loss schedule; do
    [ "$(field "$key" "$dir/$name.one.json")" = "$(field "$key" "$dir/$name.json")" ] ||
      fail "$name: $key $(field "$key" "$dir/$name.json") (expected one process's $(field "$key" "$dir/$name.one.json"))"
  done
  [ "$(field devices "$dir/$name.json")" = "$devices" ] || fail "$name: devices $(field devices "$dir/$name.json") (expected $devices)"
  [ "$(field processes "$dir/$name.json")" = 2 ] || fail "$name: processes $(field processes "$dir/$name.json") (expected 2)"
  python3 -c '
import json, sys
measured, predicted = json.loads(sys.argv[2]), json.loads(sys.argv[3])
if len(predicted) != len(measured) or any(abs(p - m) > 0.10 * m for m, p in zip(measured, predicted)):
    sys.exit(f"FAIL: {sys.argv[1]}: predicted_peak_bytes {predicted} (expected within 10% of each of this process\x27s peak_bytes {measured})")
' "$name" "$(field peak_bytes "$dir/$name.json")" "$(field predicted_peak_bytes "$dir/$name.json")"
}
check data-parallel "--devices host:2" "--devices host:1" '["p0:host:0", "p1:host:0"]' "$@"
check zero3 "--devices host:2 --zero 3" "--devices host:1 --zero 3" '["p0:host:0", "p1:host:0"]' "$@"
check pipeline "--devices host:2 --stages 2" "--devices host:1 --stages 2" '["p0:host:0", "p1:host:0"]' "$@"
check grid "--devices host:4 --stages 2 --dp 2 --micro-batches 2" "--devices host:2 --stages 2 --dp 2 --micro-batches 2" \
  '["p0:host:0", "p0:host:1", "p1:host:0", "p1:host:1"]' "$@"
check tensor "--devices host:2 --tp 2" "--devices host:1 --tp 2" '["p0:host:0", "p1:host:0"]' "$@"
check data-tensor "--devices host:4 --dp 2 --tp 2 --sequence-parallel" "--devices host:2 --dp 2 --tp 2 --sequence-parallel" \
  '["p0:host:0", "p0:host:1", "p1:host:0", "p1:host:1"]' "$@"
check tensor-pipeline "--devices host:4 --tp 2 --stages 2 --micro-batches 2" "--devices host:2 --tp 2 --stages 2 --micro-batches 2" \
  '["p0:host:0", "p0:host:1", "p1:host:0", "p1:host:1"]' "$@"
echo "ok: data parallel (ZeRO-1 and 3), pipelined, a data x pipeline grid, tensor parallel, a data x tensor grid and a tensor x pipeline grid over 2 processes give one process's losses"
