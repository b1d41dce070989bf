#!/bin/sh
# scripts/mgpu-run's own behaviour (ctest's dist_mgpu_run):
#   mgpu_run.sh MGPU_RUN
# - SIGTERM to mgpu-run reaches every process (each says so and exits 5), and mgpu-run exits with
#   that status;
# - a process failing on the first attempt ends it, and --max-restarts 1 --nproc-hook starts the job
#   again on as many processes as the hook prints (3), each with WORLD_SIZE 3 and
#   TORCHELASTIC_RESTART_COUNT 1, and mgpu-run exits 0;
# - with no restart left it exits with the failed process's status, naming it.
set -u
run=$1
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

"$run" --nproc 2 sh -c 'trap "echo got TERM \$RANK; exit 5" TERM; touch "$0/up$RANK"; while :; do sleep 0.05; done' "$dir" \
  >"$dir/signals.log" 2>&1 &
pid=$!
waited=0
while { [ ! -f "$dir/up0" ] || [ ! -f "$dir/up1" ]; } && [ "$waited" -lt 200 ]; do sleep 0.05; waited=$((waited + 1)); done
kill -TERM "$pid"
wait "$pid"
status=$?
cat "$dir/signals.log"
[ "$status" = 5 ] || fail "mgpu-run exited with status $status after SIGTERM (expected its processes' 5)"
grep -q "got TERM 0" "$dir/signals.log" && grep -q "got TERM 1" "$dir/signals.log" || fail "SIGTERM did not reach both processes"

"$run" --nproc 2 --max-restarts 1 --nproc-hook 'echo 3' \
  sh -c '[ "$TORCHELASTIC_RESTART_COUNT" = 1 ] || exit 4; echo "rank $RANK of $WORLD_SIZE"' >"$dir/hook.log" 2>&1
status=$?
cat "$dir/hook.log"
[ "$status" = 0 ] || fail "the restarted job exited with status $status (expected 0)"
[ "$(grep -c "of 3$" "$dir/hook.log")" = 3 ] || fail "the restart did not run 3 processes of WORLD_SIZE 3"
grep -q "mgpu-run: restart 1 of 1 on 3 process(es)" "$dir/hook.log" || fail "no restart on 3 processes"

"$run" --nproc 2 sh -c 'exit $((RANK + 6))' >"$dir/none.log" 2>&1
status=$?
cat "$dir/none.log"
[ "$status" = 6 ] || [ "$status" = 7 ] || fail "mgpu-run exited with status $status (expected a failed process's, 6 or 7)"
grep -Eq "mgpu-run: process [01] exited with status [67]" "$dir/none.log" || fail "the failed process was not named"
echo "ok: signals forwarded, a restart resized by the hook, a failure's status passed on"
