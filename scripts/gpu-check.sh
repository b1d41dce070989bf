#!/usr/bin/env bash
# gpu-check: builds mgpu with CUDA, runs the whole test suite and the GPU benchmarks, and prints a
# summary table last; on a GPU it also runs a short subset of the CUDA tests under compute-sanitizer
# (memcheck, racecheck). Every stage has its own timeout, so the whole run fits a 15-minute GPU loan.
#
#   scripts/gpu-check.sh            build (unless a prepared build is there), test, benchmark
#   scripts/gpu-check.sh prepare    only build, for a GPU of compute capability $MGPU_CUDA_ARCH
#                                   (default 90), and bundle the shared libraries the binaries need,
#                                   so the build can be carried to a GPU machine that lacks them
#
# Without a GPU it says so, still builds and runs the tests (the CUDA tests skip), and skips the
# sanitizer runs and the benchmarks. Logs and benchmark JSON go to $OUT when set, else build/gpu-check/out.
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:-run}
build=${MGPU_GPU_BUILD:-build/gpu-check}
out=${OUT:-$build/out}
mkdir -p "$out"
summary=()
failed=0

stage() {  # stage NAME TIMEOUT_S COMMAND...: runs a stage with its log in $out/NAME.log
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS rc=0
  echo "== $name (limit ${limit}s)"
  timeout --kill-after=10 "$limit" bash -c '"$@"' _ "$@" >"$out/$name.log" 2>&1 || rc=$?
  tail -n 15 "$out/$name.log"
  local status=ok
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then status="TIMED OUT"; failed=1
  elif [ "$rc" -ne 0 ]; then status="FAILED (exit $rc)"; failed=1; fi
  summary+=("$(printf '%-10s %-18s %5ss' "$name" "$status" "$((SECONDS - t0))")")
  return "$rc"
}

gpu_name=""
gpu_arch=""
if command -v nvidia-smi >/dev/null 2>&1; then
  gpu_name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
  gpu_arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1 | tr -d '.')
fi
if [ -n "$gpu_name" ]; then
  echo "gpu-check: found $gpu_name (sm_$gpu_arch)"
else
  echo "gpu-check: no GPU visible (nvidia-smi found none): building and testing the CPU path; CUDA tests and GPU benchmarks skip"
fi
arch=${MGPU_CUDA_ARCH:-${gpu_arch:-90}}

# The CUDA toolkit's and bundled libraries, for binaries carried from another machine.
libs="$PWD/$build/lib:/usr/local/cuda/lib64"
for d in /usr/local/lib/python3*/dist-packages/nvidia/*/lib /opt/*/.venv/lib/python3*/site-packages/nvidia/*/lib; do
  [ -d "$d" ] && libs="$libs:$d"
done
export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

build_mgpu() {
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMGPU_WITH_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES="$arch" -DMGPU_NATIVE=OFF -DMGPU_WERROR=ON &&
    cmake --build "$build" --parallel "$(nproc)" &&
    mkdir -p "$build/lib" &&
    # Google Benchmark and the CUDA runtime are small and may be missing there: bundle them.
    ldd "$build"/tests/mgpu_* "$build"/bench/bench_* 2>/dev/null |
    awk '$1 ~ /^lib(benchmark|cudart)/ && $3 ~ /^\// {print $3}' | sort -u | xargs -r cp -L -t "$build/lib/"
  bundle_sanitizer
  touch "$build/.prepared"
}

# compute-sanitizer: the toolkit's, else the one the CUDA wheels ship (installed into the build, so
# a prepared build carries it to a GPU machine that cannot reach a package index).
find_sanitizer() {
  for s in "$(command -v compute-sanitizer)" /usr/local/cuda/bin/compute-sanitizer "$build"/sanitizer/nvidia/cu*/bin/compute-sanitizer; do
    [ -x "$s" ] && { echo "$s"; return 0; }
  done
  return 1
}
bundle_sanitizer() {
  find_sanitizer >/dev/null && return 0
  local major
  major=$(/usr/local/cuda/bin/nvcc --version 2>/dev/null | sed -n 's/.*release \([0-9]*\)\..*/\1/p')
  python3 -m pip install --quiet --no-deps --target "$build/sanitizer" "nvidia-cuda-sanitizer-api==${major:-13}.*" ||
    echo "gpu-check: could not install compute-sanitizer; the sanitizer stages will be skipped"
  return 0
}
export -f find_sanitizer bundle_sanitizer
export -f build_mgpu
export build arch

