#!/bin/sh
# mgpu::dist under Slurm (ctest's dist_slurm): in a one-node cluster that slurm_cluster.sh starts
# on this machine (and stops; exit 77, skipped, with the reason where it cannot),
#   slurm.sh MPI_DIST TRAIN_MLP TRAIN_PIPELINE TRAIN_GPT TEXT_FILE DIR MPIRUN... NUMPROC_FLAG
# runs, each under srun --mpi=pmix against one process or mpirun:
# - plain srun (MpiDefault=none) fails inside MPI_Init: Debian's OpenMPI speaks PMIx only;
# - every collective (mpi_dist collectives) across 2 tasks of 1 + 2 and 2 + 2 host devices and 3
#   tasks of 2 + 1 + 2 and 1 + 1 + 1 (--overcommit: more tasks than this machine's CPUs);
# - train_mlp, 2 tasks x host:1 = host:2 bit for bit (epoch losses, test accuracy), and its
#   checkpoint (a folder of a shard per process) saved under srun after epoch 1 resumed under
#   mpirun, and one saved under mpirun resumed under srun, both ending with the uninterrupted run's
#   bits;
# - train_pipeline, 2 stages in 2 tasks = host:2, and 2 stages x 2 replicas over 2 tasks x host:2
#   = host:4, bit for bit;
# - train_gpt in every layout of train_gpt_check.sh (data parallel, ZeRO-3, pipelined, data x
#   pipeline, tensor parallel, data x tensor, tensor x pipeline) = one process, and pipelined with
#   a checkpoint saved under srun at step 10 and resumed under mpirun (and the reverse), with the
#   uninterrupted run's losses;
# - a task killed mid-training, even without --kill-on-bad-exit: the step ends non-zero within the
#   deadline (MGPU_COMM_TIMEOUT=5) of the kill (Slurm's PMIx plugin cancels it once a task dies,
#   sooner than the deadline); a task that stalls (mpi_dist stall): the other fails naming it within
#   its deadline, and --kill-on-bad-exit ends the step; a task that exits before MPI_Init ends the
#   step at once under --kill-on-bad-exit (without it the others would wait in MPI_Init);
# - sbatch --wait of a 2-task job script that runs train_mlp through srun and writes its JSON:
#   host:2's bits.
# Every srun is under `timeout`, so a job that never starts fails the test instead of hanging it.
# shellcheck disable=SC2086  # $srun, $mpirun and the argument lists are split into words
set -eu
if [ "${1:-}" != "--cases" ]; then
  exec sh "$(dirname "$0")/slurm_cluster.sh" sh "$0" --cases "$@"
fi
shift
here=$(cd "$(dirname "$0")" && pwd)
mpi_dist=$1 mlp=$2 pipeline=$3 gpt=$4 text=$5 dir=$6
shift 6
. "$here/common.sh"
mpirun="$*"  # MPIRUN... NUMPROC_FLAG: `$mpirun 2 PROGRAM` starts 2 processes
srun="timeout 120 srun --mpi=pmix --kill-on-bad-exit=1"
start=$(date +%s)
step() { echo "== slurm [$(($(date +%s) - start)) s]: $*"; }

step "plain srun (no --mpi=pmix) fails inside MPI_Init"
if timeout 60 srun -n 2 "$mpi_dist" collectives 1,1 >"$dir/plain.log" 2>&1; then
  cat "$dir/plain.log"
  fail "srun without --mpi=pmix passed (expected OpenMPI to fail in MPI_Init)"
fi
grep -q "MPI_Init" "$dir/plain.log" || { cat "$dir/plain.log"; fail "srun without --mpi=pmix: no MPI_Init in the output"; }

for counts in 1,2 2,2 2,1,2 1,1,1; do
  tasks=$(echo "$counts" | tr ',' '\n' | wc -l)
  overcommit=""
  [ "$tasks" -gt "$MGPU_SLURM_CPUS" ] && overcommit=--overcommit
  step "srun -n $tasks $overcommit mpi_dist collectives $counts"
  $srun -n "$tasks" $overcommit "$mpi_dist" collectives "$counts" >"$dir/collectives_$counts.log" 2>&1 ||
    { cat "$dir/collectives_$counts.log"; fail "srun -n $tasks mpi_dist collectives $counts"; }
  grep -q "launcher slurm, $tasks processes" "$dir/collectives_$counts.log" ||
    { cat "$dir/collectives_$counts.log"; fail "collectives $counts: not launched by Slurm"; }
  [ "$(grep -c "checks passed" "$dir/collectives_$counts.log")" -eq "$tasks" ] ||
    { cat "$dir/collectives_$counts.log"; fail "collectives $counts: not every task passed"; }
