#!/usr/bin/env bash
# Trains the nanoGPT CPU config (train_gpt's defaults: 4 layers, 128 wide, 4 heads, block 64,
# batch 12, AdamW 1e-3 cosine to 1e-4 after 100 warm-up steps, clipping at 1) for ITERS steps
# (default 2000) on the Shakespeare shards of scripts/example-data.sh, with train_gpt on one host
# device and with its PyTorch peer (scripts/gpt_peer.py --train: the same model, schedule and
# validation loss definition, its own seeded windows), for each seed of SEEDS (default "1 2 3"),
# in turn. Prints each run's validation loss (train_gpt --eval-only's definition: the first 600
# windows of the validation split), each program's mean and spread over seeds, and the difference
# of the means. Writes $OUT/gpt-val-compare.jsonl (default OUT=build/gpt-val-compare).
#   scripts/gpt-val-compare.sh
#   ITERS=500 SEEDS="1 2" scripts/gpt-val-compare.sh
set -euo pipefail
cd "$(dirname "$0")/.."
iters=${ITERS:-2000}
seeds=${SEEDS:-1 2 3}
out=${OUT:-build/gpt-val-compare}
build=${MGPU_BUILD_DIR:-build/release}
data=build/data/shakespeare
mkdir -p "$out"
scripts/setup.sh
[ -f "$data/train.bin" ] || scripts/example-data.sh >&2
fresh=()
[ -f "$build/CMakeCache.txt" ] || fresh=(-DMGPU_BUILD_TESTS=OFF -DMGPU_BUILD_BENCH=OFF)
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMGPU_NATIVE=ON -DMGPU_BUILD_EXAMPLES=ON "${fresh[@]}" >/dev/null
cmake --build "$build" --target train_gpt
py=$(scripts/venv.sh gpt_peer)
runs="$out/gpt-val-compare.jsonl"
: >"$runs"
for seed in $seeds; do
  echo "== seed $seed: train_gpt" >&2
  "$build/examples/train_gpt" --data "$data" --iters "$iters" --seed "$seed" --eval-every 0 --json 2>/dev/null |
    "$py" -c "import json,sys; r=json.loads(sys.stdin.read()); r.update(program='mgpu', seed=$seed); print(json.dumps(r))" >>"$runs"
  echo "== seed $seed: PyTorch" >&2
  "$py" scripts/gpt_peer.py --train "$data" --iters "$iters" --seed "$seed" --threads 1 >>"$runs"
done
"$py" - "$runs" <<'PY'
import json, statistics, sys
runs = [json.loads(line) for line in open(sys.argv[1])]
means = {}
for program in ("mgpu", "pytorch"):
    losses = [r["val_loss"] for r in runs if r["program"] == program]
    for r in runs:
        if r["program"] == program:
            print(f"{program:8} seed {r['seed']}: val loss {r['val_loss']:.4f}  ({r['tokens_per_s']:.0f} tokens/s)")
    means[program] = statistics.mean(losses)
    spread = statistics.stdev(losses) if len(losses) > 1 else float("nan")
    print(f"{program:8} mean {means[program]:.4f}, standard deviation over seeds {spread:.4f}")
print(f"mgpu - PyTorch: {means['mgpu'] - means['pytorch']:+.4f}")
PY
