// bench_gloo_allreduce: the Gloo baseline for bench_collectives. Runs N ranks as threads of one
// process, connected over loopback TCP, and for each size in bytes prints "bytes seconds": the
// median (over 5 rounds; bench_quick.hpp) of the slowest rank's time per ring all-reduce (float sum).
//   bench_gloo_allreduce RANKS BYTES...
#include <gloo/allreduce_ring.h>
#include <gloo/barrier_all_to_all.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/hash_store.h>
#include <gloo/transport/tcp/device.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <thread>
#include <vector>

#include "bench_quick.hpp"

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: bench_gloo_allreduce RANKS BYTES...\n");
    return 2;
  }
  int const ranks = std::atoi(argv[1]);
  std::vector<long> sizes;
  for (int a = 2; a < argc; ++a) sizes.push_back(std::atol(argv[a]));

  gloo::transport::tcp::attr attr;
  attr.hostname = "127.0.0.1";
  auto device = gloo::transport::tcp::CreateDevice(attr);
  gloo::rendezvous::HashStore store;
  std::size_t const rounds_per_size = static_cast<std::size_t>(bench::baseline_rounds());
  std::vector<std::vector<double>> per_rank(static_cast<std::size_t>(ranks), std::vector<double>(sizes.size() * rounds_per_size));

  std::vector<std::thread> threads;
  for (int rank = 0; rank < ranks; ++rank) {
    threads.emplace_back([&, rank] {
      auto context = std::make_shared<gloo::rendezvous::Context>(rank, ranks);
      context->connectFullMesh(store, device);
      gloo::BarrierAllToAll barrier(context);
      for (std::size_t s = 0; s < sizes.size(); ++s) {
        std::vector<float> buffer(static_cast<std::size_t>(sizes[s]) / sizeof(float), 1.0f);
        gloo::AllreduceRing<float> allreduce(context, {buffer.data()}, static_cast<int>(buffer.size()));
        int const iterations = bench::baseline_repetitions(sizes[s]);
        allreduce.run();
        for (std::size_t round = 0; round < rounds_per_size; ++round) {
          barrier.run();
          auto const start = std::chrono::steady_clock::now();
          for (int i = 0; i < iterations; ++i) allreduce.run();
          per_rank[static_cast<std::size_t>(rank)][s * rounds_per_size + round] =
              std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / iterations;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  for (std::size_t s = 0; s < sizes.size(); ++s) {
    std::vector<double> rounds;
    for (std::size_t round = 0; round < rounds_per_size; ++round) {
      double slowest = 0;
      for (auto const& r : per_rank) slowest = std::max(slowest, r[s * rounds_per_size + round]);
      rounds.push_back(slowest);
    }
    std::nth_element(rounds.begin(), rounds.begin() + static_cast<std::ptrdiff_t>(rounds_per_size / 2), rounds.end());
    std::printf("%ld %.9g\n", sizes[s], rounds[rounds_per_size / 2]);
  }
  return 0;
}
