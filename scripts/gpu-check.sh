#!/usr/bin/env bash
# gpu-check: mgpu's GPU checks, shaped for a GPU machine lent for about 15 minutes in all, at most
# 10 minutes a command, that starts bare. Nothing is compiled there.
#
#   scripts/gpu-check.sh prepare   here, no GPU needed: builds what the GPU run needs (CUDA and NCCL,
#                                  for sm_$MGPU_CUDA_ARCH, default 90) in $MGPU_GPU_OBJECTS (default
#                                  build/gpu-objects) and gathers the binaries and the few shared
#                                  libraries a bare machine may lack into $MGPU_GPU_BUILD (default
#                                  build/gpu-run), at most 60 MiB: the one folder to carry there
#   scripts/gpu-check.sh run A|B|C there, on that folder; each part ends within 8 minutes by
#                                  construction (the stage limits below add up to less, every test
#                                  case has its own limit, MGPU_COMM_TIMEOUT bounds every wait):
#       A  the CUDA tests, each test case in its own process, then compute-sanitizer memcheck on
#          the test cases tagged [sanitize]
#       B  compute-sanitizer racecheck and synccheck on the [sanitize] test cases
#       C  benchmarks, JSON under $OUT: GEMM through mgpu against raw cuBLAS, the cuda_peer
#          all-reduce's bus bandwidth on one GPU, data-parallel and pipeline steps, training steps
#          (a GPT step when the benchmark exists)
#   scripts/gpu-check.sh [dry-run] parts A, B and C in turn, on $MGPU_GPU_BUILD, which here may be
#                                  any build folder of mgpu with its tests and benchmarks (default
#                                  build/release, the one scripts/test.sh makes): without a GPU what
#                                  needs one is reported skipped, and the exit status is 0 unless
#                                  something that ran failed. CI runs it on its CPU build.
#
# Each part prints one summary line: "gpu-check part A: N passed, N failed, N skipped", then the
# failed and skipped ones with their reasons. Logs and benchmark JSON go to $OUT when set, else
# $MGPU_GPU_BUILD/out (a part writes at most 7 files).
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:-}
part=${2:-}
default_build=build/gpu-run
[ -z "$mode" ] || [ "$mode" = dry-run ] && default_build=build/release
bundle=$(realpath -m "${MGPU_GPU_BUILD:-$default_build}")
objects=${MGPU_GPU_OBJECTS:-build/gpu-objects}
arch=${MGPU_CUDA_ARCH:-90}
out=${OUT:-$bundle/out}
export MGPU_COMM_TIMEOUT=${MGPU_COMM_TIMEOUT:-20}  # seconds; a test case's limit leaves room for 2 of them
case_limit=${MGPU_GPU_CASE_LIMIT:-60}             # seconds per test case, plain
sanitizer_case_limit=${MGPU_GPU_SANITIZER_CASE_LIMIT:-100}  # seconds per test case under a sanitizer

# Stage limits in seconds. A stage's listing of its test cases or benchmarks counts within its
# limit, and the last process it starts may take 5 s more to be killed; the preflight runs two
# commands of its limit each. So part A takes at most 2 x 10 + (240 + 5) + (200 + 5) = 470 s,
# B 2 x 10 + (215 + 5) x 2 = 460 s and C 2 x 10 + (85 + 5) x 5 = 470 s: each within 480 s
# (8 minutes). check_budget verifies it before a part starts.
declare -A limit=([preflight]=10 [cuda_tests]=240 [memcheck]=200 [racecheck]=215 [synccheck]=215
  [gemm]=85 [collectives]=85 [data_parallel]=85 [pipeline]=85 [train]=85)
declare -A stages=([A]="cuda_tests memcheck" [B]="racecheck synccheck" [C]="gemm collectives data_parallel pipeline train")
part_budget=480

usage() {
  sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2
  exit 2
}

# ---------------------------------------------------------------------------------------------
# prepare

