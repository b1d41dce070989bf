// bench_collectives: the host all-reduce against the machine's streaming bandwidth, OpenMPI's
// MPI_Allreduce and Gloo's ring all-reduce, all measured in the same run.
//
// Counters (nccl-tests definitions): algbw = S / t, busbw = algbw * 2(n-1)/n for n ranks of S
// bytes each; roofline_frac = (2 n S / t) / streaming bandwidth, 2 n S being the bytes that must
// move when each input is read once and each output written once. The streaming bandwidth is an
// in-place a[i] += b[i] over two 256 MiB float arrays on all cores, counting 3 bytes per element
// byte. Baselines run as helper processes (bench_mpi_allreduce under mpirun, bench_gloo_allreduce)
// from this executable's folder; a missing one reports 0. MGPU_BENCH_BASELINES=0 skips them.
//
// Where a GPU is visible it also measures the cuda_peer all-reduce on logical devices sharing GPU 0,
// with roofline_frac against a device-to-device cudaMemcpy (2 bytes moved per byte copied).
//
//   bench_collectives --benchmark_out=collectives.json --benchmark_out_format=json
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <mgpu/mgpu.hpp>

#if MGPU_CUDA_ENABLED
#include <cuda_runtime.h>
#endif

namespace {

using Clock = std::chrono::steady_clock;

std::vector<std::int64_t> const sizes = {4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20,
                                         4 << 20, 16 << 20, 64 << 20, 256 << 20};
std::vector<int> const rank_counts = {2, 4};

std::map<std::pair<int, std::int64_t>, double> mpi_seconds;   // (ranks, bytes) -> seconds per op
std::map<std::pair<int, std::int64_t>, double> gloo_seconds;
std::map<std::pair<int, std::int64_t>, double> our_seconds;
std::map<std::pair<int, std::int64_t>, double> our_stream_GBps;

double median(std::vector<double> v) {
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
  return v[v.size() / 2];
}

// a[i] += b[i] over two 256 MiB arrays, split over every hardware thread; median of `rounds`.
double measure_streaming_GBps(int rounds = 5) {
  std::size_t const n = (256u << 20) / sizeof(float);
  std::vector<float> a(n, 1.0f);
  std::vector<float> b(n, 2.0f);
  unsigned const threads = std::max(1u, std::thread::hardware_concurrency());
  std::vector<double> times;
  for (int round = 0; round < rounds; ++round) {
    auto const start = Clock::now();
    std::vector<std::thread> workers;
    for (unsigned t = 0; t < threads; ++t) {
      workers.emplace_back([&, t] {
        std::size_t const begin = n * t / threads;
        std::size_t const end = n * (t + 1) / threads;
        float* __restrict x = a.data();
        float const* __restrict y = b.data();
        for (std::size_t i = begin; i < end; ++i) x[i] += y[i];
      });
    }
    for (auto& w : workers) w.join();
    times.push_back(std::chrono::duration<double>(Clock::now() - start).count());
  }
  benchmark::DoNotOptimize(a.data());
  return 3.0 * static_cast<double>(n * sizeof(float)) / median(times) * 1e-9;
}

// Runs a baseline helper and reads its "bytes seconds" lines.
void run_baseline(std::string const& command, int ranks, std::map<std::pair<int, std::int64_t>, double>& into) {
  FILE* pipe = popen((command + " 2>/dev/null").c_str(), "r");
  if (pipe == nullptr) return;
  long long bytes = 0;
  double seconds = 0;
  while (std::fscanf(pipe, "%lld %lf", &bytes, &seconds) == 2) into[{ranks, bytes}] = seconds;
  pclose(pipe);
}

void measure_baselines(std::filesystem::path const& folder) {
  std::string size_list;
  for (auto s : sizes) size_list.append(" ").append(std::to_string(s));
  for (int ranks : rank_counts) {
    auto const mpi = folder / "bench_mpi_allreduce";
    if (std::filesystem::exists(mpi)) {
      std::string command = "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl=self,vader mpirun --oversubscribe -np ";
      command.append(std::to_string(ranks)).append(" ").append(mpi.string()).append(size_list);
      run_baseline(command, ranks, mpi_seconds);
    }
    auto const gloo = folder / "bench_gloo_allreduce";
    if (std::filesystem::exists(gloo)) {
      std::string command = gloo.string();
      command.append(" ").append(std::to_string(ranks)).append(size_list);
      run_baseline(command, ranks, gloo_seconds);
    }
  }
}

// Runs `step` (per_iteration operations) once per benchmark iteration; the median seconds per operation.
template <class Step>
double median_seconds_per_op(benchmark::State& state, Step const& step, int per_iteration) {
  std::vector<double> times;
  for (auto _ : state) {
    auto const start = Clock::now();
    step();
    double const seconds = std::chrono::duration<double>(Clock::now() - start).count();
    state.SetIterationTime(seconds);
    times.push_back(seconds / per_iteration);
  }
  return median(times);
}

double busbw(int ranks, std::int64_t bytes, double seconds) {
  if (seconds <= 0) return 0;
  return static_cast<double>(bytes) / seconds * 2.0 * (ranks - 1) / ranks * 1e-9;
}

// One host all-reduce (in place, float32 sum) per rank, K of them per timed iteration.
void BM_host_all_reduce(benchmark::State& state) {
  int const ranks = static_cast<int>(state.range(0));
  std::int64_t const bytes = state.range(1);
  std::int64_t const count = bytes / static_cast<std::int64_t>(sizeof(float));
  mgpu::DeviceGroup group("host:" + std::to_string(ranks));
  auto comm = mgpu::comm::make_communicator(group);
  std::vector<mgpu::Tensor> buffers;
  for (int r = 0; r < ranks; ++r) {
    buffers.push_back(mgpu::Tensor::empty({count}, mgpu::DType::float32, group.allocator(r)));
    std::fill(buffers.back().host_span<float>().begin(), buffers.back().host_span<float>().end(), 1.0f / ranks);
  }
  int const per_iteration = static_cast<int>(std::clamp<std::int64_t>((64 << 20) / bytes, 1, 256));
  auto const step = [&] {
    group.run([&](int rank, mgpu::Device, mgpu::Stream& stream) {
      auto const& b = buffers[static_cast<std::size_t>(rank)];
      for (int k = 0; k < per_iteration; ++k) comm->all_reduce(rank, b, b, mgpu::comm::ReduceOp::sum, stream);
    });
  };
  step();  // warm-up: touches every page
  double const t = median_seconds_per_op(state, step, per_iteration);
  // The machine is shared: measure the streaming bandwidth right beside each result.
  double const stream = measure_streaming_GBps(3);
  our_seconds[{ranks, bytes}] = t;
  our_stream_GBps[{ranks, bytes}] = stream;
  auto const key = std::pair{ranks, bytes};
  state.counters["ops_per_iteration"] = per_iteration;
  state.counters["bytes"] = static_cast<double>(bytes);
  state.counters["ranks"] = ranks;
  state.counters["algbw_GBps"] = static_cast<double>(bytes) / t * 1e-9;
  state.counters["busbw_GBps"] = busbw(ranks, bytes, t);
  state.counters["mpi_busbw_GBps"] = mpi_seconds.contains(key) ? busbw(ranks, bytes, mpi_seconds[key]) : 0.0;
  state.counters["gloo_busbw_GBps"] = gloo_seconds.contains(key) ? busbw(ranks, bytes, gloo_seconds[key]) : 0.0;
  state.counters["stream_GBps"] = stream;
  state.counters["roofline_frac"] = 2.0 * ranks * static_cast<double>(bytes) / t * 1e-9 / stream;
}

#if MGPU_CUDA_ENABLED
double device_copy_GBps = 0;

double measure_device_copy_GBps() {
  std::size_t const bytes = std::size_t{256} << 20;
  void* a = nullptr;
  void* b = nullptr;
  if (cudaMalloc(&a, bytes) != cudaSuccess || cudaMalloc(&b, bytes) != cudaSuccess) return 0;
  std::vector<double> times;
  for (int round = 0; round < 7; ++round) {
    auto const start = Clock::now();
    (void)cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice);
    (void)cudaDeviceSynchronize();
    times.push_back(std::chrono::duration<double>(Clock::now() - start).count());
  }
  (void)cudaFree(a);
  (void)cudaFree(b);
  return 2.0 * static_cast<double>(bytes) / median(times) * 1e-9;
}

