// bench_collectives: the host all-reduce against a bare in-process reduction of the same size,
// OpenMPI's MPI_Allreduce and Gloo's ring all-reduce, all measured in the same run; and across
// processes, the dist module's hierarchical all-reduce against MPI_Allreduce.
//
// Counters (nccl-tests definitions): algbw = S / t, busbw = algbw * 2(n-1)/n for n ranks of S
// bytes each. bare_reduce_ratio = t_bare / t: the time of the same reduction written as bare
// loops (n threads, thread r summing its slice of all n buffers and writing the sum back to all
// n, with no library and no synchronisation between operations) over the library's time; 1.0
// means the library adds nothing to the memory traffic every all-reduce must do. The MPI and Gloo
// baselines run as separate processes (bench_mpi_allreduce under mpirun, bench_gloo_allreduce)
// from this executable's folder, so their data crosses process boundaries; a missing one reports
// 0. MGPU_BENCH_BASELINES=0 skips them.
//
// Multi-process mode (built with MPI): BM_dist_all_reduce/processes:2/devices:D/bytes:S reports
// mgpu::dist's hierarchical all-reduce across 2 processes of D host devices each (bench_dist_allreduce
// under mpirun: each local rank reduces its slice inside the process and swaps it with the same
// rank of the other process, here through the shared memory of their host), beside plain
// MPI_Allreduce over as many ranks (2 D processes, bench_mpi_allreduce) in the same run:
// busbw_GBps, mpi_busbw_GBps and vs_mpi_ratio = MPI's time / ours (> 1: ours is faster);
// no_shm_busbw_GBps and no_shm_vs_mpi_ratio: the same with the swap over MPI point-to-point
// (MGPU_DIST_SHM=0), as between servers. The ceiling, measured in the same run: in_process_share
// = the in-process part alone (the host all-reduce over each process's D devices, both processes
// at once) over our time, and ceiling_vs_mpi_ratio = MPI's time / (that part + MPI_Allreduce of
// the same bytes over 2 processes): the vs_mpi_ratio of a hierarchical all-reduce whose exchange
// between the processes were as fast as OpenMPI's own and did not overlap the in-process work.
// Built with Gloo, the same all-reduce as a torchrun-style job (bench_dist_allreduce under
// scripts/mgpu-run: the leaders exchange over Gloo): torchrun_gloo_busbw_GBps,
// torchrun_gloo_vs_gloo_ring_ratio = Gloo's ring all-reduce over 2 D ranks (bench_gloo_allreduce)
// / ours, and torchrun_gloo_vs_mpi_ratio = MPI_Allreduce over 2 D processes / ours.
//
// Where a GPU is visible it also measures the cuda_peer all-reduce on logical devices sharing GPU 0,
// with d2d_copy_ratio = (2 n S / t) over a device-to-device cudaMemcpy's bandwidth (2 bytes
// moved per byte copied); buffers that fit the GPU's L2 can read above 1.
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

#include "bench_support.hpp"

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
std::map<std::pair<int, std::int64_t>, double> bare_seconds;
// Multi-process mode: 2 processes of `devices` host devices each; (devices, bytes) -> seconds per op.
std::vector<int> const dist_devices = {1, 2};
std::vector<std::int64_t> const dist_sizes = {64 << 10, 1 << 20, 16 << 20, 64 << 20};
std::map<std::pair<int, std::int64_t>, double> dist_seconds;
std::map<std::pair<int, std::int64_t>, double> dist_local_seconds;  // its in-process part alone
std::map<std::pair<int, std::int64_t>, double> dist_no_shm_seconds;  // over MPI point-to-point
std::map<std::pair<int, std::int64_t>, double> dist_gloo_seconds;  // torchrun-style (mgpu-run), over Gloo

using bench::median;