done

# same NAME ONE JOB KEYS...: the job's JSON has one process's KEYS, and 2 processes.
same() {
  name=$1 one=$2 job=$3
  shift 3
  cat "$job"
  for key; do
    [ "$(field "$key" "$one")" = "$(field "$key" "$job")" ] ||
      fail "$name: $key $(field "$key" "$job") (expected $(field "$key" "$one") as in $one)"
  done
  [ "$(field processes "$job")" = 2 ] || fail "$name: processes $(field processes "$job") (expected 2)"
}
run() {  # run NAME COMMAND...: its JSON in DIR/NAME.json
  name=$1
  shift
  "$@" >"$dir/$name.json" 2>"$dir/$name.log" || { cat "$dir/$name.log"; fail "$name: $*"; }
}
last() { field epoch_losses "$1" | sed -E 's/.*, *//; s/[][]//g'; }
# resumed NAME RUN UNINTERRUPTED: train_mlp's RUN ended with UNINTERRUPTED's last epoch loss and accuracy bits.
resumed() {
  cat "$2"
  [ "$(last "$2") $(field test_accuracy "$2")" = "$(last "$3") $(field test_accuracy "$3")" ] ||
    fail "$1: last epoch loss and accuracy $(last "$2") $(field test_accuracy "$2") (expected the uninterrupted run's $(last "$3") $(field test_accuracy "$3"))"
}

args="--layers 32,10 --epochs 2 --batch 49 --json"  # odd batches: the tasks get unequal rows
mlp_args=$args
step "train_mlp: srun -n 2 --devices host:1 = --devices host:2"
run mlp.one "$mlp" --devices host:2 $args
run mlp.srun $srun -n 2 "$mlp" --devices host:1 $args
same "srun -n 2 train_mlp" "$dir/mlp.one.json" "$dir/mlp.srun.json" epoch_losses test_accuracy
[ "$(field devices "$dir/mlp.srun.json")" = '["p0:host:0", "p1:host:0"]' ] || fail "devices $(field devices "$dir/mlp.srun.json") (expected the world's)"
step "train_mlp: a checkpoint saved under srun resumed under mpirun, and the reverse"
run mlp.srun-half $srun -n 2 "$mlp" --devices host:1 $args --checkpoint "$dir/mlp.srun.ckpt" --until-epoch 1
run mlp.mpirun-resumed $mpirun 2 "$mlp" --devices host:1 $args --checkpoint "$dir/mlp.srun.ckpt" --resume
resumed "saved under srun, resumed under mpirun" "$dir/mlp.mpirun-resumed.json" "$dir/mlp.srun.json"
run mlp.mpirun-half $mpirun 2 "$mlp" --devices host:1 $args --checkpoint "$dir/mlp.mpirun.ckpt" --until-epoch 1
run mlp.srun-resumed $srun -n 2 "$mlp" --devices host:1 $args --checkpoint "$dir/mlp.mpirun.ckpt" --resume
resumed "saved under mpirun, resumed under srun" "$dir/mlp.srun-resumed.json" "$dir/mlp.srun.json"

args="--layers 32,32,32,10 --epochs 2 --batch 100 --micro-batches 3 --json"
step "train_pipeline: srun -n 2, a stage per task = host:2; 2 stages x 2 replicas over 2 tasks x host:2 = host:4"
run pipeline.one2 "$pipeline" --devices host:2 --stages 2 --schedule gpipe --cuts 0,4,7 $args
run pipeline.srun2 $srun -n 2 "$pipeline" --devices host:1 --stages 2 --schedule gpipe --cuts 0,4,7 $args
same "srun -n 2 train_pipeline --stages 2" "$dir/pipeline.one2.json" "$dir/pipeline.srun2.json" epoch_losses test_accuracy
run pipeline.one4 "$pipeline" --devices host:4 --stages 2 --dp 2 --schedule 1f1b --cuts 0,2,7 $args
run pipeline.srun4 $srun -n 2 "$pipeline" --devices host:2 --stages 2 --dp 2 --schedule 1f1b --cuts 0,2,7 $args
same "srun -n 2 train_pipeline --devices host:2 --stages 2 --dp 2" "$dir/pipeline.one4.json" "$dir/pipeline.srun4.json" \
  epoch_losses test_accuracy

step "train_gpt: every layout of train_gpt_check.sh under srun -n 2"
# shellcheck disable=SC2086
sh "$here/train_gpt_check.sh" "$gpt" "$text" "$dir/gpt" $srun -n