prepare() {
  local targets=(mgpu_cuda_tests bench_core bench_collectives bench_data_parallel bench_pipeline bench_train)
  # Portable code (no -march=native) and the Eigen host GEMM: the GPU machine's processor may
  # differ, and oneDNN's library would not fit in the folder.
  cmake -S . -B "$objects" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMGPU_WITH_CUDA=ON -DMGPU_WITH_NCCL=ON \
    -DCMAKE_CUDA_ARCHITECTURES="$arch" -DMGPU_NATIVE=OFF -DMGPU_WERROR=ON -DMGPU_HOST_GEMM=eigen \
    -DMGPU_BUILD_TESTS=ON -DMGPU_BUILD_BENCH=ON -DMGPU_BUILD_EXAMPLES=OFF >/dev/null || return 1
  cmake --build "$objects" --parallel "${MGPU_JOBS:-2}" --target "${targets[@]}" || return 1
  rm -rf "$bundle"
  mkdir -p "$bundle/tests" "$bundle/bench" "$bundle/lib"
  cp "$objects/tests/mgpu_cuda_tests" "$bundle/tests/"
  local t
  for t in "${targets[@]:1}"; do cp "$objects/bench/$t" "$bundle/bench/"; done
  strip --strip-unneeded "$bundle"/tests/* "$bundle"/bench/*
  # The shared libraries a bare machine may lack. Not the C and C++ runtimes, nor the driver, nor
  # cuBLAS and NCCL (too large to carry; the machine's CUDA toolkit and Python wheels have them).
  ldd "$bundle"/tests/* "$bundle"/bench/* | awk '$2 == "=>" && $3 ~ /^\// {print $3}' | sort -u |
    grep -v -E '/lib(c|m|dl|rt|pthread|gcc_s|stdc\+\+|cuda|cublas|cublasLt|nccl)\.so' |
    xargs -r cp -L -t "$bundle/lib/"
  cp -L "$(ldd "$bundle/tests/mgpu_cuda_tests" | awk '$1 ~ /^libcudart/ {print $3}')" "$bundle/lib/" 2>/dev/null
  printf 'commit %s\nsm_%s\nbuilt %s\n' "$(git describe --always --dirty 2>/dev/null)" "$arch" "$(date -u +%FT%TZ)" >"$bundle/PREPARED"
  local kib
  kib=$(du -sk "$bundle" | cut -f1)
  echo "gpu-check: prepared $bundle: $((kib / 1024)) MiB ($(ls "$bundle"/lib | tr '\n' ' '))"
  if [ "$kib" -gt $((60 * 1024)) ]; then
    echo "gpu-check: $bundle is $((kib / 1024)) MiB (expected at most 60 MiB to carry)" >&2
    return 1
  fi
}

# ---------------------------------------------------------------------------------------------
# run: stages, each recorded as "stage: status" lines and counted for the part's summary

passed=0
failed=0
skipped=0
failures=()
skips=()
log=""
gpu=""

note_pass() { passed=$((passed + 1)); }
note_fail() { failed=$((failed + 1)); failures+=("$1"); }
note_skip() { skipped=$((skipped + 1)); skips+=("$1"); }

# The library path for a carried build: its own lib/, then the machine's CUDA toolkit and the CUDA
# libraries that Python wheels install (cuBLAS, NCCL).
library_path() {
  local libs="$bundle/lib:/usr/local/cuda/lib64:/usr/local/cuda/lib" d
  for d in /usr/local/lib/python3*/dist-packages/nvidia/*/lib /opt/*/.venv/lib/python3*/site-packages/nvidia/*/lib \
    /usr/lib/python3/dist-packages/nvidia/*/lib; do
    [ -d "$d" ] && libs="$libs:$d"
  done
  export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
}