// The reduction an in-place all-reduce must do, as bare loops: `ranks` threads, thread r summing
// its slice of every buffer (in blocks that stay in L1) and writing the sum back to every buffer,
// `per_iteration` times. No thread reads another's slice, so none waits for another. Median
// seconds per reduction over `rounds`.
double measure_bare_reduce_seconds(int ranks, std::int64_t count, int per_iteration, int rounds) {
  std::vector<std::vector<float>> buffers(static_cast<std::size_t>(ranks),
                                          std::vector<float>(static_cast<std::size_t>(count), 1.0f / static_cast<float>(ranks)));
  std::vector<double> times;
  for (int round = 0; round < rounds; ++round) {
    auto const start = Clock::now();
    std::vector<std::thread> workers;
    for (int r = 0; r < ranks; ++r) {
      workers.emplace_back([&, r] {
        constexpr std::int64_t block = 1024;
        float acc[block];
        std::int64_t const begin = count * r / ranks;
        std::int64_t const end = count * (r + 1) / ranks;
        for (int k = 0; k < per_iteration; ++k) {
          for (std::int64_t b = begin; b < end; b += block) {
            std::int64_t const len = std::min(block, end - b);
            float const* first = buffers[0].data() + b;
            for (std::int64_t j = 0; j < len; ++j) acc[j] = first[j];
            for (std::size_t p = 1; p < buffers.size(); ++p) {
              float const* src = buffers[p].data() + b;
              for (std::int64_t j = 0; j < len; ++j) acc[j] += src[j];
            }
            for (auto& buffer : buffers) std::copy_n(acc, len, buffer.data() + b);
          }
        }
      });
    }
    for (auto& w : workers) w.join();
    times.push_back(std::chrono::duration<double>(Clock::now() - start).count() / per_iteration);
  }
  for (auto const& buffer : buffers) benchmark::DoNotOptimize(buffer.data());
  return median(times);
}

