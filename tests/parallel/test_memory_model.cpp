// parallel::predict_gpt_memory: its parameter bytes against the shards the executors really make,
// its split of the rows, and its refusals. The whole prediction against the allocator's measured
// peaks in every layout is tests/examples/memory_model_check.sh (through train_gpt).
#include <mgpu/parallel/memory_model.hpp>

#include <cstddef>
#include <string>
#include <vector>

#include <mgpu/core/device_group.hpp>
#include <mgpu/core/memory.hpp>
#include <mgpu/nn/gpt.hpp>
#include <mgpu/parallel/tensor_parallel.hpp>

#include "support/catch.hpp"
#include "support/expect_error.hpp"

namespace par = mgpu::parallel;

namespace {
// 12 heads split 1, 2, 3 and 4 ways; vocab 67 splits unevenly.
mgpu::nn::GptConfig const config{.vocab = 67, .block_size = 8, .n_layer = 2, .n_head = 12, .n_embd = 48};

std::size_t float_bytes(std::int64_t values) { return mgpu::Allocator::block_size(static_cast<std::size_t>(values) * sizeof(float)); }
}  // namespace

TEST_CASE("predicted parameter bytes are those of the model and of every tensor-parallel shard", "[parallel][memory]") {
  std::vector<par::GptMemory> const one = par::predict_gpt_memory(config, 4, {});
  REQUIRE(one.size() == 1);
  CHECK(one[0].parameters == float_bytes(mgpu::nn::gpt(config).parameter_count()));
  CHECK(one[0].gradients == one[0].parameters);
  CHECK(one[0].optimizer == 2 * one[0].parameters);  // AdamW's m and v
  for (int ranks : {2, 3, 4}) {
    mgpu::DeviceGroup group("host:" + std::to_string(ranks));
    par::TensorParallel tp(group, config, {.seed = 1});
    std::vector<par::GptMemory> const predicted = par::predict_gpt_memory(config, 4, {.tensor_parallel = ranks});
    REQUIRE(predicted.size() == static_cast<std::size_t>(ranks));
    for (int r = 0; r < ranks; ++r) {
      INFO("rank " << r << " of " << ranks);
      CHECK(predicted[static_cast<std::size_t>(r)].parameters == float_bytes(tp.shard(r).parameter_count()));
      CHECK(predicted[static_cast<std::size_t>(r)].optimizer == 2 * predicted[static_cast<std::size_t>(r)].parameters);
    }
  }
}

TEST_CASE("predicted memory splits the rows over the replicas and the optimizer state with ZeRO-1", "[parallel][memory]") {
  // 8 rows over 3 replicas: 3, 3, 2.
  std::vector<par::GptMemory> const dp = par::predict_gpt_memory(config, 8, {.data_parallel = 3, .zero_stage = 1});
  REQUIRE(dp.size() == 3);
  CHECK(dp[0].activations == dp[1].activations);
  CHECK(dp[2].activations < dp[0].activations);
  std::vector<par::GptMemory> const replicated = par::predict_gpt_memory(config, 8, {.data_parallel = 3, .zero_stage = 0});
  CHECK(replicated[0].optimizer == 2 * replicated[0].parameters);
  CHECK(dp[0].optimizer == 2 * float_bytes(mgpu::nn::gpt(config).parameter_count() / 3));
  // One replica's rows on one device hold what that replica's device holds, less the optimizer state.
  std::vector<par::GptMemory> const three_rows = par::predict_gpt_memory(config, 3, {});
  CHECK(three_rows[0].activations == dp[0].activations);
  CHECK(three_rows[0].workspace == dp[0].workspace);
  // Two replicas of 2-way tensor parallelism: each replica's ranks as the 2-way split of its rows.
  std::vector<par::GptMemory> const grid = par::predict_gpt_memory(config, 8, {.data_parallel = 2, .tensor_parallel = 2});
  std::vector<par::GptMemory> const half = par::predict_gpt_memory(config, 4, {.tensor_parallel = 2});
  REQUIRE(grid.size() == 4);
  for (std::size_t r = 0; r < 4; ++r) CHECK(grid[r].total() == half[r % 2].total());
}

TEST_CASE("predict_gpt_memory refuses layouts it cannot place, naming them", "[parallel][memory]") {
  REQUIRE_MGPU_ERROR(par::predict_gpt_memory(config, 4, {.tensor_parallel = 5}), mgpu::Errc::invalid_argument,
                     "tensor_parallel dividing n_head");
  REQUIRE_MGPU_ERROR(par::predict_gpt_memory(config, 4, {.data_parallel = 2, .zero_stage = 2}), mgpu::Errc::invalid_argument,
                     "zero_stage 0 or 1");
  REQUIRE_MGPU_ERROR(par::predict_gpt_memory(config, 2, {.data_parallel = 3}), mgpu::Errc::invalid_argument,
                     "at least one row per replica");
  REQUIRE_MGPU_ERROR(par::predict_gpt_memory(config, 2, {.data_parallel = 0}), mgpu::Errc::invalid_argument,
                     "data_parallel >= 1");
  mgpu::nn::GptConfig bad = config;
  bad.n_embd = 50;  // not a multiple of n_head
  REQUIRE_MGPU_ERROR(par::predict_gpt_memory(bad, 2, {}), mgpu::Errc::invalid_argument, "n_head dividing n_embd");
}