if [ "$mode" = prepare ]; then
  stage build 600 build_mgpu || exit 1
  du -sh "$build" | awk '{print "gpu-check: prepared build in " $2 " (" $1 "); carry it to the GPU machine"}'
  exit 0
fi

if [ -f "$build/.prepared" ]; then
  echo "gpu-check: using the prepared build in $build"
  summary+=("$(printf '%-10s %-18s %5ss' build "prepared" 0)")
else
  stage build 300 build_mgpu
fi

if [ -x "$build/tests/mgpu_tests" ]; then
  stage tests 150 "$build/tests/mgpu_tests"
  rc=0
  failed_before=$failed
  stage cuda_tests 150 "$build/tests/mgpu_cuda_tests" || rc=$?
  if [ "$rc" -eq 77 ]; then  # the CUDA tests' "skipped" exit code
    failed=$failed_before
    [ -n "$gpu_name" ] && failed=1  # a GPU is there, yet the tests saw none
    summary[-1]="$(printf '%-10s %-18s %5ss' cuda_tests "skipped (no GPU)" 0)"
  fi
fi

# The CUDA tests tagged [sanitize] (short, kernel-heavy) once more under compute-sanitizer: memcheck
# (out-of-bounds and misaligned accesses, leaks) and racecheck (shared-memory hazards in the block
# reductions). Each tool multiplies run time, hence the subset and the short limits.
sanitizer=$(find_sanitizer)
if [ -n "$gpu_name" ] && [ -x "$build/tests/mgpu_cuda_tests" ] && [ -n "$sanitizer" ]; then
  stage memcheck 120 "$sanitizer" --tool memcheck --leak-check full --error-exitcode 1 \
    "$build/tests/mgpu_cuda_tests" "${MGPU_SANITIZE_FILTER:-[sanitize]}"
  stage racecheck 90 "$sanitizer" --tool racecheck --racecheck-report hazard --error-exitcode 1 \
    "$build/tests/mgpu_cuda_tests" "${MGPU_SANITIZE_FILTER:-[sanitize]}"
elif [ -n "$gpu_name" ]; then
  summary+=("$(printf '%-10s %-18s %5ss' sanitizer "skipped (no tool)" 0)")
  failed=1
fi

if [ -n "$gpu_name" ]; then
  export MGPU_BENCH_BASELINES=0  # the host baselines (MPI, Gloo) are measured on the CPU machines
  for bench in "$build"/bench/bench_*; do
    [ -x "$bench" ] || continue
    name=$(basename "$bench")
    stage "$name" 120 "$bench" --benchmark_filter="${MGPU_BENCH_FILTER:-cuda}" --benchmark_min_time=0.05 \
      --benchmark_out="$out/$name.json" --benchmark_out_format=json
  done
else
  summary+=("$(printf '%-10s %-18s %5ss' benchmarks "skipped (no GPU)" 0)")
fi

echo
echo "== gpu-check summary: ${gpu_name:-no GPU} $(date -u +%Y-%m-%d)"
printf '%s\n' "${summary[@]}"
for json in "$out"/bench_*.json; do
  [ -f "$json" ] || continue
  python3 - "$json" <<'PY' || true
import json, sys
for b in json.load(open(sys.argv[1]))["benchmarks"]:
    if b.get("run_type") == "aggregate":
        continue
    if "busbw_GBps" in b:
        print(f"  {b['name']:<52} busbw {b['busbw_GBps']:8.1f} GB/s  roofline {b.get('roofline_frac', 0):.2f}")
    else:
        print(f"  {b['name']:<52} {b.get('GBps', 0):9.1f} GB/s  baseline {b.get('baseline_GBps', 0):9.1f} GB/s  frac {b.get('baseline_frac', 0):.2f}")
PY
done
exit "$failed"