step "train_gpt: a pipelined checkpoint saved under srun resumed under mpirun, and the reverse"
common="--data $text --n-layer 2 --n-head 2 --n-embd 32 --block-size 16 --batch-size 4 --lr 3e-3 --warmup 5
        --eval-iters 4 --eval-every 0 --seed 7 --iters 20 --json --devices host:1 --stages 2"
run gpt.srun $srun -n 2 "$gpt" $common
run gpt.srun-half $srun -n 2 "$gpt" $common --checkpoint "$dir/gpt.srun.ckpt" --until-step 10
run gpt.mpirun-resumed $mpirun 2 "$gpt" $common --checkpoint "$dir/gpt.srun.ckpt" --resume
run gpt.mpirun-half $mpirun 2 "$gpt" $common --checkpoint "$dir/gpt.mpirun.ckpt" --until-step 10
run gpt.srun-resumed $srun -n 2 "$gpt" $common --checkpoint "$dir/gpt.mpirun.ckpt" --resume
for name in gpt.mpirun-resumed gpt.srun-resumed; do
  grep -q "resumed from .* at step 10" "$dir/$name.log" || { cat "$dir/$name.log"; fail "$name: did not resume at step 10"; }
  same "$name" "$dir/gpt.srun.json" "$dir/$name.json" train_loss val_loss
done

step "a task killed mid-training (no --kill-on-bad-exit): the step ends non-zero within the deadline"
MGPU_COMM_TIMEOUT=5 sh "$here/expect_failure.sh" "srun: error: [^ ]+: task 1: Killed" \
  -- sh "$here/kill_process.sh" 1 "^epoch 1/" timeout 120 srun --mpi=pmix -n 2 \
  -- "$mlp" --devices host:1 --layers 32,10 --batch 500 --epochs 100000 >"$dir/kill.log" 2>&1 ||
  { cat "$dir/kill.log"; fail "a task killed mid-training"; }
cat "$dir/kill.log"
after=$(sed -n 's/^process 1 was killed \([0-9]*\) s before the job ended$/\1/p' "$dir/kill.log")
if [ -z "$after" ] || [ "$after" -gt 5 ]; then
  fail "the step ended ${after:-?} s after the kill (expected within the 5 s deadline)"
fi
step "a task that stalls: the other fails naming it within the deadline, and --kill-on-bad-exit ends the step"
sh "$here/expect_failure.sh" \
  "rank [0-1] all_reduce #[0-9]+ waited [0-9.]+ s for process 1 \(host [^,]+, ranks 2-3\), not heard from" \
  -- $srun -n 2 "$mpi_dist" stall 2,2 1 >"$dir/stall.log" 2>&1 || { cat "$dir/stall.log"; fail "a task that stalls"; }
cat "$dir/stall.log"
step "a task that exits before MPI_Init ends the job at once under --kill-on-bad-exit"
begin=$(date +%s)
# shellcheck disable=SC2016  # $SLURM_PROCID and $@ are the task's
if timeout 60 srun --mpi=pmix --kill-on-bad-exit=1 -n 2 \
  sh -c '[ "$SLURM_PROCID" = 1 ] && exit 3; exec "$@"' sh "$mlp" --devices host:1 $mlp_args >"$dir/early.log" 2>&1; then
  cat "$dir/early.log"
  fail "a task exited with status 3 and srun with 0"
fi
[ $(($(date +%s) - begin)) -le 20 ] || { cat "$dir/early.log"; fail "the job took $(($(date +%s) - begin)) s to end (expected at once)"; }

step "sbatch --wait of a 2-task job script that trains and writes its JSON"
cat >"$dir/job.sh" <<EOF
#!/bin/sh
#SBATCH --ntasks=2
#SBATCH --output=$dir/job.out
srun --mpi=pmix --kill-on-bad-exit=1 "$mlp" --devices host:1 $mlp_args >"$dir/job.json"
EOF
timeout 120 sbatch --wait "$dir/job.sh" >"$dir/sbatch.log" 2>&1 ||
  { cat "$dir/sbatch.log" "$dir/job.out"; fail "sbatch --wait job.sh"; }
cat "$dir/sbatch.log"
same "sbatch job.sh" "$dir/mlp.one.json" "$dir/job.json" epoch_losses test_accuracy
step "done"
echo "ok: under srun --mpi=pmix, every collective over 2 and 3 tasks, train_mlp, train_pipeline and train_gpt equal one process; checkpoints move between srun and mpirun; a killed task is reported within the deadline; sbatch runs a job"
