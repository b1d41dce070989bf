#!/usr/bin/env bash
# End-to-end check of train_pipeline: every schedule, and a 2 x 2 data x pipeline grid, must train
# the synthetic set to a set test accuracy, and --trace must write a timeline with every device's
# actions. Prints one line per run.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
build=${MGPU_BUILD_DIR:-build/release}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMGPU_BUILD_TESTS=OFF -DMGPU_BUILD_BENCH=OFF >/dev/null
cmake --build "$build" --target train_pipeline >/dev/null
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# check NAME ARGS...: runs train_pipeline --json --trace and checks accuracy and the trace.
check() {
  local name=$1
  shift
  "$build/examples/train_pipeline" --epochs 2 "$@" --json --trace "$work/trace.json" 2>"$work/log" >"$work/out" ||
    { cat "$work/log" >&2; echo "FAIL $name: train_pipeline failed" >&2; exit 1; }
  python3 - "$name" "$work/out" "$work/trace.json" <<'PY'
import json, sys
name, out, trace = sys.argv[1:]
m = json.load(open(out))
ranks = {e["pid"] for e in json.load(open(trace))["traceEvents"] if e.get("ph") == "X"}
ok = m["test_accuracy"] >= 0.9 and len(ranks) == m["stages"] * m["dp"]
print(f"{'ok  ' if ok else 'FAIL'} {name:<24} test_accuracy {m['test_accuracy']:.4f} (>= 0.9)  bubble simulated "
      f"{m['bubble_predicted']:.3f} measured {m['bubble_measured']:.3f}  {len(ranks)} ranks traced")
sys.exit(0 if ok else 1)
PY
}

check "layer-split, P=4" --schedule layer-split --stages 4 --micro-batches 1
check "gpipe, P=4 M=8" --schedule gpipe --stages 4 --micro-batches 8
check "1f1b, P=4 M=8" --schedule 1f1b --stages 4 --micro-batches 8
check "1f1b, speeds 1 and 0.5" --schedule 1f1b --stages 2 --micro-batches 4 --devices host:2@speed=1,0.5
check "interleaved, P=2 v=2 M=4" --schedule interleaved --stages 2 --chunks 2 --micro-batches 4
check "zb, P=4 M=8" --schedule zb --stages 4 --micro-batches 8
check "1f1b, 2 x 2 grid" --schedule 1f1b --stages 2 --micro-batches 4 --dp 2
