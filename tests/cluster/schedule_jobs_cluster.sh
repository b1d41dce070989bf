#!/usr/bin/env bash
# schedule_jobs end to end on the cluster formats: the synthetic cluster and pods written to files
# give the same fill table when read back (with the migration policies and the bound, which stays at
# or below every policy); replay runs on the files; malformed files fail with exit code 2 and a
# message naming the file and line. Usage: schedule_jobs_cluster.sh SCHEDULE_JOBS DIR
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
[ "$rows" -eq $((1 + 2 * 9 * 11 + 11)) ] ||
  fail "expected 209 CSV rows (2 tie rules x 9 policies x 11 points, and the bound's 11), got $((rows - 1))"
for policy in random first-fit best-fit worst-fit dot-product gpu-packing fgd best-fit+migration fgd+migration bound; do
  grep -q "^$policy " "$dir/files.txt" || fail "no $policy row in the fill table"
done
grep -q "gap to bound@100%" "$dir/files.txt" || fail "no gap to the bound in the fill table"
grep -q "^experiment: .* s (every policy and the bound)" "$dir/files.txt" || fail "no experiment time"
# The bound at or below every policy at every point, and the moves within 5 per 100 pods
# (columns: policy,tie,arrived,...,unallocated=5,pods=8,...,moves=11,gpu_seconds_lost=12).
awk -F, 'NR > 1 && $1 == "bound" { bound[$3] = $5 }
         NR > 1 && $1 != "bound" { unallocated[NR] = $5; at[NR] = $3; who[NR] = $1 }
         NR > 1 && $11 > 5 * $8 / 100 { print "over the cap: " $0; bad = 1 }
         END { for (r in at) if (unallocated[r] < bound[at[r]] - 1e-9) { print who[r] " below the bound at " at[r]; bad = 1 }
               exit bad }' "$dir/files.csv" || fail "the bound or the cap"
awk -F, '$1 == "fgd+migration" && $11 > 0 { found = 1 } END { exit !found }' "$dir/files.csv" ||
  fail "fgd+migration made no move on the synthetic trace"

# The exact bound on a small cluster, beside one migration policy; migration is for the fill only.
"$exe" --synthetic-nodes 3 --synthetic-pods 60 --seed 5 --policy fgd+migration --bound exact --max-arrived 1.2 \
  --step 0.2 --migration-cap 10 --migration-every 0 --csv "$dir/exact.csv" > "$dir/exact.txt"
grep -q "the exact integer program" "$dir/exact.txt" || fail "the exact bound not named"
[ "$(grep -c '^bound,' "$dir/exact.csv")" -eq 6 ] || fail "expected 6 bound rows"

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
expect_error "expected migration in the fill experiment only" --synthetic-nodes 10 --synthetic-pods 10 \
  --experiment replay --policy fgd+migration
echo "schedule_jobs cluster formats: ok"
