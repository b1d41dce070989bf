#!/usr/bin/env bash
# End-to-end check of train_mlp as a user runs it: real CSV and IDX datasets (scripts/example-data.sh)
# must reach set test accuracies, 16-bit precisions must train, and a run stopped and resumed from
# its checkpoint must end exactly where an uninterrupted run ends. Prints one line per run.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
build=${MGPU_BUILD_DIR:-build/release}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMGPU_BUILD_TESTS=OFF -DMGPU_BUILD_BENCH=OFF >/dev/null
cmake --build "$build" --target train_mlp >/dev/null
data=build/data
scripts/example-data.sh "$data" >/dev/null
train=("$build/examples/train_mlp" --devices "${MGPU_DEVICES:-host:1}")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# check NAME MIN_ACCURACY ARGS...: runs train_mlp --json and compares test_accuracy.
check() {
  local name=$1 min=$2
  shift 2
  "${train[@]}" "$@" --json 2>"$work/log" >"$work/out" || { cat "$work/log" >&2; echo "FAIL $name: train_mlp failed" >&2; exit 1; }
  python3 - "$name" "$min" "$work/out" <<'PY'
import json, sys
name, minimum, path = sys.argv[1], float(sys.argv[2]), sys.argv[3]
m = json.load(open(path))
ok = m["test_accuracy"] >= minimum
print(f"{'ok  ' if ok else 'FAIL'} {name:<28} test_accuracy {m['test_accuracy']:.4f} (>= {minimum})  "
      f"train_loss {m['train_loss']:.4f}  {m['samples_per_s']:.0f} samples/s  {m['precision']}")
sys.exit(0 if ok else 1)
PY
}

check "iris.csv" 0.93 --data "csv:$data/iris.csv" --layers 16,3 --epochs 60 --batch 16
check "wine_data.csv" 0.9 --data "csv:$data/wine_data.csv" --layers 32,3 --epochs 60 --batch 16
check "breast_cancer.csv" 0.9 --data "csv:$data/breast_cancer.csv" --layers 32,2 --epochs 40 --batch 16
check "digits (IDX)" 0.95 --data "idx:$data/digits-images-idx3-ubyte,$data/digits-labels-idx1-ubyte" --layers 64,10 --epochs 30 --batch 32
check "MNIST 5k (IDX)" 0.9 --data "idx:$data/mnist-5k-images-idx3-ubyte,$data/mnist-5k-labels-idx1-ubyte" --layers 128,10 --epochs 20 --optimizer adamw
check "synthetic, bf16" 0.95 --epochs 3 --precision bf16
check "synthetic, fp16 + scaling" 0.95 --epochs 3 --precision fp16 --optimizer adamw

# Resume: 2 of 4 epochs, then --resume, must equal 4 epochs in one go.
"${train[@]}" --epochs 4 --json 2>/dev/null | python3 -c 'import json,sys; m=json.load(sys.stdin); print(m["train_loss"], m["test_accuracy"])' >"$work/straight"
"${train[@]}" --epochs 4 --until-epoch 2 --checkpoint "$work/run.ckpt" --json >/dev/null 2>&1
"${train[@]}" --epochs 4 --checkpoint "$work/run.ckpt" --resume --json 2>/dev/null |
  python3 -c 'import json,sys; m=json.load(sys.stdin); print(m["train_loss"], m["test_accuracy"])' >"$work/resumed"
if cmp -s "$work/straight" "$work/resumed"; then
  echo "ok   resume after epoch 2 of 4        ends at $(cat "$work/resumed") like the uninterrupted run"
else
  echo "FAIL resume: uninterrupted $(cat "$work/straight"), resumed $(cat "$work/resumed")" >&2
  exit 1
fi

# Data parallel: the same run on host:2 ends where host:1 ends (exact gradients for any sharding).
bin="$build/examples/train_mlp"
mnist=(--data "idx:$data/mnist-5k-images-idx3-ubyte,$data/mnist-5k-labels-idx1-ubyte" --layers 128,10 --epochs 3 --json)
"$bin" --devices host:1 "${mnist[@]}" 2>/dev/null >"$work/dp1"
"$bin" --devices host:2 "${mnist[@]}" 2>/dev/null >"$work/dp2"
python3 - "$work/dp1" "$work/dp2" <<'PY'
import json, sys
one, two = (json.load(open(p)) for p in sys.argv[1:3])
ok = abs(one["test_accuracy"] - two["test_accuracy"]) <= 0.005 and abs(one["train_loss"] - two["train_loss"]) <= 1e-3 * max(1, one["train_loss"])
print(f"{'ok  ' if ok else 'FAIL'} data parallel host:2 vs host:1  test_accuracy {two['test_accuracy']:.4f} vs {one['test_accuracy']:.4f}, "
      f"train_loss {two['train_loss']:.5f} vs {one['train_loss']:.5f}, {two['samples_per_s']:.0f} vs {one['samples_per_s']:.0f} samples/s")
sys.exit(0 if ok else 1)
PY

# A checkpoint written on 2 devices resumes on 3.
"$bin" --devices host:2 --epochs 4 --until-epoch 2 --checkpoint "$work/dp.ckpt" --json >/dev/null 2>&1
"$bin" --devices host:3 --epochs 4 --checkpoint "$work/dp.ckpt" --resume --json 2>/dev/null >"$work/dp3"
python3 -c 'import json,sys; m=json.load(open(sys.argv[1])); ok=m["test_accuracy"]>=0.95 and m["steps"]>0; print(("ok  " if ok else "FAIL")+" resume on host:3 from host:2      test_accuracy %.4f" % m["test_accuracy"]); sys.exit(0 if ok else 1)' "$work/dp3"

# --resume with a missing checkpoint is an error, not a silent fresh start.
if "$bin" --devices host:1 --resume --checkpoint "$work/missing.ckpt" >/dev/null 2>"$work/err"; then
  echo "FAIL --resume with a missing checkpoint started fresh" >&2
  exit 1
fi
grep -q "no checkpoint at" "$work/err" && echo "ok   --resume with a missing checkpoint fails: $(tail -1 "$work/err")"
