// The pipeline ZeRO tests' shared fixture (test_pipeline_zero*.cpp): a small tied GPT over a
// data x pipeline grid, its batches, the chunks' AdamW, the executor's options per ZeRO stage, a
// run's losses and gathered weights, and what the tests compare.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <mgpu/nn/gpt.hpp>
#include <mgpu/nn/layers.hpp>
#include <mgpu/nn/loss.hpp>
#include <mgpu/optim/optim.hpp>
#include <mgpu/pipeline/pipeline.hpp>

#include "support/catch.hpp"
#include "support/nn_env.hpp"

namespace mgpu::test::pipeline_zero {

using mgpu::DType;
using mgpu::test::as_double;
using mgpu::test::Env;
namespace nn = mgpu::nn;
namespace pp = mgpu::pipeline;

inline nn::GptConfig const config{.vocab = 64, .block_size = 16, .n_layer = 2, .n_head = 4, .n_embd = 32};
inline std::uint64_t const seed = 7;
inline std::int64_t const batch = 7;  // uneven over 2 replicas and over micro-batches
inline int const steps = 10;
inline float const clip = 0.5f;  // below the gradients' norm (checked below), so steps clip
inline mgpu::optim::AdamWOptions const adamw{.lr = 3e-3f, .beta1 = 0.9f, .beta2 = 0.95f, .weight_decay = 0.1f};
inline double const curve_tolerance = 1e-5;  // float32 rounding of other summation orders

using Batch = mgpu::test::TokenBatch;

inline std::vector<Batch> make_batches(Env& env) {
  std::vector<Batch> batches;
  for (int s = 0; s < steps; ++s)
    batches.push_back(mgpu::test::rule_batch(env, batch, config.block_size, config.vocab, 300 + static_cast<unsigned>(s)));
  return batches;
}

// AdamW decaying each chunk's weight matrices (the head's copy of wte too), as the one device
// decays gpt_decay_ranges; each optimizer made is listed in `made` (replica by replica, chunk by
// chunk, as the executor makes them) when given.
inline pp::ChunkOptimizerFactory chunk_adamw(std::shared_ptr<std::vector<mgpu::optim::Optimizer*>> made = nullptr) {
  return [made](nn::Sequential const& chunk) {
    mgpu::optim::AdamWOptions options = adamw;
    options.decay_ranges = chunk.matrix_ranges();
    auto optimizer = std::make_unique<mgpu::optim::AdamW>(options);
    if (made) made->push_back(optimizer.get());
    return optimizer;
  };
}

struct Grid {
  std::string name;
  pp::Schedule schedule;
  std::vector<std::size_t> cuts;
  int tp = 1;  // tensor-parallel ranks per stage
};

inline pp::ExecutorOptions options_for(int zero, int replicas = 2, DType compute = DType::float32) {
  return {.seed = seed,
          .data_parallel = replicas,
          .zero_stage = zero,
          .compute = compute,
          .clip_norm = clip,
          .loss = std::make_shared<nn::TokenCrossEntropy>()};
}

struct Run {
  std::vector<double> losses, weights;
};

// `steps` of `ex` over `batches` from `from`, then replica 0's weights.
inline Run train(Env& env, pp::Executor& ex, std::vector<Batch> const& batches, std::size_t from = 0, std::size_t to = steps) {
  Run run;
  for (std::size_t s = from; s < to; ++s) run.losses.push_back(ex.step(batches[s].ids, batches[s].targets));
  nn::Sequential whole = nn::gpt(config);
  whole.materialize(env.ctx, seed + 1);
  ex.gather_parameters(whole, env.stream);
  run.weights = as_double(whole.master_parameters());
  return run;
}

inline double worst_difference(std::vector<double> const& got, std::vector<double> const& want) {
  REQUIRE(got.size() == want.size());
  double worst = 0;
  for (std::size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::abs(got[i] - want[i]));
  return worst;
}

// The values `optimizer` keeps in its state buffers.
inline std::int64_t state_values(mgpu::optim::Optimizer const& optimizer) {
  std::int64_t total = 0;
  for (auto const& named : optimizer.state()) total += named.second.numel();
  return total;
}


}  // namespace mgpu::test::pipeline_zero