// The cuda_peer all-reduce (in place, float32 sum) on `ranks` logical devices of GPU 0.
void BM_cuda_peer_all_reduce(benchmark::State& state) {
  int const ranks = static_cast<int>(state.range(0));
  std::int64_t const bytes = state.range(1);
  std::string spec = "cuda:0";
  for (int r = 1; r < ranks; ++r) spec.append(",0");
  mgpu::DeviceGroup group(spec);
  auto comm = mgpu::comm::make_communicator(group);
  std::vector<mgpu::Tensor> buffers;
  for (int r = 0; r < ranks; ++r) {
    buffers.push_back(mgpu::Tensor::empty({bytes / 4}, mgpu::DType::float32, group.allocator(r)));
    mgpu::fill_async(buffers.back(), 0.0f, group.stream(r));
  }
  int const per_iteration = static_cast<int>(std::clamp<std::int64_t>((256 << 20) / bytes, 1, 256));
  auto const step = [&] {
    group.run([&](int rank, mgpu::Device, mgpu::Stream& stream) {
      auto const& b = buffers[static_cast<std::size_t>(rank)];
      for (int k = 0; k < per_iteration; ++k) comm->all_reduce(rank, b, b, mgpu::comm::ReduceOp::sum, stream);
    });
  };
  step();
  double const t = median_seconds_per_op(state, step, per_iteration);
  state.counters["bytes"] = static_cast<double>(bytes);
  state.counters["ranks"] = ranks;
  state.counters["busbw_GBps"] = busbw(ranks, bytes, t);
  state.counters["d2d_copy_GBps"] = device_copy_GBps;
  state.counters["roofline_frac"] = device_copy_GBps > 0 ? 2.0 * ranks * static_cast<double>(bytes) / t * 1e-9 / device_copy_GBps : 0.0;
}
#endif

