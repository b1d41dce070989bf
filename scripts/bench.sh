#!/usr/bin/env bash
# Builds mgpu's benchmarks (Release, -march=native) and runs them, writing Google Benchmark JSON
# to build/bench-results/ (or $OUT). It reuses the build directory scripts/test.sh made (the same
# options, so nothing is rebuilt); a fresh one gets no tests. Arguments name the benchmarks to run
# (default: all); MGPU_BENCH_SKIP, a regular expression, leaves out the benchmarks it matches, and
# MGPU_BENCH_QUICK=1 makes it a smoke run (each benchmark briefly: figures, not measurements), e.g.
#   scripts/bench.sh bench_collectives
#   MGPU_BENCH_SKIP='BM_attention/[01]/[1-9]' scripts/bench.sh bench_gpt
#   MGPU_BENCH_QUICK=1 scripts/bench.sh
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
build=${MGPU_BUILD_DIR:-build/release}
out=${OUT:-build/bench-results}
mkdir -p "$out"
fresh=()
[ -f "$build/CMakeCache.txt" ] || fresh=(-DMGPU_BUILD_TESTS=OFF)
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMGPU_NATIVE=ON -DMGPU_BUILD_BENCH=ON "${fresh[@]}" >/dev/null
cmake --build "$build"
names=("$@")
[ ${#names[@]} -eq 0 ] && names=(bench_core bench_collectives bench_scheduler bench_train bench_data_parallel bench_pipeline bench_gpt)
skip=()
[ -n "${MGPU_BENCH_SKIP:-}" ] && skip=(--benchmark_filter="-$MGPU_BENCH_SKIP")
[ "${MGPU_BENCH_QUICK:-0}" != 0 ] && skip+=(--benchmark_min_time=0.05)  # and bench::min_time, bench::iterations
for name in "${names[@]}"; do
  echo "== $name"
  "$build/bench/$name" --benchmark_out="$out/$name.json" --benchmark_out_format=json "${skip[@]}"
done
