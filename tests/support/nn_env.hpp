// A host device, its allocator and stream, and helpers to make tensors, for the nn and ops tests.
#pragma once

#include <mgpu/core/memory.hpp>
#include <mgpu/core/stream.hpp>
#include <mgpu/core/tensor.hpp>
#include <mgpu/nn/gpt.hpp>
#include <mgpu/nn/layers.hpp>
#include <mgpu/nn/loss.hpp>
#include <mgpu/nn/train.hpp>
#include <mgpu/ops/ops.hpp>
#include <mgpu/optim/optim.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <random>
#include <utility>
#include <vector>

namespace mgpu::test {

struct Env {
  std::shared_ptr<mgpu::Allocator> allocator = mgpu::Allocator::create({mgpu::DeviceKind::host, 0});
  mgpu::Stream stream{mgpu::Device{mgpu::DeviceKind::host, 0}};
  mgpu::nn::Context ctx{*allocator, stream};
  Tensor make(mgpu::Shape shape, std::vector<float> const& values) {
    Tensor t = Tensor::empty(std::move(shape), mgpu::DType::float32, *allocator);
    std::copy(values.begin(), values.end(), t.host_span<float>().begin());
    return t;
  }
  Tensor random(mgpu::Shape shape, unsigned seed, float stddev = 1.0f) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> n(0, stddev);
    Tensor t = Tensor::empty(std::move(shape), mgpu::DType::float32, *allocator);
    for (float& v : t.host_span<float>()) v = n(rng);
    return t;
  }
  Tensor scalar() { return Tensor::empty({1}, mgpu::DType::float32, *allocator); }
  // Three Gaussian clusters in 2-D (noise 0.6), labels 0..2 as float class ids.
  std::pair<Tensor, Tensor> clusters(std::int64_t n, unsigned seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> noise(0, 0.6f);
    Tensor x = Tensor::empty({n, 2}, mgpu::DType::float32, *allocator);
    Tensor y = Tensor::empty({n}, mgpu::DType::float32, *allocator);
    float const centers[3][2] = {{0, 2}, {2, -1}, {-2, -1}};
    for (std::int64_t i = 0; i < n; ++i) {
      int const c = static_cast<int>(i % 3);
      x.host_span<float>()[static_cast<std::size_t>(2 * i)] = centers[c][0] + noise(rng);
      x.host_span<float>()[static_cast<std::size_t>(2 * i + 1)] = centers[c][1] + noise(rng);
      y.host_span<float>()[static_cast<std::size_t>(i)] = static_cast<float>(c);
    }
    return {x, y};
  }
};

// `t`'s float32 values on the host, once `stream` has written them.
inline std::vector<float> host_values(Tensor const& t, Stream& stream) {
  std::shared_ptr<Allocator> const host = Allocator::create({DeviceKind::host, 0});
  Tensor const copy = Tensor::empty(t.shape(), t.dtype(), *host);
  copy_async(copy, t, stream);
  stream.synchronize();
  auto const span = copy.host_span<float>();
  return {span.begin(), span.end()};
}

// The largest |got - want| / |want| over two curves of the same length (0 for two empty ones).
inline double worst_relative(std::vector<double> const& got, std::vector<double> const& want) {
  if (got.size() != want.size()) return std::numeric_limits<double>::infinity();
  double worst = 0;
  for (std::size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::abs(got[i] - want[i]) / std::abs(want[i]));
  return worst;
}

inline std::vector<double> as_double(Tensor const& t) {
  auto s = t.host_span<float>();
  return {s.begin(), s.end()};
}

// A float32 host tensor converted to `dtype` (and back, for references), on env's stream.
inline Tensor to_dtype(Env& env, Tensor const& t, mgpu::DType dtype) {
  Tensor out = Tensor::empty(t.shape(), dtype, *env.allocator);
  mgpu::convert_async(out, t, env.stream);
  return out;
}

// A tensor of any float dtype as float64 values, once its conversion has run.
inline std::vector<double> widened(Env& env, Tensor const& t) {
  Tensor f = to_dtype(env, t, mgpu::DType::float32);
  env.stream.synchronize();
  return as_double(f);
}

// Token ids drawn uniformly from [0, vocab), int32 on the host.
inline Tensor random_ids(Env& env, mgpu::Shape shape, std::int64_t vocab, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<std::int32_t> u(0, static_cast<std::int32_t>(vocab) - 1);
  Tensor t = Tensor::empty(std::move(shape), mgpu::DType::int32, *env.allocator);
  for (auto& v : t.host_span<std::int32_t>()) v = u(rng);
  return t;
}

// A language-model batch: `rows` windows of t ids and their next tokens as targets.
struct TokenBatch {
  Tensor ids, targets;
};

