// The tensor- and sequence-parallel tests' shared fixture: a small GPT, its batches and AdamW, the
// one-device curves (float32 or 16-bit) and gradient norm they are checked against, and helpers to
// compare.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include <mgpu/nn/gpt.hpp>
#include <mgpu/optim/optim.hpp>
#include <mgpu/parallel/tensor_parallel.hpp>

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

// The shards' gradients (after a step) in `model`'s layout (the whole GPT's), the split ones from every rank.
inline std::vector<float> gathered_gradients(parallel::TensorParallel& tp, nn::Sequential const& model) {
  std::vector<nn::ParameterRange> const whole = model.parameter_ranges();
  std::vector<float> got(static_cast<std::size_t>(model.parameter_count()), NAN);
  for (int r = 0; r < tp.tensor_parallel(); ++r) {
    nn::Sequential const& shard = tp.shard(r);
    std::vector<float> grads = host_values(shard.master_gradients());
    std::vector<nn::ParameterRange> const ranges = shard.parameter_ranges();
    REQUIRE(ranges.size() == whole.size());
    for (std::size_t i = 0; i < ranges.size(); ++i) {
      auto const dst = std::span<float>(got).subspan(static_cast<std::size_t>(whole[i].begin),
                                                     static_cast<std::size_t>(whole[i].size()));
      auto const src = std::span<float>(grads).subspan(static_cast<std::size_t>(ranges[i].begin),
                                                       static_cast<std::size_t>(ranges[i].size()));
      if (auto const* sharded = dynamic_cast<parallel::ShardedLayer const*>(&shard.layer(ranges[i].layer))) {
        sharded->copy_shard(dst, src, false);
      } else {
        std::copy(src.begin(), src.end(), dst.begin());
      }
    }
  }
  return got;
}

// The global L2 norm of the one-device model's gradients for a batch (nothing updated).
inline double gradient_norm(Env& env, Batch const& b) { return gpt_gradient_norm(env, config, seed, b); }

// The one-device model's losses over `batches` (AdamW, clipped) and its weights after them.
inline std::pair<std::vector<double>, std::vector<float>> one_device_curve(Env& env, std::vector<Batch> const& batches) {
  GptCurve curve = gpt_one_device_curve(env, config, seed, adamw, clip, batches);
  return {std::move(curve.losses), std::move(curve.weights)};
}

// A float16 run's loss scaler (none for other types): 2^30 overflows float16 at once, far from the
// edge; the back-off then drops it to 2^14, far below.
inline std::optional<optim::LossScaler> scaler_for(DType compute) {
  if (compute != DType::float16) return std::nullopt;
  return optim::LossScaler(1073741824.0f, 2.0f, 1.0f / 65536, 1000);
}

// A run's losses and whether each step's update applied.
struct Curve {
  std::vector<double> losses;
  std::vector<bool> applied;
};

// The one-device model from `at` over `batches` in `compute` (with scaler_for's scaler), clipping at `clip`.
inline Curve one_device_run(Env& env, std::vector<Batch> const& batches, std::uint64_t at, float clip, DType compute) {
  OneDeviceGpt one(env, config, at, adamw, compute);
  std::optional<optim::LossScaler> scaler = scaler_for(compute);
  Curve out;
  for (Batch const& b : batches) {
    nn::StepResult const r = one.train(b, clip, scaler ? &*scaler : nullptr);
    out.losses.push_back(ops::item(r.loss, env.stream));
    out.applied.push_back(r.applied);
  }
  return out;
}

}  // namespace mgpu::test::tp