// Runs a baseline helper and reads its "bytes seconds" lines; a third number on a line goes to `third`.
void run_baseline(std::string const& command, int ranks, std::map<std::pair<int, std::int64_t>, double>& into,
                  std::map<std::pair<int, std::int64_t>, double>* third = nullptr) {
  FILE* pipe = popen((command + " 2>/dev/null").c_str(), "r");
  if (pipe == nullptr) return;
  char line[256];
  while (std::fgets(line, sizeof line, pipe) != nullptr) {
    long long bytes = 0;
    double seconds = 0;
    double extra = 0;
    int const fields = std::sscanf(line, "%lld %lf %lf", &bytes, &seconds, &extra);
    if (fields < 2) break;
    into[{ranks, bytes}] = seconds;
    if (fields == 3 && third != nullptr) (*third)[{ranks, bytes}] = extra;
  }
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
    auto const dist = folder / "bench_dist_allreduce";
    if (std::filesystem::exists(dist) && ranks % 2 == 0) {
      int const devices = ranks / 2;
      std::string command = "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl=self,vader mpirun --oversubscribe -np 2 ";
      command.append(dist.string()).append(" ").append(std::to_string(devices));
      for (auto s : dist_sizes) command.append(" ").append(std::to_string(s));
      run_baseline(command, devices, dist_seconds, &dist_local_seconds);
      run_baseline("MGPU_DIST_SHM=0 " + command, devices, dist_no_shm_seconds);
#if defined(MGPU_RUN_SCRIPT)
      if (mgpu::built_with_gloo) {  // the same all-reduce in a torchrun-style job: the leaders over Gloo
        std::string torchrun = std::string(MGPU_RUN_SCRIPT) + " --nproc 2 " + dist.string() + " " + std::to_string(devices);
        for (auto s : dist_sizes) torchrun.append(" ").append(std::to_string(s));
        run_baseline(torchrun, devices, dist_gloo_seconds);
      }
#endif
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
  // The machine is shared: measure the bare reduction right beside each result.
  double const bare = measure_bare_reduce_seconds(ranks, count, per_iteration, 5);
  our_seconds[{ranks, bytes}] = t;
  bare_seconds[{ranks, bytes}] = bare;
  auto const key = std::pair{ranks, bytes};
  state.counters["ops_per_iteration"] = per_iteration;
  state.counters["bytes"] = static_cast<double>(bytes);
  state.counters["ranks"] = ranks;
  state.counters["algbw_GBps"] = static_cast<double>(bytes) / t * 1e-9;
  state.counters["busbw_GBps"] = busbw(ranks, bytes, t);
  state.counters["mpi_busbw_GBps"] = mpi_seconds.contains(key) ? busbw(ranks, bytes, mpi_seconds[key]) : 0.0;
  state.counters["gloo_busbw_GBps"] = gloo_seconds.contains(key) ? busbw(ranks, bytes, gloo_seconds[key]) : 0.0;
  state.counters["bare_reduce_busbw_GBps"] = busbw(ranks, bytes, bare);
  state.counters["bare_reduce_ratio"] = bare / t;
}

// Reports the multi-process measurement taken before the benchmarks ran (measure_baselines).
void BM_dist_all_reduce(benchmark::State& state) {
  int const devices = static_cast<int>(state.range(0));
  std::int64_t const bytes = state.range(1);
  int const ranks = 2 * devices;
  double const t = dist_seconds.at({devices, bytes});
  for (auto _ : state) state.SetIterationTime(t);
  auto const mpi = mpi_seconds.find({ranks, bytes});
  auto const mpi_two = mpi_seconds.find({2, bytes});
  double const local = dist_local_seconds[{devices, bytes}];
  state.counters["processes"] = 2;
  state.counters["devices_per_process"] = devices;
  state.counters["bytes"] = static_cast<double>(bytes);
  state.counters["busbw_GBps"] = busbw(ranks, bytes, t);
  state.counters["mpi_busbw_GBps"] = mpi != mpi_seconds.end() ? busbw(ranks, bytes, mpi->second) : 0.0;
  state.counters["vs_mpi_ratio"] = mpi != mpi_seconds.end() ? mpi->second / t : 0.0;
  auto const no_shm = dist_no_shm_seconds.find({devices, bytes});
  state.counters["no_shm_busbw_GBps"] = no_shm != dist_no_shm_seconds.end() ? busbw(ranks, bytes, no_shm->second) : 0.0;
  state.counters["no_shm_vs_mpi_ratio"] =
      mpi != mpi_seconds.end() && no_shm != dist_no_shm_seconds.end() ? mpi->second / no_shm->second : 0.0;
  auto const gloo = dist_gloo_seconds.find({devices, bytes});
  auto const ring = gloo_seconds.find({ranks, bytes});
  bool const over_gloo = gloo != dist_gloo_seconds.end();
  state.counters["torchrun_gloo_busbw_GBps"] = over_gloo ? busbw(ranks, bytes, gloo->second) : 0.0;
  state.counters["torchrun_gloo_vs_gloo_ring_ratio"] =
      over_gloo && ring != gloo_seconds.end() ? ring->second / gloo->second : 0.0;
  state.counters["torchrun_gloo_vs_mpi_ratio"] = over_gloo && mpi != mpi_seconds.end() ? mpi->second / gloo->second : 0.0;
  state.counters["in_process_share"] = local / t;
  state.counters["ceiling_vs_mpi_ratio"] =
      mpi != mpi_seconds.end() && mpi_two != mpi_seconds.end() ? mpi->second / (local + mpi_two->second) : 0.0;
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
  state.counters["d2d_copy_ratio"] = device_copy_GBps > 0 ? 2.0 * ranks * static_cast<double>(bytes) / t * 1e-9 / device_copy_GBps : 0.0;
}
#endif

void print_table() {
  std::printf("\n%10s %5s %12s %12s %12s %9s %12s %9s\n", "size", "ranks", "ours busbw", "MPI busbw", "Gloo busbw",
              "vs MPI", "bare busbw", "vs bare");
  for (int ranks : rank_counts) {
    for (auto bytes : sizes) {
      auto const key = std::pair{ranks, bytes};
      if (!our_seconds.contains(key)) continue;
      double const ours = busbw(ranks, bytes, our_seconds[key]);
      double const mpi = mpi_seconds.contains(key) ? busbw(ranks, bytes, mpi_seconds[key]) : 0.0;
      double const gloo = gloo_seconds.contains(key) ? busbw(ranks, bytes, gloo_seconds[key]) : 0.0;
      double const bare = busbw(ranks, bytes, bare_seconds[key]);
      std::printf("%10s %5d %7.2f GB/s %7.2f GB/s %7.2f GB/s %8.1fx %7.2f GB/s %9.2f\n",
                  mgpu::format_bytes(static_cast<std::size_t>(bytes)).c_str(), ranks, ours, mpi, gloo,
                  mpi > 0 ? ours / mpi : 0.0, bare, ours / bare);
    }
  }
  if (!dist_seconds.empty()) {
    std::printf("\nacross processes: 2 processes x D host devices (hierarchical) against MPI_Allreduce over 2 D processes\n");
    std::printf("%10s %3s %12s %12s %9s %13s %11s %9s\n", "size", "D", "ours busbw", "MPI busbw", "vs MPI", "no shm vs MPI",
                "in-process", "ceiling");
    for (auto const& [key, seconds] : dist_seconds) {
      auto const [devices, bytes] = key;
      int const ranks = 2 * devices;
      double const mpi = mpi_seconds.contains({ranks, bytes}) ? mpi_seconds[{ranks, bytes}] : 0.0;
      double const mpi_two = mpi_seconds.contains({2, bytes}) ? mpi_seconds[{2, bytes}] : 0.0;
      double const local = dist_local_seconds[key];
      double const no_shm = dist_no_shm_seconds.contains(key) ? dist_no_shm_seconds[key] : 0.0;
      std::printf("%10s %3d %7.2f GB/s %7.2f GB/s %8.2fx %12.2fx %10.0f%% %8.2fx\n",
                  mgpu::format_bytes(static_cast<std::size_t>(bytes)).c_str(), devices, busbw(ranks, bytes, seconds),
                  busbw(ranks, bytes, mpi), mpi / seconds, no_shm > 0 ? mpi / no_shm : 0.0, 100.0 * local / seconds,
                  mpi_two > 0 ? mpi / (local + mpi_two) : 0.0);
    }
    if (!dist_gloo_seconds.empty()) {
      std::printf("\ntorchrun-style (scripts/mgpu-run, the leaders over Gloo): 2 processes x D host devices against Gloo's\n"
                  "ring all-reduce and MPI_Allreduce over 2 D ranks\n");
      std::printf("%10s %3s %12s %12s %13s %9s\n", "size", "D", "ours busbw", "ring busbw", "vs Gloo ring", "vs MPI");
      for (auto const& [key, seconds] : dist_gloo_seconds) {
        auto const [devices, bytes] = key;
        int const ranks = 2 * devices;
        double const ring = gloo_seconds.contains({ranks, bytes}) ? gloo_seconds[{ranks, bytes}] : 0.0;
        double const mpi = mpi_seconds.contains({ranks, bytes}) ? mpi_seconds[{ranks, bytes}] : 0.0;
        std::printf("%10s %3d %7.2f GB/s %7.2f GB/s %12.2fx %8.2fx\n", mgpu::format_bytes(static_cast<std::size_t>(bytes)).c_str(),
                    devices, busbw(ranks, bytes, seconds), busbw(ranks, bytes, ring), ring / seconds, mpi / seconds);
      }
    }
    std::printf("no shm = the swap between the processes over MPI point-to-point (MGPU_DIST_SHM=0) instead of their host's\n"
                "shared memory; in-process = the in-process all-reduce alone over our time; ceiling = MPI's time over\n"
                "(in-process + MPI's over 2 processes): our vs MPI with an exchange between the processes as fast as OpenMPI's own.\n");
  }
  std::printf("vs bare = bare reduction time / our time, the bare reduction being the same sums as plain loops on as many\n"
              "threads as ranks, measured beside each result. MPI and Gloo run as separate processes (oversubscribed when\n"
              "ranks exceed the cores).\n");
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
  for (auto const& [key, seconds] : dist_seconds) {
    std::string name = "BM_dist_all_reduce/processes:2/devices:";
    name.append(std::to_string(key.first)).append("/bytes:").append(std::to_string(key.second));
    benchmark::RegisterBenchmark(name.c_str(), BM_dist_all_reduce)->Args({key.first, key.second})->UseManualTime()->Unit(benchmark::kMicrosecond)->Iterations(bench::iterations(1));
  }
  for (int ranks : rank_counts) {
    for (auto bytes : sizes) {
      std::string name = "BM_host_all_reduce/ranks:";
      name.append(std::to_string(ranks)).append("/bytes:").append(std::to_string(bytes));
      benchmark::RegisterBenchmark(name.c_str(), BM_host_all_reduce)
          ->Args({ranks, bytes})
          ->UseManualTime()
          ->Unit(benchmark::kMicrosecond)
          ->MinTime(bench::min_time(0.5));
    }
  }
  benchmark::RunSpecifiedBenchmarks();
  print_table();
  benchmark::Shutdown();
  return 0;
}
