#!/bin/sh
# train_pipeline across processes against one process (ctest's dist_train_pipeline):
#   train_pipeline_check.sh TRAIN_PIPELINE DIR MPIRUN... NUMPROC_FLAG
# With the same --cuts, every device computes the same chunk from the same inputs wherever it
# runs, so each job prints exactly the epoch losses and test accuracy of the one-process run over
# as many devices, and its JSON lists the world's devices:
# - mpirun -np 2 --devices host:1, GPipe over 2 stages (a stage per process) = --devices host:2;
# - mpirun -np 2 --devices host:2, 1F1B over 2 stages x 2 replicas (a replica per process) = host:4;
# - mpirun -np 1 --devices host:1 : -np 1 --devices host:2, 3 stages (uneven) = host:3.
# Without --cuts the processes cut the model as process 0 profiled it: that run must finish.
set -eu
exe=$1
dir=$2
shift 2
. "$(dirname "$0")/common.sh"
args="--layers 32,32,32,10 --epochs 2 --batch 100 --micro-batches 3 --json"  # uneven micro-batches

# same NAME ONE MANY DEVICES: MANY (the job) printed ONE's (one process) losses and accuracy, and DEVICES.
same() {
  cat "$3"
  for key in epoch_losses test_accuracy; do
    [ "$(field "$key" "$2")" = "$(field "$key" "$3")" ] ||
      fail "$1: $key $(field "$key" "$3") (expected one process's $(field "$key" "$2"), the same bits)"
  done
  [ "$(field devices "$3")" = "$4" ] || fail "$1: devices $(field devices "$3") (expected the world's, $4)"
  [ "$(field processes "$3")" = 2 ] || fail "$1: processes $(field processes "$3") (expected 2)"
}
run() {  # run NAME COMMAND...: its JSON in DIR/NAME.json
  name=$1
  shift
  "$@" >"$dir/$name.json" 2>"$dir/$name.log" || { cat "$dir/$name.log"; fail "$name: $*"; }
}

run one2 "$exe" --devices host:2 --stages 2 --schedule gpipe --cuts 0,4,7 $args
run two2 "$@" 2 "$exe" --devices host:1 --stages 2 --schedule gpipe --cuts 0,4,7 $args
same "2 processes x host:1, gpipe" "$dir/one2.json" "$dir/two2.json" '["p0:host:0", "p1:host:0"]'

run one4 "$exe" --devices host:4 --stages 2 --dp 2 --schedule 1f1b --cuts 0,2,7 $args
run two4 "$@" 2 "$exe" --devices host:2 --stages 2 --dp 2 --schedule 1f1b --cuts 0,2,7 $args
same "2 processes x host:2, 2 stages x 2 replicas" "$dir/one4.json" "$dir/two4.json" \
  '["p0:host:0", "p0:host:1", "p1:host:0", "p1:host:1"]'

cuts="--stages 3 --schedule 1f1b --cuts 0,2,4,7"
run one3 "$exe" --devices host:3 $cuts $args
run two3 "$@" 1 "$exe" --devices host:1 $cuts $args : "$np" 1 "$exe" --devices host:2 $cuts $args
same "host:1 + host:2, 3 stages" "$dir/one3.json" "$dir/two3.json" '["p0:host:0", "p1:host:0", "p1:host:1"]'

run planned "$@" 2 "$exe" --devices host:1 --stages 2 --layers 32,32,32,10 --epochs 1 --batch 100 --json
cat "$dir/planned.json"
echo "ok: 2 x host:1, 2 x host:2 (2 stages x 2 replicas) and host:1 + host:2 equal one process bit for bit"
