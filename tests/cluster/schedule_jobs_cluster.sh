#!/usr/bin/env bash
# schedule_jobs end to end on the cluster formats: the synthetic cluster and pods written to files
# give the same fill table when read back; replay runs on the files; malformed files fail with
# exit code 2 and a message naming the file and line. Usage: schedule_jobs_cluster.sh SCHEDULE_JOBS DIR
set -euo pipefail
exe=$1
dir=$2
rm -rf "$dir" && mkdir -p "$dir"
fail() { echo "FAIL: $*" >&2; exit 1; }

"$exe" --synthetic-nodes 60 --synthetic-pods 600 --seed 3 --experiment fill --max-arrived 1.1 --step 0.1 \
  --tie first --tie random --write-nodes "$dir/nodes.csv" --write-pods "$dir/pods.csv" --csv "$dir/synthetic.csv" > "$dir/synthetic.txt"
"$exe" --nodes "$dir/nodes.csv" --pods "$dir/pods.csv" --seed 3 --experiment fill --max-arrived 1.1 --step 0.1 \
  --tie first --tie random --csv "$dir/files.csv" > "$dir/files.txt"
cmp "$dir/synthetic.csv" "$dir/files.csv" || fail "the fill differs between the synthetic pods and the same pods read from files"
rows=$(wc -l < "$dir/files.csv")
[ "$rows" -eq $((1 + 2 * 7 * 11)) ] || fail "expected 154 CSV rows (2 tie rules x 7 policies x 11 points), got $((rows - 1))"
for policy in random first-fit best-fit worst-fit dot-product gpu-packing fgd; do
  grep -q "^$policy " "$dir/files.txt" || fail "no $policy row in the fill table"
done

"$exe" --nodes "$dir/nodes.csv" --pods "$dir/pods.csv" --experiment replay --policy fgd --policy best-fit --csv "$dir/replay.csv" > "$dir/replay.txt"
[ "$(wc -l < "$dir/replay.csv")" -eq 3 ] || fail "expected two replay rows"
grep -q "^fgd" "$dir/replay.txt" || fail "no fgd row in the replay table"

# The target workload and tie options reach the fill (a narrower target changes FGD's choices).
"$exe" --nodes "$dir/nodes.csv" --pods "$dir/pods.csv" --seed 3 --policy fgd --tie packed --max-arrived 1.1 --step 0.1 \
  --target-coverage 0.5 --target-gpu-only --csv "$dir/narrow.csv" > "$dir/narrow.txt"
grep -q "pod types (by GPU demand and model only) covering 50% of the pods" "$dir/narrow.txt" || fail "target options not shown"
grep -q "^fgd,packed," "$dir/narrow.csv" || fail "no fgd/packed rows"

# A load test: arrivals 1000 times closer on a small cluster make pods wait.
"$exe" --synthetic-nodes 20 --synthetic-pods 600 --seed 3 --experiment replay --policy fgd --arrival-speedup 1000 \
  --csv "$dir/loaded.csv" > /dev/null
awk -F, 'NR == 2 && !($4 > 0 && $9 > 0) { exit 1 }' "$dir/loaded.csv" || fail "expected waits under compressed arrivals"

# The published trace's column names for nodes, through the mapping.
sed '1s/.*/sn,cpu_milli,memory_mib,gpu,model/' "$dir/nodes.csv" > "$dir/nodes_mapped.csv"
"$exe" --nodes "$dir/nodes_mapped.csv" --node-column name=sn --node-column gpus=gpu --pods "$dir/pods.csv" \
  --policy fgd --max-arrived 0.5 > /dev/null || fail "mapped node columns"

expect_error() {  # expect_error TEXT ARGS...: exit code 2 and TEXT on stderr
  local text=$1
  shift
  set +e
  "$exe" "$@" > /dev/null 2> "$dir/stderr.txt"
  local rc=$?
  set -e
  [ "$rc" -eq 2 ] || fail "expected exit code 2 from $*, got $rc"
  grep -qF -- "$text" "$dir/stderr.txt" || fail "expected '$text' in: $(cat "$dir/stderr.txt")"
}
{ head -n 3 "$dir/pods.csv"; echo "bad,1000,100,1,500,A100,LS,0,5"; } > "$dir/unknown_model.csv"
expect_error "unknown_model.csv:4): GPU model 'A100' is not in the cluster" --nodes "$dir/nodes.csv" --pods "$dir/unknown_model.csv"
{ head -n 2 "$dir/pods.csv"; echo "bad,1000,100,1,x,,LS,0,5"; } > "$dir/malformed.csv"
expect_error "malformed.csv:3: column 'gpu_milli' is 'x'" --nodes "$dir/nodes.csv" --pods "$dir/malformed.csv"
{ head -n 2 "$dir/pods.csv"; echo "huge,1000,100,64,1000,,LS,0,5"; } > "$dir/impossible.csv"
expect_error "impossible.csv:3): 1000 milli-CPU, 100 MiB and 64 GPUs fit no node" --nodes "$dir/nodes.csv" --pods "$dir/impossible.csv"
expect_error "no placement policy named 'tetris'" --synthetic-nodes 10 --synthetic-pods 10 --policy tetris
echo "schedule_jobs cluster formats: ok"
