#!/usr/bin/env bash
# Builds mgpu (Release) and runs its benchmarks, writing Google Benchmark JSON to
# build/bench-results/ (or $OUT). Arguments name the benchmarks to run (default: all), e.g.
#   scripts/bench.sh bench_collectives
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
build=${MGPU_BUILD_DIR:-build/release}
out=${OUT:-build/bench-results}
mkdir -p "$out"
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMGPU_BUILD_TESTS=OFF -DMGPU_BUILD_BENCH=ON >/dev/null
cmake --build "$build"
names=("$@")
[ ${#names[@]} -eq 0 ] && names=(bench_core bench_collectives bench_scheduler bench_train bench_data_parallel bench_pipeline)
for name in "${names[@]}"; do
  echo "== $name"
  "$build/bench/$name" --benchmark_out="$out/$name.json" --benchmark_out_format=json
done
