#!/usr/bin/env bash
# Every executor's per-device busy and wait times in the exported metrics (ctest's
# metrics_executors): train_pipeline --stages 2, train_gpt --stages 2 and train_gpt --tp 2, each on
# host:2, and train_gpt --tp 2 --stages 2 on host:4, with --metrics-file; in each textfile every
# device's busy ratio in (0, 1], its
# compute and collective wait counters above 0, and their sum within the run's wall time.
#   executors.sh TRAIN_GPT TRAIN_PIPELINE TEXT_FILE DIR
set -euo pipefail
gpt=$1 pipeline=$2 text=$3 dir=$4
rm -rf "$dir" && mkdir -p "$dir"
check() {  # check NAME SECONDS DEVICES: the metrics of run NAME on host:DEVICES, which took SECONDS
  python3 - "$dir/$1.prom" "$2" "$1" "$3" <<'PY'
import re, sys
path, wall, name, devices = sys.argv[1], float(sys.argv[2]), sys.argv[3], int(sys.argv[4])
series = {}
for line in open(path):
    m = re.match(r'^(\w+)\{(.*)\} (\S+)$', line)
    if m:
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
        if "device" in labels:
            series.setdefault(labels["device"], {})[m.group(1)] = float(m.group(3))
assert sorted(series) == [f"host:{d}" for d in range(devices)], f"{name}: devices {sorted(series)}"
for device, s in sorted(series.items()):
    busy = s.get("mgpu_device_busy_ratio")
    compute = s.get("mgpu_device_compute_seconds_total")
    wait = s.get("mgpu_device_collective_wait_seconds_total")
    assert busy is not None and 0 < busy <= 1, f"{name} {device}: busy ratio {busy}"
    assert compute is not None and compute > 0, f"{name} {device}: compute {compute} s"
    assert wait is not None and wait > 0, f"{name} {device}: collective wait {wait} s"
    assert compute + wait <= wall, f"{name} {device}: {compute} s computing + {wait} s waiting in a {wall} s run"
    print(f"{name} {device}: busy {busy:.2f}, {compute:.3f} s computing, {wait:.3f} s waiting, run {wall:.2f} s")
PY
}
run() {  # run NAME DEVICES COMMAND...: COMMAND with --devices host:DEVICES --metrics-file DIR/NAME.prom, then check
  local name=$1 devices=$2
  shift 2
  local start end
  start=$(date +%s.%N)
  "$@" --devices "host:$devices" --metrics-file "$dir/$name.prom" >"$dir/$name.log" 2>&1 || { echo "FAIL: $name: $*" >&2; tail -20 "$dir/$name.log" >&2; exit 1; }
  end=$(date +%s.%N)
  check "$name" "$(python3 -c "print($end - $start)")" "$devices"
}
gpt_flags=(--data "$text" --n-layer 1 --n-head 2 --n-embd 16 --block-size 8 --batch-size 4 --iters 4 --eval-every 0
  --eval-iters 1 --no-progress)
run train_pipeline 2 "$pipeline" --stages 2 --micro-batches 4 --epochs 1 --batch 128
run train_gpt_stages 2 "$gpt" "${gpt_flags[@]}" --stages 2 --micro-batches 2
run train_gpt_tp 2 "$gpt" "${gpt_flags[@]}" --tp 2
run train_gpt_tp_stages 4 "$gpt" "${gpt_flags[@]}" --tp 2 --stages 2 --micro-batches 2
echo "metrics_executors: ok"
