// mgpu_mpi_dist's failure mode (tests/dist/mpi_dist.cpp says what it checks): a step out of memory in
// one process fails in every process, and the executors go on.
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>

#include <mgpu/nn/gpt.hpp>
#include <mgpu/nn/loss.hpp>
#include <mgpu/optim/optim.hpp>
#include <mgpu/parallel/data_parallel.hpp>
#include <mgpu/parallel/tensor_parallel.hpp>

#include "mpi_dist.hpp"

namespace mpi_dist {

// A step that runs out of memory in the last process (its first device's memory limited, a batch
// 16 times larger) fails on every process, the others at their 3 s deadline at the latest; each
// process makes its communicators anew and the run goes on as one process's that never saw it:
// DataParallel (each process its rows), a GPT pipeline over the world's devices and TensorParallel
// over them. Each executor on a group of its own, since a failing rank aborts every communicator
// over its group.
void test_failure(Setup const& s) {
  namespace pp = mgpu::pipeline;
  namespace par = mgpu::parallel;
  std::shared_ptr<mgpu::Allocator> host = mgpu::Allocator::create({mgpu::DeviceKind::host, 0});
  bool const failing = process == s.world.processes - 1;
  std::string const devices = "host:" + std::to_string(s.local());
  // Runs `fail` (a step that must fail, out of memory in the failing process) with the failing
  // process's `limited` allocator at its current use plus a little.
  auto const expect_failed_step = [&](mgpu::Allocator& limited, std::string const& what, auto const& fail) {
    if (failing) limited.set_limit(limited.stats().reserved + (std::size_t{16} << 10));
    try {
      fail();
      EXPECT(false, what << ": the step did not fail");
    } catch (mgpu::Error const& e) {
      EXPECT(!failing || e.category() == mgpu::Errc::out_of_memory, what << ": " << e.what() << " (expected out_of_memory)");
    }
    if (failing) limited.set_limit(std::nullopt);
  };
  {
    std::string const what = "data_parallel";
    std::int64_t const rows = 29;
    std::mt19937 rng(9);
    std::normal_distribution<float> normal(0, 1);
    auto const random = [&](std::int64_t n, bool labels) {
      Tensor t = labels ? Tensor::empty({n}, DType::float32, *host) : Tensor::empty({n, 6}, DType::float32, *host);
      for (float& v : t.host_span<float>()) v = labels ? static_cast<float>(rng() % 4) : normal(rng);
      return t;
    };
    std::vector<Tensor> xs, ys;
    for (int b = 0; b < 3; ++b) {
      xs.push_back(random(rows, false));
      ys.push_back(random(rows, true));
    }
    std::vector<std::int64_t> const shards = mgpu::shard_sizes(rows, s.size());
    std::int64_t begin = 0;
    for (int r = 0; r < s.rank(0); ++r) begin += shards[static_cast<std::size_t>(r)];
    std::int64_t end = begin;
    for (int l = 0; l < s.local(); ++l) end += shards[static_cast<std::size_t>(s.rank(l))];
    Tensor const big_x = random(16 * (end - begin), false);
    Tensor const big_y = random(16 * (end - begin), true);
    mgpu::DeviceGroup own(devices);
    mgpu::parallel::DataParallelOptions options;
    options.comm.timeout = 3s;
    mgpu::optim::AdamW const adamw(mgpu::optim::AdamWOptions{.lr = 0.01f});
    mgpu::DeviceGroup one("host:" + std::to_string(s.size()));
    mgpu::parallel::DataParallel reference(dp_model(true), one, adamw, options);
    options.make_communicator = mgpu::dist::communicator_factory(s.world);
    mgpu::parallel::DataParallel dp(dp_model(true), own, adamw, options);
    auto const good_step = [&](std::size_t b) {
      float const expected = reference.step(xs[b], ys[b]).loss;
      float const got = dp.step(xs[b].slice(begin, end), ys[b].slice(begin, end)).loss;
      EXPECT(std::abs(got - expected) <= 1e-5f * std::abs(expected), what << ": step " << b << " loss " << got << " (expected " << expected << ")");
    };
    good_step(0);
    expect_failed_step(own.allocator(0), what, [&] {
      (void)(failing ? dp.step(big_x, big_y) : dp.step(xs[1].slice(begin, end), ys[1].slice(begin, end)));
    });
    for (std::size_t b = 1; b < xs.size(); ++b) good_step(b);
  }
  mgpu::nn::GptConfig const config{.vocab = 32, .block_size = 8, .n_layer = 2, .n_head = 2, .n_embd = 16, .dropout = 0.1f};
  TokenBatches const batches = token_batches(3, 4, 32, 21);
  TokenBatches const big = token_batches(1, 64, 32, 22);
  if (s.size() >= 2) {
    std::string const what = "GPT pipeline";
    mgpu::nn::Sequential const model = mgpu::nn::gpt(config);
    std::vector<std::size_t> const cuts = pp::partition(model, s.size(), std::vector<double>(model.size(), 1.0)).cuts;
    pp::ExecutorOptions options{.seed = 5, .timeout = 3s, .clip_norm = 0.1f, .loss = std::make_shared<mgpu::nn::TokenCrossEntropy>()};
    mgpu::DeviceGroup one("host:" + std::to_string(s.size()));
    pp::Executor reference(model, one, cuts, pp::one_f_one_b(s.size(), 2), chunk_adamw, options);
    options.make_communicator = mgpu::dist::communicator_factory(s.world);
    options.make_subset_communicator = mgpu::dist::subset_communicator_factory(s.world);  // the tied wte's sum
    mgpu::DeviceGroup own(devices);
    pp::Executor executor(model, own, cuts, pp::one_f_one_b(s.size(), 2), chunk_adamw, options);
    auto const good_step = [&](std::size_t b) {
      float const expected = reference.step(batches.xs[b], batches.ys[b]);
      float const got = executor.step(batches.xs[b], batches.ys[b]);
      EXPECT(std::memcmp(&got, &expected, sizeof got) == 0, what << ": step " << b << " loss " << got << " (expected " << expected << ")");
    };
    good_step(0);
    expect_failed_step(own.allocator(0), what, [&] { (void)executor.step(big.xs[0], big.ys[0]); });
    for (std::size_t b = 1; b < batches.xs.size(); ++b) good_step(b);
  }
  if (s.size() == 2 || s.size() == 4) {  // ranks dividing the heads
    mgpu::nn::GptConfig tp_config = config;
    tp_config.n_head = 4;
    std::string const what = "tensor parallel";
    par::TensorParallelOptions options{.seed = 5, .adamw = {.lr = 0.01f}, .comm = {.timeout = 3s}};
    mgpu::DeviceGroup one("host:" + std::to_string(s.size()));
    par::TensorParallel reference(one, mgpu::nn::gpt(tp_config), options);
    options.make_communicator = mgpu::dist::communicator_factory(s.world);
    options.make_subset_communicator = mgpu::dist::subset_communicator_factory(s.world);
    mgpu::DeviceGroup own(devices);
    par::TensorParallel tp(own, mgpu::nn::gpt(tp_config), options);
    auto const good_step = [&](std::size_t b) {
      double const expected = reference.step(batches.xs[b], batches.ys[b]).loss;
      double const got = tp.step(batches.xs[b], batches.ys[b]).loss;
      EXPECT(std::abs(got - expected) <= 1e-5 * std::abs(expected), what << ": step " << b << " loss " << got << " (expected " << expected << ")");
    };
    good_step(0);
    expect_failed_step(own.allocator(0), what, [&] { (void)tp.step(big.xs[0], big.ys[0]); });
    for (std::size_t b = 1; b < batches.xs.size(); ++b) good_step(b);
  }
}

}  // namespace mpi_dist
