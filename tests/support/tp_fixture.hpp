// The tensor- and sequence-parallel tests' shared fixture: a small GPT, its batches and AdamW, the
// one-device curve and gradient norm they are checked against, and helpers to compare.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include <mgpu/nn/gpt.hpp>
#include <mgpu/optim/optim.hpp>

#include "support/catch.hpp"
#include "support/nn_env.hpp"

namespace mgpu::test::tp {

inline nn::GptConfig const config{.vocab = 64, .block_size = 16, .n_layer = 2, .n_head = 4, .n_embd = 32};
inline std::uint64_t const seed = 5;
inline std::int64_t const batch = 3;
inline int const steps = 20;
inline float const clip = 0.5f;  // below the gradients' norm (test_tensor_parallel.cpp checks it), so steps clip
inline optim::AdamWOptions const adamw{.lr = 3e-3f, .beta1 = 0.9f, .beta2 = 0.95f, .weight_decay = 0.1f};

using Batch = TokenBatch;

inline Batch make_batch(Env& env, unsigned draw) { return rule_batch(env, batch, config.block_size, config.vocab, 200 + draw); }

// A host tensor's float32 values.
inline std::vector<float> host_values(Tensor const& t) {
  auto const s = t.host_span<float>();
  return {s.begin(), s.end()};
}

// The largest absolute difference between `got` and `want` (of the same size).
inline double worst_difference(std::vector<float> const& got, std::vector<float> const& want) {
  REQUIRE(got.size() == want.size());
  double worst = 0;
  for (std::size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::abs(static_cast<double>(got[i]) - want[i]));
  return worst;
}

// The global L2 norm of the one-device model's gradients for a batch (nothing updated).
inline double gradient_norm(Env& env, Batch const& b) { return gpt_gradient_norm(env, config, seed, b); }

// The one-device model's losses over `batches` (AdamW, clipped) and its weights after them.
inline std::pair<std::vector<double>, std::vector<float>> one_device_curve(Env& env, std::vector<Batch> const& batches) {
  GptCurve curve = gpt_one_device_curve(env, config, seed, adamw, clip, batches);
  return {std::move(curve.losses), std::move(curve.weights)};
}

}  // namespace mgpu::test::tp
