// The ZeRO tests' shared fixture: a small GPT (a batch uneven over 2, 3 and 4 devices), its AdamW,
// batches and options, the steps and clipping of a run, an MLP's options and AdamW, and the
// relative difference they compare with.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include <mgpu/nn/gpt.hpp>
#include <mgpu/nn/loss.hpp>
#include <mgpu/optim/optim.hpp>
#include <mgpu/parallel/data_parallel.hpp>

#include "support/catch.hpp"
#include "support/nn_env.hpp"

namespace mgpu::test::zero {

// What the ZeRO tests name unqualified, with `using namespace mgpu::test::zero`.
using parallel::DataParallel;
using parallel::DataParallelOptions;
using test::Env;
using test::host_values;

inline nn::GptConfig const config{.vocab = 64, .block_size = 16, .n_layer = 2, .n_head = 2, .n_embd = 32};
inline std::int64_t const batch = 7;  // uneven over 2, 3 and 4 devices
inline int const steps = 20;
inline float const clip = 0.5f;  // below the gradients' norm early on, so steps clip

// The GPT's AdamW, decaying its weight matrices.
inline optim::AdamW gpt_adamw() {
  return optim::AdamW(
      {.lr = 3e-3f, .beta1 = 0.9f, .beta2 = 0.95f, .weight_decay = 0.1f, .decay_ranges = nn::gpt_decay_ranges(config)});
}

// A run's `steps` batches of the GPT, drawn from seeds first, first + 1, ...
inline std::vector<TokenBatch> gpt_batches(Env& env, unsigned first) { return rule_batches(env, steps, batch, config, first); }

// The GPT's options at `stage`: seed 3, clipped, token cross-entropy, several buckets.
inline parallel::DataParallelOptions gpt_options(int stage) {
  parallel::DataParallelOptions options;
  options.zero_stage = stage;
  options.seed = 3;
  options.clip_norm = clip;
  options.loss = std::make_shared<nn::TokenCrossEntropy const>();
  options.first_bucket_cap_bytes = 4096;  // several buckets, whose lengths do not divide by the ranks
  options.bucket_cap_bytes = 16384;
  return options;
}

// `count` batches of `rows` rows of Env::clusters, drawn from seeds first, first + 1, ...
struct MlpBatches {
  std::vector<Tensor> xs, ys;
};
inline MlpBatches mlp_batches(Env& env, std::int64_t rows, unsigned first, int count = steps) {
  MlpBatches out;
  for (int s = 0; s < count; ++s) {
    auto [x, y] = env.clusters(rows, first + static_cast<unsigned>(s));
    out.xs.push_back(x);
    out.ys.push_back(y);
  }
  return out;
}

// The MLP runs' model, its AdamW, and its options at `stage`: clipped, a bucket per layer.
inline nn::Sequential mlp() { return nn::Sequential::mlp({2, 24, 17, 3}); }
inline optim::AdamW mlp_adamw() { return optim::AdamW({.lr = 0.02f, .weight_decay = 0.1f}); }
inline parallel::DataParallelOptions mlp_options(int stage, int accumulation = 1) {
  parallel::DataParallelOptions options;
  options.zero_stage = stage;
  options.clip_norm = 0.2f;
  options.accumulation_steps = accumulation;
  options.first_bucket_cap_bytes = 64;  // buckets of one layer
  options.bucket_cap_bytes = 300;
  return options;
}

// The largest |got - want| / (floor + |want|).
inline double worst_relative(std::vector<float> const& got, std::vector<float> const& want, double floor = 0) {
  REQUIRE(got.size() == want.size());
  double worst = 0;
  for (std::size_t i = 0; i < got.size(); ++i)
    worst = std::max(
        worst, std::abs(static_cast<double>(got[i]) - want[i]) / (floor + std::abs(static_cast<double>(want[i]))));
  return worst;
}

}  // namespace mgpu::test::zero
