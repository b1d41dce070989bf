#!/usr/bin/env bash
# Builds mgpu's libFuzzer targets (fuzz/: CSV and IDX readers, checkpoint reader, trace reader,
# device-spec parser, token-shard reader and loader, llm.c model-file reader) with Clang,
# AddressSanitizer and UndefinedBehaviorSanitizer, and runs each for SECONDS (default 30) from its seed corpus
# (fuzz/corpus/NAME). New inputs go to build/fuzz-corpus/NAME (the committed seeds stay as they
# are); a crash, a leak, a hang past 10 s, more than 2 GiB of memory or an exception other than
# mgpu::Error stops the run with the input saved in build/fuzz-findings/.
# The targets run MGPU_FUZZ_JOBS at a time (default: one per core; each fuzzer is one process of
# one thread, so each still gets SECONDS of a core).
# MGPU_BUILD_DIR may name a build already configured with Clang, -DMGPU_BUILD_FUZZERS=ON and those
# sanitizers (CI's Clang stage): its fuzzers are used as they are, without configuring it anew.
# Usage: scripts/fuzz.sh [SECONDS] [NAME...]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
seconds=${1:-30}
shift $(( $# > 0 ? 1 : 0 ))
names=("$@")
[ ${#names[@]} -eq 0 ] && names=(csv idx checkpoint trace devices tokens llmc)
build=${MGPU_BUILD_DIR:-build/fuzz}
if ! grep -qs '^MGPU_BUILD_FUZZERS:BOOL=ON$' "$build/CMakeCache.txt"; then
  CXX=${CXX:-clang++-14} cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMGPU_WITH_CUDA=OFF \
    -DMGPU_NATIVE=OFF -DMGPU_WERROR=ON -DMGPU_BUILD_TESTS=OFF -DMGPU_BUILD_EXAMPLES=OFF -DMGPU_BUILD_BENCH=OFF \
    -DMGPU_BUILD_FUZZERS=ON \
    -DCMAKE_CXX_FLAGS="-fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer" >/dev/null
fi
cmake --build "$build" --target "${names[@]/#/fuzz_}"
mkdir -p build/fuzz-findings
jobs=${MGPU_FUZZ_JOBS:-$(nproc)}
# Runs fuzz_NAME for SECONDS; its log in build/fuzz-findings/NAME.log.
run() {
  mkdir -p "build/fuzz-corpus/$1"
  "$build/fuzz/fuzz_$1" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=2048 \
    -max_len=4096 -print_final_stats=1 -artifact_prefix="build/fuzz-findings/$1-" \
    "build/fuzz-corpus/$1" "fuzz/corpus/$1" >"build/fuzz-findings/$1.log" 2>&1
}
# In batches of `jobs`, each target's result printed in the order of `names`.
for ((first = 0; first < ${#names[@]}; first += jobs)); do
  batch=("${names[@]:first:jobs}")
  pids=()
  for name in "${batch[@]}"; do
    run "$name" &
    pids+=($!)
  done
  for i in "${!batch[@]}"; do
    name=${batch[i]}
    log="build/fuzz-findings/$name.log"
    rc=0
    wait "${pids[i]}" || rc=$?
    echo "== fuzz_$name for ${seconds}s"
    grep -E "^#[0-9]+ +DONE|^stat::(number_of_executed_units|peak_rss_mb)" "$log" || true
    if [ "$rc" -ne 0 ]; then
      tail -n 40 "$log" >&2
      echo "fuzz_$name failed (exit $rc): the input is in build/fuzz-findings/, the log in $log" >&2
      wait
      exit 1
    fi
  done
done
