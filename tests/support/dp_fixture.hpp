// The DataParallel tests' shared fixture: a small MLP, random batches, the one-device reference
// (classification_step on the whole batch) and helpers to compare and to step.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <random>
#include <utility>
#include <vector>

#include <mgpu/nn/train.hpp>
#include <mgpu/ops/ops.hpp>
#include <mgpu/parallel/data_parallel.hpp>

#include "support/catch.hpp"
#include "support/nn_env.hpp"

namespace mgpu::test::dp {

inline constexpr std::int64_t features = 6;
inline constexpr std::int64_t classes = 4;

// A small MLP of `features` inputs and `classes` outputs, with dropout when asked.
inline mgpu::nn::Sequential small_mlp(bool dropout = false) {
  if (!dropout) return mgpu::nn::Sequential::mlp({features, 16, 12, classes});
  mgpu::nn::Sequential model;
  model.add(std::make_unique<mgpu::nn::Linear>(features, 16));
  model.add(std::make_unique<mgpu::nn::ReLU>());
  model.add(std::make_unique<mgpu::nn::Dropout>(0.3f));
  model.add(std::make_unique<mgpu::nn::Linear>(16, classes));
  return model;
}

// Batches of random features and labels in host memory.
struct Data {
  Env env;
  std::vector<Tensor> x, y;
  Data(int batches, std::int64_t rows, unsigned seed) {
    std::mt19937 rng(seed);
    for (int b = 0; b < batches; ++b) {
      x.push_back(env.random({rows, features}, seed * 100 + static_cast<unsigned>(b)));
      Tensor labels = Tensor::empty({rows}, DType::float32, *env.allocator);
      for (float& v : labels.host_span<float>()) v = static_cast<float>(rng() % classes);
      y.push_back(labels);
    }
  }
};

// The reference: one device, the whole batch, classification_step.
struct Reference {
  Env env;
  mgpu::nn::Sequential model;
  mgpu::optim::SGD sgd{{.lr = 0.1f, .momentum = 0.9f}};
  std::optional<mgpu::optim::LossScaler> scaler;
  Reference(mgpu::nn::Sequential m, DType compute = DType::float32) : model(std::move(m)) { model.materialize(env.ctx, 1, compute); }
  float step(Tensor const& x, Tensor const& y, float clip = 0) {
    mgpu::nn::StepOptions options;
    options.clip_norm = clip;
    options.scaler = scaler ? &*scaler : nullptr;
    auto const r = mgpu::nn::classification_step(model, sgd, x, y, env.ctx, options);
    return mgpu::ops::item(r.loss, env.stream);
  }
  std::vector<float> params() { return host_values(model.master_parameters(), env.stream); }
};

// Every element of `a` within `tolerance` of `b`'s, relative to 1 + |b|.
inline void require_close(std::vector<float> const& a, std::vector<float> const& b, double tolerance) {
  REQUIRE(a.size() == b.size());
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(static_cast<double>(a[i]) - b[i]) / (1.0 + std::abs(b[i])));
  INFO("largest relative difference " << worst);
  REQUIRE(worst <= tolerance);
}

// Replica `replica`'s float32 parameters.
inline std::vector<float> dp_params(parallel::DataParallel& dp, int replica = 0) {
  return host_values(dp.replica(replica).master_parameters(), dp.group().stream(replica));
}

// A step run by run_steps: whether it was applied, and the loss scaler after it.
struct StepTrace {
  bool applied;
  float scale;
  std::int64_t skipped;
  bool operator==(StepTrace const&) const = default;
};

// Steps [begin, end) of `data` on `dp`, traced.
inline std::vector<StepTrace> run_steps(parallel::DataParallel& dp, Data const& data, int begin, int end) {
  std::vector<StepTrace> trace;
  for (int b = begin; b < end; ++b) {
    bool const applied = dp.step(data.x[static_cast<std::size_t>(b)], data.y[static_cast<std::size_t>(b)]).applied;
    auto const* scaler = dp.loss_scaler();
    trace.push_back({applied, scaler ? scaler->scale() : 0.0f, scaler ? scaler->skipped() : 0});
  }
  return trace;
}

}  // namespace mgpu::test::dp
