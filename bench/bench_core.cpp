// bench_core: the core runtime's data movement against its baselines, measured in the same run.
// Each "ours" benchmark also times its baseline (std::memcpy on the host, raw cudaMemcpyAsync on a
// GPU) for the same bytes and reports `baseline_frac` = our bandwidth / the baseline's (medians).
// BM_host_stream_round_trip times one empty task's enqueue and synchronize, on the worker and inline.
// BM_cuda_gemm times mgpu::ops::gemm on square matrices against raw cublasGemmEx with the same
// types on the same GPU: `TFLOPs`, `cublas_TFLOPs` and `cublas_frac` = ours / cuBLAS.
//
//   bench_core --benchmark_format=json --benchmark_out=core.json
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <optional>
#include <vector>

#include <mgpu/mgpu.hpp>

#if MGPU_CUDA_ENABLED
#include <cublas_v2.h>
#include <cuda_runtime.h>
#endif

namespace {

using Clock = std::chrono::steady_clock;

template <class Fn>
double median_seconds(Fn&& fn, int repeats = 7) {
  std::vector<double> times;
  for (int i = 0; i < repeats; ++i) {
    auto const t0 = Clock::now();
    fn();
    times.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  std::nth_element(times.begin(), times.begin() + repeats / 2, times.end());
  return times[static_cast<std::size_t>(repeats / 2)];
}

// Times `ours` once per benchmark iteration and reports its median bandwidth against the baseline's.
template <class Ours>
void measure(benchmark::State& state, std::size_t bytes, double baseline_s, Ours&& ours) {
  std::vector<double> times;
  for (auto _ : state) {
    auto const t0 = Clock::now();
    ours();
    times.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  std::nth_element(times.begin(), times.begin() + static_cast<std::ptrdiff_t>(times.size() / 2), times.end());
  double const median = times[times.size() / 2];
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * static_cast<std::int64_t>(bytes));
  state.counters["bytes"] = static_cast<double>(bytes);
  state.counters["GBps"] = static_cast<double>(bytes) / median * 1e-9;
  state.counters["baseline_GBps"] = static_cast<double>(bytes) / baseline_s * 1e-9;
  state.counters["baseline_frac"] = baseline_s / median;
}

// copy_async between two host devices on a host stream, synchronized each time, vs std::memcpy.
void BM_host_copy_async(benchmark::State& state) {
  auto const bytes = static_cast<std::size_t>(state.range(0));
  auto a0 = mgpu::Allocator::create({mgpu::DeviceKind::host, 0});
  auto a1 = mgpu::Allocator::create({mgpu::DeviceKind::host, 1});
  auto const n = static_cast<std::int64_t>(bytes / sizeof(float));
  mgpu::Tensor src = mgpu::Tensor::empty({n}, mgpu::DType::float32, *a0);
  mgpu::Tensor dst = mgpu::Tensor::empty({n}, mgpu::DType::float32, *a1);
  std::fill(src.host_span<float>().begin(), src.host_span<float>().end(), 1.0f);
  mgpu::Stream stream({mgpu::DeviceKind::host, 1});
  double const baseline = median_seconds([&] {
    std::memcpy(dst.data(), src.data(), bytes);
    benchmark::ClobberMemory();
  });
  measure(state, bytes, baseline, [&] {
    mgpu::copy_async(dst, src, stream);
    stream.synchronize();
  });
}
BENCHMARK(BM_host_copy_async)->RangeMultiplier(16)->Range(4 << 10, 64 << 20)->UseRealTime();

// float32 -> bfloat16 conversion on a host stream, vs std::memcpy of the same source bytes.
// One empty task enqueued and waited for on a host stream: the worker's handoff (wake the worker,
// wake the waiter) against the same task under a Stream::InlineScope, which runs it on the
// caller's thread (real time per round trip).
void BM_host_stream_round_trip(benchmark::State& state) {
  mgpu::Stream stream(mgpu::Device{mgpu::DeviceKind::host, 0});
  std::optional<mgpu::Stream::InlineScope> scope;
  if (state.range(0) != 0) scope.emplace(stream);
  int ran = 0;
  for (auto _ : state) {
    stream.enqueue([&ran] { ++ran; });
    stream.synchronize();
  }
  benchmark::DoNotOptimize(ran);
}
BENCHMARK(BM_host_stream_round_trip)->ArgName("inline")->Arg(0)->Arg(1)->UseRealTime();

void BM_host_convert_bf16(benchmark::State& state) {
  auto const n = state.range(0);
  auto alloc = mgpu::Allocator::create({mgpu::DeviceKind::host, 0});
  mgpu::Tensor src = mgpu::Tensor::empty({n}, mgpu::DType::float32, *alloc);
  mgpu::Tensor dst = mgpu::Tensor::empty({n}, mgpu::DType::bfloat16, *alloc);
  mgpu::Tensor copy = mgpu::Tensor::empty({n}, mgpu::DType::float32, *alloc);
  std::fill(src.host_span<float>().begin(), src.host_span<float>().end(), 1.5f);
  mgpu::Stream stream({mgpu::DeviceKind::host, 0});
  double const baseline = median_seconds([&] {
    std::memcpy(copy.data(), src.data(), src.nbytes());
    benchmark::ClobberMemory();
  });
  measure(state, src.nbytes(), baseline, [&] {
    mgpu::convert_async(dst, src, stream);
    stream.synchronize();
  });
}
BENCHMARK(BM_host_convert_bf16)->RangeMultiplier(16)->Range(1 << 10, 16 << 20)->UseRealTime();

#if MGPU_CUDA_ENABLED
// copy_async host (pinned) -> GPU and GPU -> GPU vs raw cudaMemcpyAsync on the same stream.
void BM_cuda_copy_async(benchmark::State& state) {
  auto const bytes = static_cast<std::size_t>(state.range(0));
  bool const device_to_device = state.range(1) != 0;
  mgpu::DeviceGroup group("cuda:0,0");
  auto host = mgpu::Allocator::create({mgpu::DeviceKind::host, 0});
  auto const n = static_cast<std::int64_t>(bytes / sizeof(float));
  mgpu::Tensor src = device_to_device ? mgpu::Tensor::empty({n}, mgpu::DType::float32, group.allocator(1))
                                      : mgpu::Tensor::empty_pinned({n}, mgpu::DType::float32, *host);
  mgpu::Tensor dst = mgpu::Tensor::empty({n}, mgpu::DType::float32, group.allocator(0));
  auto& stream = group.stream(0);
  auto* raw = static_cast<cudaStream_t>(stream.native_handle());
  double const baseline = median_seconds([&] {
    (void)cudaMemcpyAsync(dst.data(), src.data(), bytes, cudaMemcpyDefault, raw);
    (void)cudaStreamSynchronize(raw);
  });
  measure(state, bytes, baseline, [&] {
    mgpu::copy_async(dst, src, stream);
    stream.synchronize();
  });
}

// float32 -> bfloat16 kernel vs a raw device-to-device copy of the same source bytes.
void BM_cuda_convert_bf16(benchmark::State& state) {
  auto const n = state.range(0);
  mgpu::DeviceGroup group("cuda:0");
  mgpu::Tensor src = mgpu::Tensor::empty({n}, mgpu::DType::float32, group.allocator(0));
  mgpu::Tensor dst = mgpu::Tensor::empty({n}, mgpu::DType::bfloat16, group.allocator(0));
  mgpu::Tensor copy = mgpu::Tensor::empty({n}, mgpu::DType::float32, group.allocator(0));
  auto& stream = group.stream(0);
  auto* raw = static_cast<cudaStream_t>(stream.native_handle());
  mgpu::fill_async(src, 1.5f, stream);
  double const baseline = median_seconds([&] {
    (void)cudaMemcpyAsync(copy.data(), src.data(), src.nbytes(), cudaMemcpyDeviceToDevice, raw);
    (void)cudaStreamSynchronize(raw);
  });
  measure(state, src.nbytes(), baseline, [&] {
    mgpu::convert_async(dst, src, stream);
    stream.synchronize();
  });
}

// C = A B for n x n row-major matrices (state.range(0) = n, state.range(1) = 1 for bfloat16, 0 for
// float32), 8 GEMMs per timed batch: mgpu::ops::gemm against raw cublasGemmEx on its own handle.
void BM_cuda_gemm(benchmark::State& state) {
  auto const n = state.range(0);
  bool const bf16 = state.range(1) != 0;
  mgpu::DType const dtype = bf16 ? mgpu::DType::bfloat16 : mgpu::DType::float32;
  constexpr int batch = 8;
  mgpu::DeviceGroup group("cuda:0");
  auto& stream = group.stream(0);
  mgpu::Tensor a = mgpu::Tensor::empty({n, n}, dtype, group.allocator(0));
  mgpu::Tensor b = mgpu::Tensor::empty({n, n}, dtype, group.allocator(0));
  mgpu::Tensor c = mgpu::Tensor::empty({n, n}, dtype, group.allocator(0));
  mgpu::fill_async(a, 0.5f, stream);
  mgpu::fill_async(b, 0.25f, stream);
  stream.synchronize();
  auto* raw = static_cast<cudaStream_t>(stream.native_handle());
  cublasHandle_t handle = nullptr;
  if (cublasCreate(&handle) != CUBLAS_STATUS_SUCCESS) {
    state.SkipWithError("cublasCreate failed");
    return;
  }
  (void)cublasSetStream(handle, raw);
  cudaDataType_t const type = bf16 ? CUDA_R_16BF : CUDA_R_32F;
  float const one = 1.0f;
  float const zero = 0.0f;
  auto const dim = static_cast<int>(n);
  // Row-major C = A B is column-major C^T = B^T A^T.
  auto raw_batch = [&] {
    for (int i = 0; i < batch; ++i)
      (void)cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, dim, dim, dim, &one, b.data(), type, dim, a.data(), type, dim, &zero,
                         c.data(), type, dim, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    (void)cudaStreamSynchronize(raw);
  };
  raw_batch();  // warm-up: cuBLAS picks its kernel
  double const baseline = median_seconds(raw_batch);
  (void)cublasDestroy(handle);
  auto ours_batch = [&] {
    for (int i = 0; i < batch; ++i) mgpu::ops::gemm(a, false, b, false, c, 1.0f, 0.0f, stream);
    stream.synchronize();
  };
  ours_batch();
  std::vector<double> times;
  for (auto _ : state) {
    auto const t0 = Clock::now();
    ours_batch();
    times.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  std::nth_element(times.begin(), times.begin() + static_cast<std::ptrdiff_t>(times.size() / 2), times.end());
  double const median = times[times.size() / 2];
  double const flop = 2.0 * static_cast<double>(n) * static_cast<double>(n) * static_cast<double>(n) * batch;
  state.counters["TFLOPs"] = flop / median * 1e-12;
  state.counters["cublas_TFLOPs"] = flop / baseline * 1e-12;
  state.counters["cublas_frac"] = baseline / median;
}
#endif

}  // namespace

int main(int argc, char** argv) {
#if MGPU_CUDA_ENABLED
  if (mgpu::cuda_device_count() > 0) {
    benchmark::RegisterBenchmark("BM_cuda_copy_async/h2d", BM_cuda_copy_async)
        ->ArgsProduct({{1 << 20, 16 << 20, 256 << 20}, {0}})
        ->UseRealTime();
    benchmark::RegisterBenchmark("BM_cuda_copy_async/d2d", BM_cuda_copy_async)
        ->ArgsProduct({{1 << 20, 16 << 20, 256 << 20}, {1}})
        ->UseRealTime();
    benchmark::RegisterBenchmark("BM_cuda_convert_bf16", BM_cuda_convert_bf16)
        ->Arg(1 << 20)
        ->Arg(64 << 20)
        ->UseRealTime();
    benchmark::RegisterBenchmark("BM_cuda_gemm", BM_cuda_gemm)
        ->ArgNames({"n", "bf16"})
        ->ArgsProduct({{1024, 4096, 8192}, {0, 1}})
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
  }
#endif
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
