#!/usr/bin/env bash
# Runs bench_gpt's training step and its PyTorch peer (scripts/gpt_peer.py, torch in its own venv
# from scripts/requirements/gpt_peer.txt) in turn, in one run, on the same shapes, and prints
# tokens/s (median step) of each and their ratio. ROUNDS rounds, each, per config and for each of
# THREADS (default "1 2"): bench_gpt's step, then the peer at that many threads. At one thread
# bench_gpt runs on one host device (one worker thread, BM_gpt_step); at two, data parallel over
# host:2 (two worker threads, BM_gpt_step_dp), against PyTorch's intra-op parallelism.
# Writes $OUT/gpt-compare.json (default OUT=build/gpt-compare): every run's figures and the ratios.
#   scripts/gpt-compare.sh                 # nano, 2 rounds
#   CONFIGS="nano gpt2s" ROUNDS=1 THREADS=1 scripts/gpt-compare.sh
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${ROUNDS:-2}
configs=${CONFIGS:-nano}
threads_list=${THREADS:-1 2}
out=${OUT:-build/gpt-compare}
build=${MGPU_BUILD_DIR:-build/release}
mkdir -p "$out"
scripts/setup.sh
fresh=()
[ -f "$build/CMakeCache.txt" ] || fresh=(-DMGPU_BUILD_TESTS=OFF)
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMGPU_NATIVE=ON -DMGPU_BUILD_BENCH=ON "${fresh[@]}" >/dev/null
cmake --build "$build" --target bench_gpt
py=$(scripts/venv.sh gpt_peer)
runs="$out/runs.jsonl"
: >"$runs"
for round in $(seq 1 "$rounds"); do
  for config in $configs; do
    case $config in
      nano) index=0 steps=60 ;;
      gpt2s) index=1 steps=4 ;;
      *) echo "unknown config $config (expected nano or gpt2s)" >&2; exit 2 ;;
    esac
    for threads in $threads_list; do
      case $threads in
        1) filter="BM_gpt_step/$index/" ;;
        2) filter="BM_gpt_step_dp/$index/" ;;
        *) echo "THREADS $threads (expected 1 or 2)" >&2; exit 2 ;;
      esac
      echo "== round $round, $config: bench_gpt, $threads worker thread(s)" >&2
      "$build/bench/bench_gpt" --benchmark_filter="$filter" --benchmark_out="$out/bench_gpt.json" \
        --benchmark_out_format=json >&2
      "$py" - "$out/bench_gpt.json" "$config" "$round" "$threads" >>"$runs" <<'EOF'
import json, sys
path, config, round_, threads = sys.argv[1:]
b = json.load(open(path))["benchmarks"][0]
print(json.dumps({"program": "mgpu", "config": config, "round": int(round_), "threads": int(threads),
                  "tokens_per_s": round(b["tokens_per_s"], 1), "steps": b["iterations"],
                  "peak_bytes_device": b["peak_bytes_device"], "label": b.get("label", "")}))
EOF
      echo "== round $round, $config: PyTorch, $threads thread(s)" >&2
      "$py" scripts/gpt_peer.py --config "$config" --threads "$threads" --steps "$steps" |
        "$py" -c "import json,sys; r=json.loads(sys.stdin.read()); r['round']=$round; print(json.dumps(r))" >>"$runs"
    done
  done
done
"$py" - "$runs" "$out/gpt-compare.json" <<'EOF'
import json, os, platform, statistics, sys
runs = [json.loads(line) for line in open(sys.argv[1])]
rows = []
for config in dict.fromkeys(r["config"] for r in runs):
    for threads in (1, 2):
        ratios = []
        for rnd in sorted({r["round"] for r in runs}):
            mine = [r for r in runs if r["program"] == "mgpu" and r["config"] == config and r["round"] == rnd
                    and r["threads"] == threads]
            peer = [r for r in runs if r["program"] == "pytorch" and r["config"] == config and r["round"] == rnd
                    and r["threads"] == threads]
            if mine and peer:
                ratios.append((mine[0]["tokens_per_s"], peer[0]["tokens_per_s"]))
        if not ratios:
            continue
        for rnd, (m, p) in enumerate(ratios, 1):
            print(f"{config:6} round {rnd}: mgpu ({threads} worker thread(s)) {m:10.1f} tokens/s, "
                  f"PyTorch {threads} thread(s) {p:10.1f} tokens/s, ratio {m / p:.2f}")
        rows.append({"config": config, "torch_threads": threads,
                     "ratio_median": round(statistics.median(m / p for m, p in ratios), 3)})
for row in rows:
    print(f"{row['config']:6} mgpu / PyTorch at {row['torch_threads']} thread(s): median ratio {row['ratio_median']}")
json.dump({"machine": {"cpus": os.cpu_count(), "processor": platform.processor(), "load_avg": os.getloadavg()},
           "runs": runs, "ratios": rows}, open(sys.argv[2], "w"), indent=1)
print(f"wrote {sys.argv[2]}")
EOF