# Fails the part's stages at once when a binary cannot load, instead of each test case failing.
preflight() {
  local missing
  missing=$(timeout "${limit[preflight]}" ldd "$bundle"/tests/mgpu_cuda_tests "$bundle"/bench/bench_* 2>/dev/null |
    awk '/not found/ {print $1}' | sort -u | tr '\n' ' ')
  if [ -n "$missing" ]; then
    note_fail "preflight: libraries not found: $missing(LD_LIBRARY_PATH=$LD_LIBRARY_PATH)"
    return 1
  fi
  if command -v nvidia-smi >/dev/null 2>&1; then
    gpu=$(timeout "${limit[preflight]}" nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
  fi
  echo "gpu-check: ${gpu:-no GPU visible}; MGPU_COMM_TIMEOUT=$MGPU_COMM_TIMEOUT s" | tee -a "$log"
}

sanitizer() {
  local s
  for s in "$(command -v compute-sanitizer)" /usr/local/cuda/bin/compute-sanitizer; do
    [ -x "$s" ] && { echo "$s"; return 0; }
  done
  return 1
}

# A test case's name as a Catch2 test spec (commas, brackets, quotes, wildcards escaped).
spec_of() { sed 's/[],[\\~*"]/\\&/g' <<<"$1"; }

# run_cases STAGE FILTER CASE_LIMIT [TOOL...]: each test case of mgpu_cuda_tests that FILTER
# selects, in its own process under TOOL, at most CASE_LIMIT s each; none starts once the stage's
# limit is nearly spent (those count as failed: not run).
run_cases() {
  local stage=$1 filter=$2 per_case=$3
  shift 3
  local tests="$bundle/tests/mgpu_cuda_tests" start=$SECONDS names rc=0
  echo "== $stage (limit ${limit[$stage]} s, ${per_case} s per test case)" | tee -a "$log"
  if [ ! -x "$tests" ]; then
    note_fail "$stage: $tests is missing (expected a prepared or built folder)"
    return
  fi
  # Catch2 v2 exits with the number of test cases listed; without a GPU the CUDA tests say so.
  names=$(timeout 20 "$tests" "$filter" --list-test-names-only 2>&1 </dev/null) || rc=$?
  if grep -q '^SKIPPED: no CUDA GPU' <<<"$names"; then
    if [ -n "$gpu" ]; then
      note_fail "$stage: the tests saw no GPU although nvidia-smi shows $gpu"
    else
      note_skip "$stage: no GPU ($(head -n 1 <<<"$names"))"
    fi
    return
  elif [ "$rc" -ge 124 ] || [ -z "$names" ]; then
    note_fail "$stage: listing the test cases that '$filter' selects failed (exit $rc): $(tail -n 1 <<<"$names")"
    return
  fi
  local name text left t
  while IFS= read -r name; do
    [ -z "$name" ] && continue
    left=$((limit[$stage] - (SECONDS - start)))
    if [ "$left" -lt 10 ]; then
      note_fail "$stage: $name: not run (the stage's ${limit[$stage]} s were spent)"
      continue
    fi
    t=$((left < per_case ? left : per_case))
    rc=0
    text=$(timeout --kill-after=5 "$t" "$@" "$tests" "$(spec_of "$name")" 2>&1 </dev/null) || rc=$?
    printf '### %s: %s (exit %s, %s s)\n%s\n' "$stage" "$name" "$rc" "$t" "$text" >>"$log"
    if grep -q 'Device not supported' <<<"$text"; then
      note_skip "$stage: compute-sanitizer does not support this device here (seen under gVisor)"
      return
    elif [ "$rc" -eq 0 ] && grep -q 'SKIPPED: ' <<<"$text"; then
      note_skip "$stage: $name: $(grep -m 1 -o 'SKIPPED: .*' <<<"$text" | sed 's/^SKIPPED: //')"
    elif [ "$rc" -eq 4 ] && grep -qi 'skipped' <<<"$text"; then  # Catch2 v3: every test case skipped
      note_skip "$stage: $name: $(grep -m 1 -i -A 1 'skip' <<<"$text" | tail -n 1)"
    elif [ "$rc" -eq 0 ]; then
      note_pass
    elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
      note_fail "$stage: $name: timed out after $t s"
    else
      note_fail "$stage: $name: exit $rc: $(grep -m 1 -E 'FAILED|ERROR|error' <<<"$text" | cut -c 1-160)"
    fi
  done <<<"$(sed -n '/^[^ ]/p' <<<"$names" | grep -v -E '^(All available|Matching test cases|[0-9]+ (matching )?test case)')"
}

run_sanitizer() {  # run_sanitizer STAGE TOOL OPTIONS...
  local stage=$1
  shift
  local tool
  if ! tool=$(sanitizer); then
    echo "== $stage" | tee -a "$log"
    if [ -n "$gpu" ]; then note_fail "$stage: compute-sanitizer not found"; else note_skip "$stage: no GPU (and no compute-sanitizer)"; fi
    return
  fi
  run_cases "$stage" "${MGPU_SANITIZE_FILTER:-[sanitize]}" "$sanitizer_case_limit" "$tool" "$@" --error-exitcode 1
}

# run_bench STAGE BINARY FILTER: one benchmark binary's benchmarks that FILTER selects, JSON to
# $out/bench_STAGE.json.
run_bench() {
  local stage=$1 binary="$bundle/bench/$2" filter=$3 listed rc=0 start=$SECONDS
  echo "== $stage: $2 --benchmark_filter='$filter' (limit ${limit[$stage]} s)" | tee -a "$log"
  if [ ! -x "$binary" ]; then
    note_fail "$stage: $binary is missing"
    return
  fi
  listed=$(MGPU_BENCH_BASELINES=0 timeout 10 "$binary" --benchmark_list_tests --benchmark_filter="$filter" 2>/dev/null </dev/null |
    grep -E '^BM_' | grep -c -E "$filter")
  if [ "${listed:-0}" -eq 0 ]; then
    if [ -z "$gpu" ]; then
      note_skip "$stage: no GPU (no benchmark matches '$filter' without one)"
    else
      note_skip "$stage: no benchmark matches '$filter' in $2 yet"
    fi
    return
  fi
  MGPU_BENCH_BASELINES=0 timeout --kill-after=5 "$((limit[$stage] - (SECONDS - start)))" "$binary" --benchmark_filter="$filter" \
    --benchmark_min_time=0.05 --benchmark_out="$out/bench_$stage.json" --benchmark_out_format=json >>"$log" 2>&1 || rc=$?
  local errors=""
  [ -f "$out/bench_$stage.json" ] && errors=$(python3 - "$out/bench_$stage.json" <<'PY'
import json, sys
try:
    benchmarks = json.load(open(sys.argv[1])).get("benchmarks", [])
except ValueError as e:
    benchmarks = [{"name": "(all)", "error_occurred": True, "error_message": f"unreadable JSON: {e}"}]
for b in benchmarks:
    if b.get("error_occurred"):
        print(f"{b['name']}: {b.get('error_message', '')}")
PY
  )
  if [ "$rc" -eq 0 ] && [ -n "$errors" ] && [ -z "$gpu" ]; then
    note_skip "$stage: no GPU ($(head -n 1 <<<"$errors"))"
  elif [ "$rc" -eq 0 ] && [ -n "$errors" ]; then
    note_fail "$stage: $(tr '\n' ';' <<<"$errors")"
  elif [ "$rc" -eq 0 ]; then
    note_pass
  elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    note_fail "$stage: timed out after ${limit[$stage]} s"
  else
    note_fail "$stage: exit $rc (see $log)"
  fi
}

# The benchmark JSON of part C, one line per benchmark: its time and its own figures of merit.
print_bench_json() {
  local json
  for json in "$out"/bench_*.json; do
    [ -f "$json" ] || continue
    python3 - "$json" <<'PY' || true
import json, sys
skip = {"name", "family_index", "per_family_instance_index", "run_name", "run_type", "repetitions",
        "repetition_index", "threads", "iterations", "real_time", "cpu_time", "time_unit", "error_occurred"}
try:
    benchmarks = json.load(open(sys.argv[1])).get("benchmarks", [])
except ValueError as e:
    print(f"  {sys.argv[1]}: unreadable JSON: {e}")
    benchmarks = []
for b in benchmarks:
    if b.get("run_type") == "aggregate":
        continue
    if b.get("error_occurred"):
        print(f"  {b['name']:<56} error: {b.get('error_message', '')}")
        continue
    figures = "  ".join(f"{k} {v:.4g}" for k, v in b.items() if k not in skip and isinstance(v, (int, float)))
    print(f"  {b['name']:<56} {b['real_time']:10.3f} {b['time_unit']}  {figures}")
PY
  done
}

# The part's worst case from its stage limits (see above); refuses a part that could overrun.
check_budget() {
  local p=$1 worst=$((2 * limit[preflight])) stage
  for stage in ${stages[$p]}; do worst=$((worst + limit[$stage] + 5)); done
  if [ "$worst" -gt "$part_budget" ]; then
    echo "gpu-check: part $p could take $worst s (expected its stage limits to add up to at most $part_budget s)" >&2
    return 1
  fi
  echo "gpu-check part $p: at most $worst s (${stages[$p]})"
}

run_part() {
  local p=$1 start=$SECONDS
  passed=0 failed=0 skipped=0 failures=() skips=()
  log="$out/part-$p.log"
  : >"$log"
  echo "gpu-check part $p on $bundle ($(head -n 1 "$bundle/PREPARED" 2>/dev/null || echo 'not a prepared folder'))" | tee -a "$log"
  check_budget "$p" | tee -a "$log"
  if preflight; then
    case $p in
      A)
        run_cases cuda_tests "${MGPU_TEST_FILTER:-*}" "$case_limit"
        run_sanitizer memcheck --tool memcheck --leak-check full
        ;;
      B)
        run_sanitizer racecheck --tool racecheck --racecheck-report hazard
        run_sanitizer synccheck --tool synccheck
        ;;
      C)
        rm -f "$out"/bench_*.json
        run_bench gemm bench_core 'BM_cuda_gemm'
        run_bench collectives bench_collectives 'BM_cuda_peer_all_reduce'
        run_bench data_parallel bench_data_parallel 'cuda'
        run_bench pipeline bench_pipeline 'cuda'
        run_bench train bench_train "${MGPU_TRAIN_BENCH_FILTER:-BM_train_step_cuda|gpt|GPT}"
        print_bench_json | tee -a "$log"
        ;;
    esac
  fi
  echo "gpu-check part $p: $passed passed, $failed failed, $skipped skipped ($((SECONDS - start)) s of $part_budget s)" | tee -a "$log"
  local line
  for line in "${failures[@]}"; do echo "  failed: $line"; done | tee -a "$log"
  for line in "${skips[@]}"; do echo "  skipped: $line"; done | tee -a "$log"
  [ "$failed" -eq 0 ]
}

case $mode in
  prepare)
    prepare
    ;;
  run)
    [[ $part =~ ^[ABC]$ ]] || usage
    [ -d "$bundle" ] || { echo "gpu-check: $bundle does not exist (run 'scripts/gpu-check.sh prepare' first, or set MGPU_GPU_BUILD)" >&2; exit 2; }
    mkdir -p "$out"
    library_path
    run_part "$part"
    ;;
  "" | dry-run)
    [ -d "$bundle" ] || { echo "gpu-check: $bundle does not exist (set MGPU_GPU_BUILD to a build folder, e.g. build/release)" >&2; exit 2; }
    mkdir -p "$out"
    library_path
    status=0
    for p in A B C; do run_part "$p" || status=1; done
    exit "$status"
    ;;
  *)
    usage
    ;;
esac
