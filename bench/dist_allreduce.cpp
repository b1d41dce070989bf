// bench_dist_allreduce: the hierarchical all-reduce across processes (mgpu::dist::make_communicator)
// for bench_collectives' multi-process mode, which launches it through mpirun, one process per
// "server". Usage: bench_dist_allreduce DEVICES BYTES...: each process drives DEVICES host devices;
// for each size, every world rank all-reduces BYTES of float32 in place (sum). Process 0 prints
// "bytes seconds local_seconds" per size, seconds being the median over 5 rounds of the slowest
// process's time per all-reduce, and local_seconds the same for the in-process part alone: the
// host communicator's all-reduce over each process's own devices, every process at once (what the
// hierarchical all-reduce does inside a process, with no exchange between processes).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <mgpu/dist/dist.hpp>

#include "bench_support.hpp"

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s DEVICES BYTES...\n", argv[0]);
    return 2;
  }
  try {
    mgpu::dist::Session session;
    mgpu::DeviceGroup group("host:" + std::string(argv[1]));
    mgpu::dist::World const world = mgpu::dist::make_world(group);
    auto comm = mgpu::dist::make_communicator(world, group);
    auto local = mgpu::comm::make_communicator(group);
    mgpu::Tensor const slowest = mgpu::Tensor::empty({1}, mgpu::DType::float32, group.allocator(0));
    for (int a = 2; a < argc; ++a) {
      std::int64_t const count = std::atoll(argv[a]) / static_cast<std::int64_t>(sizeof(float));
      std::vector<mgpu::Tensor> buffers;
      for (int r = 0; r < group.size(); ++r) {
        buffers.push_back(mgpu::Tensor::empty({count}, mgpu::DType::float32, group.allocator(r)));
        std::fill(buffers.back().host_span<float>().begin(), buffers.back().host_span<float>().end(), 1.0f / static_cast<float>(world.size()));
      }
      int const iterations = bench::baseline_repetitions(count * 4);
      // Runs `times` all-reduces of `c` (world ranks: `world_ranks`) on every rank.
      auto const run = [&](mgpu::comm::Communicator& c, bool world_ranks, int times) {
        group.run([&](int rank, mgpu::Device, mgpu::Stream& stream) {
          auto const& b = buffers[static_cast<std::size_t>(rank)];
          int const r = world_ranks ? world.rank_of(rank) : rank;
          for (int i = 0; i < times; ++i) c.all_reduce(r, b, b, mgpu::comm::ReduceOp::sum, stream);
        });
      };
      run(*comm, true, 1);  // warm-up: touches every page
      std::vector<double> rounds;
      std::vector<double> local_rounds;
      for (int round = 0; round < 10; ++round) {  // even rounds across processes, odd ones inside each
        bool const across = round % 2 == 0;
        run(*comm, true, 1);  // the processes start the round together
        auto const start = std::chrono::steady_clock::now();
        run(across ? *comm : *local, across, iterations);
        slowest.host_span<float>()[0] = static_cast<float>(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / iterations);
        group.run([&](int rank, mgpu::Device, mgpu::Stream& stream) {
          if (rank == 0) {
            comm->all_reduce(world.rank_of(0), slowest, slowest, mgpu::comm::ReduceOp::max, stream);
          } else {
            mgpu::Tensor const mine = mgpu::Tensor::empty({1}, mgpu::DType::float32, group.allocator(rank));
            mgpu::fill_async(mine, 0.0f, stream);
            comm->all_reduce(world.rank_of(rank), mine, mine, mgpu::comm::ReduceOp::max, stream);
          }
        });
        (across ? rounds : local_rounds).push_back(slowest.host_span<float>()[0]);
      }
      if (world.process == 0)
        std::printf("%lld %.9g %.9g\n", static_cast<long long>(count * 4), bench::median(rounds), bench::median(local_rounds));
    }
  } catch (mgpu::Error const& e) {
    std::fprintf(stderr, "bench_dist_allreduce: %s\n", e.what());
    return 1;
  }
  return 0;
}
