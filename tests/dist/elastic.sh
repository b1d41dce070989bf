#!/bin/sh
# An elastic restart (ctest's dist_torchrun_elastic):
#   elastic.sh TRAIN_GPT TEXT_FILE DIR MGPU_RUN
# train_gpt, data parallel over 4 torchrun-style processes of host:1 each with --checkpoint (saved
# at every evaluation), loses process 3 (SIGKILL) once the first checkpoint is there; mgpu-run
# --max-restarts 1 --restart-nproc 2 ends the others (one that saw process 3's connections close
# first names it) and starts the job again on 2 processes,
# which --resume from the checkpoint: the restart resumes mid-run and ends with the uninterrupted
# 4-process run's train and validation losses within float32 tolerance (the 2 processes sum the
# same gradients in another order).
set -eu
exe=$1
text=$2
dir=$3
run=$4
rm -rf "$dir" && mkdir -p "$dir"
fail() { echo "FAIL: $*" >&2; exit 1; }
field() { sed -E "s/.*\"$1\": (\[[^]]*\]|[^,}]*).*/\1/" "$2"; }
common="--data $text --n-layer 1 --n-head 2 --n-embd 16 --block-size 8 --batch-size 8 --lr 3e-3 --warmup 2"
common="$common --dropout 0 --eval-iters 2 --eval-every 4 --seed 7 --iters 16 --json --devices host:1"

# shellcheck disable=SC2086
"$run" --nproc 4 "$exe" $common >"$dir/whole.json" 2>"$dir/whole.log" || { cat "$dir/whole.log"; fail "4 processes, uninterrupted"; }

# The job each process runs: on the first attempt process 3 is killed once a checkpoint exists.
cat >"$dir/job.sh" <<EOF
#!/bin/sh
if [ "\$TORCHELASTIC_RESTART_COUNT" = 0 ] && [ "\$RANK" = 3 ]; then
  "$exe" $common --checkpoint "$dir/ckpt" --resume &
  pid=\$!
  while [ ! -f "$dir/ckpt/manifest.ckpt" ] && kill -0 \$pid 2>/dev/null; do sleep 0.02; done
  kill -9 \$pid
  touch "$dir/killed"
  wait \$pid
  exit \$?
fi
exec "$exe" $common --checkpoint "$dir/ckpt" --resume
EOF
status=0
"$run" --nproc 4 --max-restarts 1 --restart-nproc 2 --grace 5 -- sh "$dir/job.sh" >"$dir/elastic.json" 2>"$dir/elastic.log" ||
  status=$?
cat "$dir/elastic.log"
[ "$status" = 0 ] || fail "the elastic job exited with status $status (expected 0 after one restart)"
[ -f "$dir/killed" ] || fail "process 3 was not killed"
# mgpu-run ends the others as soon as process 3 is gone; one that saw the broken connection first
# names it (dist_torchrun_fault_exit checks that naming on its own).
if grep -q "train_gpt: communication: " "$dir/elastic.log"; then
  grep -Eq "train_gpt: communication: .* process 3 \(host [^,]+, rank 3\) broke its connection" "$dir/elastic.log" ||
    fail "a process failed without naming process 3 when it was killed"
fi
grep -q "mgpu-run: restart 1 of 1 on 2 process(es)" "$dir/elastic.log" || fail "no restart on 2 processes"
grep -Eq "resumed from .* at step (4|8|12)" "$dir/elastic.log" || fail "the restart did not resume mid-run"
cat "$dir/whole.json" "$dir/elastic.json"
[ "$(field processes "$dir/elastic.json")" = 2 ] || fail "processes $(field processes "$dir/elastic.json") after the restart (expected 2)"
for key in train_loss val_loss; do
  a=$(field "$key" "$dir/whole.json") b=$(field "$key" "$dir/elastic.json")
  awk -v a="$a" -v b="$b" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(d <= 2e-4 * (a < 0 ? -a : a) + 1e-6) }' ||
    fail "$key $b after the restart on 2 processes (expected the uninterrupted run's $a within 2e-4)"
done
echo "ok: killed on 4 processes, restarted on 2 from the checkpoint, the losses of the uninterrupted run"
