#!/usr/bin/env bash
# train_gpt --plan auto (plan::plan_gpt on costs measured on the devices; without --devices the
# machine's cores as host devices): the layout it runs is the
# plan's (the JSON's dp, tp, stages, zero, recompute and micro-batches against its "plan" field);
# with a budget per device (--device-memory) it drops the layouts the memory model says exceed it,
# the chosen one's predicted peak is within it and the measured peaks within it by the model's 10%;
# on 4 devices, a model of two heads, a large vocab and two rows per step, a budget that only data
# parallelism 2 x tensor parallelism 2 with ZeRO fits (the embedding's AdamW state sharded over the
# replicas) is planned and run so; a budget nothing fits is an out-of-memory error naming the
# smallest need; layout flags beside --plan are refused.
# Usage: plan_check.sh TRAIN_GPT TEXT_FILE
set -euo pipefail
exe=$1
text=$2
common=(--data "$text" --n-layer 3 --n-head 4 --n-embd 96 --block-size 48 --batch-size 6 --iters 2
        --eval-every 0 --eval-iters 1 --devices host:2 --plan auto)
# check_plan BUDGET_MIB EXPECT FLAGS...: train_gpt --plan auto with FLAGS (and --device-memory
# BUDGET_MIB unless 0) runs the planned layout within the budget; EXPECT "tp-zero": the choice and
# the runner-up are dp 2 x tp 2 with ZeRO.
check_plan() {
  local budget=$1 expect=$2 memory=()
  shift 2
  [ "$budget" -gt 0 ] && memory=(--device-memory "$budget")
  "$exe" "$@" "${memory[@]}" --json 2> /dev/null | python3 -c '
import json, sys
budget = int(sys.argv[1]) << 20
run = json.load(sys.stdin)
plan = run["plan"]
if plan is None:
    sys.exit("FAIL: no plan in the JSON")
ran = {"dp": run["dp"], "tp": run["tp"], "pp": run["stages"], "zero": run["zero"], "recompute": run["recompute"],
       "micro_batches": run["micro_batches"], "sequence_parallel": run["sequence_parallel"]}
for key, value in ran.items():
    if plan[key] != value:
        sys.exit(f"FAIL: the plan chose {key} {plan[key]}, the run used {value}")
fit, considered = plan["fit"], plan["considered"]
if not 1 <= fit <= considered:
    sys.exit(f"FAIL: {fit} of {considered} layouts fit")
if plan["runner_up"] is not None and plan["runner_up"]["predicted_step_s"] < plan["predicted_step_s"]:
    sys.exit("FAIL: the runner-up is predicted faster than the choice")
predicted, peaks = plan["predicted_peak_bytes"], run["peak_bytes"]
layout = ", ".join(f"{key} {plan[key]}" for key in ran)
step = plan["predicted_step_s"]
print(f"budget {budget >> 20} MiB: {fit} of {considered} layouts fit; chose {layout}: predicted {step * 1e3:.1f} ms, "
      f"peak {predicted / 1e6:.2f} MB; measured {[round(p / 1e6, 2) for p in peaks]} MB")
if budget > 0:
    if fit == considered:
        sys.exit("FAIL: every layout fits the budget (expected it to drop some)")
    if predicted > budget:
        sys.exit(f"FAIL: the chosen layout is predicted to need {predicted} bytes, over {budget}")
    if max(peaks) > 1.1 * budget:
        sys.exit(f"FAIL: measured peaks {peaks} exceed the budget {budget} by more than 10%")
if sys.argv[2] == "tp-zero":
    for which, chosen in (("choice", plan), ("runner-up", plan["runner_up"] or {})):
        if chosen.get("dp") != 2 or chosen.get("tp") != 2 or chosen.get("zero", 0) < 1:
            sys.exit(f"FAIL: the {which} {chosen} (expected dp 2 x tp 2 with ZeRO: only it fits the budget)")
' "$budget" "$expect"
}
check_plan 0 any "${common[@]}"
check_plan 6 any "${common[@]}"
check_plan 5 tp-zero --data "$text" --vocab 4096 --n-layer 1 --n-head 2 --n-embd 128 --block-size 16 --batch-size 2 \
  --iters 2 --eval-every 0 --eval-iters 1 --devices host:4 --plan auto
# Without --devices: the machine's cores as host devices.
"$exe" --data "$text" --n-layer 2 --n-head 4 --n-embd 32 --block-size 16 --batch-size 4 --iters 1 --eval-every 0 \
  --eval-iters 1 --plan auto --json 2> /dev/null | python3 -c '
import json, os, sys
run = json.load(sys.stdin)
devices = run["devices"]
if run["plan"] is None or len(devices) != os.cpu_count():
    sys.exit(f"FAIL: --plan auto without --devices ran on {devices} (expected {os.cpu_count()} host devices, a plan)")
'
expect_error() {  # expect_error TEXT FLAGS...: exit status 2 and TEXT in the message
  local want=$1 out
  shift
  if out=$("$exe" "${common[@]}" "$@" 2>&1); then
    echo "FAIL: $* succeeded (expected an error naming: $want)"
    exit 1
  fi
  grep -qF "$want" <<<"$out" || { echo "FAIL: $*: $out (expected: $want)"; exit 1; }
}
expect_error "none of 24 layouts over 2 devices fits 3145728 bytes per device (the smallest" --device-memory 3
expect_error "(expected no layout flags: the planner chooses them)" --dp 2
expect_error "no layout over 3 devices for 2 rows and n_head 4" --devices host:3 --batch-size 2
expect_error "(expected no layout flags: the planner chooses them)" --recompute full
echo "plan: the planner's layouts run as planned, within the budget"