// Windows of sequences that follow a rule (next = 5 t + 3 mod vocab, from a random start), so a
// model's loss falls as it learns the rule.
inline TokenBatch rule_batch(Env& env, std::int64_t rows, std::int64_t t, std::int64_t vocab, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<std::int32_t> start(0, static_cast<std::int32_t>(vocab) - 1);
  TokenBatch b{Tensor::empty({rows, t}, mgpu::DType::int32, *env.allocator), Tensor::empty({rows, t}, mgpu::DType::int32, *env.allocator)};
  auto ids = b.ids.host_span<std::int32_t>();
  auto targets = b.targets.host_span<std::int32_t>();
  for (std::int64_t r = 0; r < rows; ++r) {
    std::int32_t token = start(rng);
    for (std::int64_t i = 0; i <= t; ++i) {
      if (i < t) ids[static_cast<std::size_t>(r * t + i)] = token;
      if (i > 0) targets[static_cast<std::size_t>(r * t + i - 1)] = token;
      token = (5 * token + 3) % static_cast<std::int32_t>(vocab);
    }
  }
  return b;
}

// `count` rule_batch batches of `rows` windows of config.block_size ids from config.vocab, drawn
// from seeds first, first + 1, ...
inline std::vector<TokenBatch> rule_batches(Env& env, int count, std::int64_t rows, nn::GptConfig const& config, unsigned first) {
  std::vector<TokenBatch> batches;
  for (int s = 0; s < count; ++s)
    batches.push_back(rule_batch(env, rows, config.block_size, config.vocab, first + static_cast<unsigned>(s)));
  return batches;
}

// The global L2 norm of the gradients of nn::gpt(config) materialized from `seed` for a batch on
// one device (nothing updated): what a test compares a clipping threshold with.
inline double gpt_gradient_norm(Env& env, nn::GptConfig const& config, std::uint64_t seed, TokenBatch const& b) {
  nn::Sequential model = nn::gpt(config);
  model.materialize(env.ctx, seed);
  optim::SGD sgd({.lr = 0.0f});
  nn::train_step(model, sgd, b.ids, b.targets, nn::TokenCrossEntropy{}, env.ctx, {.clip_norm = 1e30f});
  env.stream.synchronize();
  double squares = 0;
  for (double const g : as_double(model.master_gradients())) squares += g * g;
  return std::sqrt(squares);
}

// nn::gpt(config) materialized from `seed` on one device, and its AdamW (from `adamw`, decaying
// gpt_decay_ranges): the reference the parallel executors' runs are compared with, and what a
// checkpoint saved by them is loaded into.
struct OneDeviceGpt {
  Env& env;
  nn::Sequential model;
  optim::AdamW opt;
  OneDeviceGpt(Env& e, nn::GptConfig const& config, std::uint64_t seed, optim::AdamWOptions adamw,
               DType compute = DType::float32)
      : env(e), model(nn::gpt(config)), opt(decaying(config, std::move(adamw))) {
    model.materialize(env.ctx, seed, compute);
  }
  // One step on `b`, clipping at `clip` (and scaling the loss by `scaler`'s scale, if any).
  nn::StepResult train(TokenBatch const& b, float clip, optim::LossScaler* scaler = nullptr) {
    return nn::train_step(model, opt, b.ids, b.targets, nn::TokenCrossEntropy{}, env.ctx, {.clip_norm = clip, .scaler = scaler});
  }
  // One step's loss.
  double step(TokenBatch const& b, float clip) { return ops::item(train(b, clip).loss, env.stream); }
  // Steps on batches [from, to): their losses.
  std::vector<double> steps(std::vector<TokenBatch> const& batches, std::size_t from, std::size_t to, float clip) {
    std::vector<double> losses;
    for (std::size_t s = from; s < to; ++s) losses.push_back(step(batches[s], clip));
    return losses;
  }

 private:
  static optim::AdamWOptions decaying(nn::GptConfig const& config, optim::AdamWOptions adamw) {
    adamw.decay_ranges = nn::gpt_decay_ranges(config);
    return adamw;
  }
};

// One device's run of nn::gpt(config) from `seed` over `batches` (OneDeviceGpt, clipping at
// `clip`): its losses, and its weights after the last step.
struct GptCurve {
  std::vector<double> losses;
  std::vector<float> weights;
};
inline GptCurve gpt_one_device_curve(Env& env, nn::GptConfig const& config, std::uint64_t seed, optim::AdamWOptions adamw, float clip,
                                     std::vector<TokenBatch> const& batches) {
  OneDeviceGpt one(env, config, seed, std::move(adamw));
  GptCurve curve;
  curve.losses = one.steps(batches, 0, batches.size(), clip);
  env.stream.synchronize();
  auto const weights = one.model.master_parameters().host_span<float>();
  curve.weights.assign(weights.begin(), weights.end());
  return curve;
}

}  // namespace mgpu::test
