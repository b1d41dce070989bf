#!/usr/bin/env bash
# The memory model (parallel::predict_gpt_memory) against the allocator: train_gpt --json's
# predicted_peak_bytes within 10% of each device's measured peak_bytes over a training step (the
# larger of two: AdamW makes its state in the first step's update, once the activations are gone),
# in every layout the model covers: one device with each recomputation mode and with dropout, data
# parallel with the replicated update, ZeRO-1 (uneven rows over host:3, full recomputation),
# ZeRO-2 and ZeRO-3 (a bucket per block; ZeRO-3's default units), tensor parallel over 2 and 4 devices (selective and full
# recomputation), two data-parallel replicas of tensor parallelism, sequence parallelism (over 2
# and 4 devices, with replicas, selective and full recomputation), 1F1B and GPipe pipelines
# (uneven micro-batches of 6 rows in 4, full recomputation), two replicas of a pipeline (uneven
# rows; ZeRO-2), and pipelines of tensor-parallel stages (GPipe; 3 stages with full recomputation; two
# replicas with sequence parallelism); interleaved and zero-bubble schedules (3 stages with full
# recomputation; two replicas with ZeRO-2); and bfloat16 and float16 compute on one device, with
# ZeRO-2 and 3, two replicas of tensor parallelism with sequence parallelism, a pipeline's ZeRO-2,
# and interleaved and zero-bubble tensor-parallel stages.
# Usage: memory_model_check.sh TRAIN_GPT TEXT_FILE
set -euo pipefail
exe=$1
text=$2
common=(--data "$text" --n-layer 3 --n-head 4 --n-embd 96 --block-size 48 --batch-size 6 --iters 2
        --eval-every 0 --eval-iters 1 --json)
layouts=(
  "--devices host:1"
  "--devices host:1 --recompute selective"
  "--devices host:1 --recompute full"
  "--devices host:1 --dropout 0.1"
  "--devices host:2 --zero 0"
  "--devices host:3 --zero 1"
  "--devices host:2 --recompute full"
  "--devices host:3 --zero 2 --bucket-kb 100"
  "--devices host:3 --zero 3 --bucket-kb 100"
  "--devices host:3 --zero 3"
  "--tp 2"
  "--tp 2 --recompute selective"
  "--tp 2 --recompute full"
  "--tp 4"
  "--dp 2 --tp 2"
  "--tp 2 --sequence-parallel --recompute selective"
  "--tp 4 --sequence-parallel"
  "--dp 2 --tp 2 --sequence-parallel --recompute full"
  "--stages 2 --micro-batches 4"
  "--stages 2 --micro-batches 4 --schedule gpipe"
  "--stages 3 --micro-batches 4 --recompute full"
  "--stages 2 --dp 2 --micro-batches 2 --batch-size 7"
  "--stages 2 --dp 2 --micro-batches 2 --zero 2"
  "--tp 2 --stages 2 --micro-batches 4 --schedule gpipe"
  "--tp 2 --stages 3 --micro-batches 4 --recompute full"
  "--dp 2 --tp 2 --stages 2 --micro-batches 2 --sequence-parallel"
  "--stages 2 --micro-batches 4 --schedule interleaved"
  "--stages 3 --micro-batches 6 --schedule zb --recompute full"
  "--stages 2 --dp 2 --micro-batches 2 --zero 2 --schedule zb"
  "--devices host:1 --precision bf16"
  "--devices host:3 --zero 2 --precision fp16 --bucket-kb 100"
  "--devices host:3 --zero 3 --precision bf16"
  "--dp 2 --tp 2 --sequence-parallel --precision fp16"
  "--stages 2 --dp 2 --micro-batches 2 --zero 2 --precision bf16"
  "--tp 2 --stages 2 --micro-batches 4 --schedule interleaved --precision fp16"
  "--tp 2 --stages 2 --micro-batches 4 --schedule zb --precision bf16"
)
for layout in "${layouts[@]}"; do
  # shellcheck disable=SC2086  # a layout is several flags
  "$exe" "${common[@]}" $layout 2> /dev/null | python3 -c '
import json, sys
layout = sys.argv[1]
run = json.load(sys.stdin)
measured, predicted = run["peak_bytes"], run["predicted_peak_bytes"]
if predicted is None or len(predicted) != len(measured):
    sys.exit(f"FAIL: {layout}: predicted {predicted} for the measured {measured} (expected one prediction per device)")
for device, (m, p) in enumerate(zip(measured, predicted)):
    error = (p - m) / m
    print(f"{layout}: device {device} measured {m / 1e6:.3f} MB, predicted {p / 1e6:.3f} MB ({100 * error:+.1f}%)")
    if abs(error) > 0.10:
        sys.exit(f"FAIL: {layout}: device {device} predicted {p} bytes, measured {m} (expected within 10%)")
' "$layout"
done
echo "memory model: every layout within 10%"
