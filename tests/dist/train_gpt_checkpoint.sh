#!/bin/sh
# train_gpt --checkpoint/--resume across processes (ctest's dist_train_gpt_checkpoint):
#   train_gpt_checkpoint.sh TRAIN_GPT TEXT_FILE DIR MPIRUN... NUMPROC_FLAG
# A 2-process run stopped after step 10 of 20 with --checkpoint (a folder of a shard per process)
# and resumed, on 2 processes and in one process over as many devices in the same layout, says it
# resumed at step 10 and ends with the uninterrupted 2-process run's train and validation losses
# (as printed, to 6 digits):
# - pipelined: --devices host:1 --stages 2 (a stage per process; in one process host:2 --stages 2);
# - data parallel: --devices host:1 (in one process host:2);
# - data x tensor parallel: --devices host:2 --dp 2 --tp 2 (a tensor-parallel group per process; in
#   one process host:4 --dp 2 --tp 2).
set -eu
exe=$1
text=$2
dir=$3
shift 3
. "$(dirname "$0")/common.sh"
common="--data $text --n-layer 2 --n-head 2 --n-embd 32 --block-size 16 --batch-size 4 --lr 3e-3 --warmup 5
        --eval-iters 4 --eval-every 0 --seed 7 --iters 20 --json"

# resume NAME JOB_ARGS ONE_ARGS MPIRUN...: the job (2 processes) stopped and resumed against its uninterrupted run.
resume() {
  name=$1 job=$2 one=$3
  shift 3
  # shellcheck disable=SC2086
  "$@" 2 "$exe" $common $job >"$dir/$name.json" 2>"$dir/$name.log" || { cat "$dir/$name.log"; fail "$name: mpirun train_gpt $job"; }
  # shellcheck disable=SC2086
  "$@" 2 "$exe" $common $job --checkpoint "$dir/$name.ckpt" --until-step 10 >"$dir/$name.half.json" 2>"$dir/$name.half.log" ||
    { cat "$dir/$name.half.log"; fail "$name: mpirun train_gpt $job --checkpoint --until-step 10"; }
  [ -f "$dir/$name.ckpt/manifest.ckpt" ] || fail "$name: no folder of shards at $dir/$name.ckpt"
  cp -r "$dir/$name.ckpt" "$dir/$name.one.ckpt"
  # shellcheck disable=SC2086
  "$@" 2 "$exe" $common $job --checkpoint "$dir/$name.ckpt" --resume >"$dir/$name.resumed.json" 2>"$dir/$name.resumed.log" ||
    { cat "$dir/$name.resumed.log"; fail "$name: mpirun train_gpt $job --resume"; }
  # shellcheck disable=SC2086
  "$exe" $common $one --checkpoint "$dir/$name.one.ckpt" --resume >"$dir/$name.resumed.one.json" 2>"$dir/$name.resumed.one.log" ||
    { cat "$dir/$name.resumed.one.log"; fail "$name: train_gpt $one --resume from 2 processes' checkpoint"; }
  for run in resumed resumed.one; do
    cat "$dir/$name.$run.json"
    grep -q "resumed from .* at step 10" "$dir/$name.$run.log" || { cat "$dir/$name.$run.log"; fail "$name.$run: did not resume at step 10"; }
    for key in train_loss val_loss; do
      [ "$(field "$key" "$dir/$name.json")" = "$(field "$key" "$dir/$name.$run.json")" ] ||
        fail "$name.$run: $key $(field "$key" "$dir/$name.$run.json") (expected the uninterrupted run's $(field "$key" "$dir/$name.json"))"
    done
  done
}
resume pipeline "--devices host:1 --stages 2" "--devices host:2 --stages 2" "$@"
resume data-parallel "--devices host:1" "--devices host:2" "$@"
resume tensor-parallel "--devices host:2 --dp 2 --tp 2" "--devices host:4 --dp 2 --tp 2" "$@"
resume grid "--devices host:4 --dp 2 --tp 2 --stages 2" "--devices host:8 --dp 2 --tp 2 --stages 2" "$@"
echo "ok: pipelined, data-parallel, tensor-parallel and DP x TP x PP train_gpt over 2 processes resume from their checkpoints, on 2 processes and in one, with the same losses"