void print_table() {
  std::printf("\n%10s %5s %12s %12s %12s %9s %9s %12s\n", "size", "ranks", "ours busbw", "MPI busbw", "Gloo busbw",
              "vs MPI", "roofline", "streaming");
  for (int ranks : rank_counts) {
    for (auto bytes : sizes) {
      auto const key = std::pair{ranks, bytes};
      if (!our_seconds.contains(key)) continue;
      double const ours = busbw(ranks, bytes, our_seconds[key]);
      double const mpi = mpi_seconds.contains(key) ? busbw(ranks, bytes, mpi_seconds[key]) : 0.0;
      double const gloo = gloo_seconds.contains(key) ? busbw(ranks, bytes, gloo_seconds[key]) : 0.0;
      double const roofline = 2.0 * ranks * static_cast<double>(bytes) / our_seconds[key] * 1e-9 / our_stream_GBps[key];
      std::printf("%10s %5d %7.2f GB/s %7.2f GB/s %7.2f GB/s %8.1fx %9.2f %7.1f GB/s\n",
                  mgpu::format_bytes(static_cast<std::size_t>(bytes)).c_str(), ranks, ours, mpi, gloo,
                  mpi > 0 ? ours / mpi : 0.0, roofline, our_stream_GBps[key]);
    }
  }
  std::printf("roofline = (2 x ranks x size / time) / streaming, the streaming bandwidth (a[i] += b[i] over 256 MiB\n"
              "arrays on all cores, 3 bytes per element byte) measured beside each result; 1.0 is the memory's speed\n");
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  char const* baselines = std::getenv("MGPU_BENCH_BASELINES");
  if (baselines == nullptr || std::string(baselines) != "0") measure_baselines(std::filesystem::absolute(argv[0]).parent_path());
#if MGPU_CUDA_ENABLED
  if (mgpu::cuda_device_count() > 0) {
    device_copy_GBps = measure_device_copy_GBps();
    for (int ranks : rank_counts) {
      for (std::int64_t bytes : {std::int64_t{1} << 20, std::int64_t{16} << 20, std::int64_t{256} << 20}) {
        std::string name = "BM_cuda_peer_all_reduce/ranks:";
        name.append(std::to_string(ranks)).append("/bytes:").append(std::to_string(bytes));
        benchmark::RegisterBenchmark(name.c_str(), BM_cuda_peer_all_reduce)->Args({ranks, bytes})->UseManualTime()->Unit(benchmark::kMicrosecond);
      }
    }
  }
#endif
  for (int ranks : rank_counts) {
    for (auto bytes : sizes) {
      std::string name = "BM_host_all_reduce/ranks:";
      name.append(std::to_string(ranks)).append("/bytes:").append(std::to_string(bytes));
      benchmark::RegisterBenchmark(name.c_str(), BM_host_all_reduce)
          ->Args({ranks, bytes})
          ->UseManualTime()
          ->Unit(benchmark::kMicrosecond)
          ->MinTime(0.5);
    }
  }
  benchmark::RunSpecifiedBenchmarks();
  print_table();
  benchmark::Shutdown();
  return 0;
}
