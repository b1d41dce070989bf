// What bench_gpt's files share (bench_gpt.cpp, bench_gpt_attention.cpp, bench_gpt_layouts.cpp,
// bench_gpt_ops.cpp): the shapes, a one-device GPT trainer, the reference sgemm and attention's FLOPs.
#pragma once

#include <Eigen/Core>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
#include <random>
#include <vector>

#include <mgpu/mgpu.hpp>
#include <mgpu/nn/gpt.hpp>

#include "bench_support.hpp"

namespace bench::gpt {
using Clock = std::chrono::steady_clock;
using Matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using Stride = Eigen::OuterStride<>;
using Map = Eigen::Map<Matrix, 0, Stride>;

struct Shape {
  char const* name;
  mgpu::nn::GptConfig config;
  std::int64_t batch;
};
inline Shape const shapes[] = {
    {"nano", {.vocab = 256, .block_size = 64, .n_layer = 4, .n_head = 4, .n_embd = 128}, 12},
    {"gpt2s", {.vocab = 256, .block_size = 256, .n_layer = 12, .n_head = 12, .n_embd = 768}, 4},
};

using bench::median;

inline double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

inline mgpu::optim::AdamWOptions const adamw_options{.lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f};

struct GptTrainer {
  static constexpr std::int64_t pool = 8;  // batches of random windows, used in turn
  mgpu::Device device{mgpu::DeviceKind::host, 0};
  std::shared_ptr<mgpu::Allocator> allocator = mgpu::Allocator::create(device);
  mgpu::Stream stream{device};
  mgpu::nn::Context ctx{*allocator, stream};
  Shape shape;
  mgpu::nn::Sequential model;
  mgpu::optim::AdamW adamw{adamw_options};
  mgpu::nn::TokenCrossEntropy const loss_fn{};
  mgpu::Tensor inputs, targets;
  std::int64_t next = 0;

  // compute: float32, or bfloat16 / float16 with float32 masters (Sequential::materialize).
  explicit GptTrainer(Shape const& s, mgpu::DType compute = mgpu::DType::float32)
      : shape(s), model(mgpu::nn::gpt(s.config)) {
    model.materialize(ctx, 1, compute);
    std::int64_t const t = s.config.block_size;
    inputs = mgpu::Tensor::empty({pool * s.batch, t}, mgpu::DType::int32, *allocator);
    targets = mgpu::Tensor::empty({pool * s.batch, t}, mgpu::DType::int32, *allocator);
    std::mt19937 rng(7);
    std::uniform_int_distribution<std::int32_t> token(0, static_cast<std::int32_t>(s.config.vocab) - 1);
    auto in = inputs.host_span<std::int32_t>();
    auto out = targets.host_span<std::int32_t>();
    for (std::int64_t w = 0; w < pool * s.batch; ++w) {  // a window of t + 1 tokens: inputs, then targets
      std::int32_t previous = token(rng);
      for (std::int64_t i = 0; i < t; ++i) {
        std::int32_t const following = token(rng);
        in[static_cast<std::size_t>(w * t + i)] = previous;
        out[static_cast<std::size_t>(w * t + i)] = following;
        previous = following;
      }
    }
  }
  [[nodiscard]] std::int64_t tokens() const { return shape.batch * shape.config.block_size; }
  void step() {
    std::int64_t const b = next++ % pool;
    mgpu::Tensor const x = inputs.slice(b * shape.batch, (b + 1) * shape.batch);
    mgpu::Tensor const y = targets.slice(b * shape.batch, (b + 1) * shape.batch);
    (void)mgpu::nn::train_step(model, adamw, x, y, loss_fn, ctx, {.clip_norm = 1.0f});  // the trainers' own step
    stream.synchronize();
  }
};

// The reference GEMM: the library's host GEMM on a 512 x 512 x 512 product in `dtype` (float32:
// the sgemm; bfloat16: 16-bit inputs and output, float32 accumulation, as the step's bf16 GEMMs),
// run on a stream's worker like the step's GEMMs.
struct Sgemm {
  static constexpr std::int64_t n = 512;
  mgpu::Tensor a, b, c;
  explicit Sgemm(mgpu::Allocator& allocator, mgpu::DType dtype = mgpu::DType::float32) {
    a = mgpu::Tensor::empty({n, n}, dtype, allocator);
    b = mgpu::Tensor::empty({n, n}, dtype, allocator);
    c = mgpu::Tensor::empty({n, n}, dtype, allocator);
    std::mt19937 rng(3);
    std::normal_distribution<float> d(0.0f, 1.0f);
    auto const fill = [&]<class T>(mgpu::Tensor const& t) {
      for (T& v : t.host_span<T>()) v = T(d(rng));
    };
    for (mgpu::Tensor const* t : {&a, &b}) {
      if (dtype == mgpu::DType::float32) fill.operator()<float>(*t);
      else if (dtype == mgpu::DType::bfloat16) fill.operator()<mgpu::bfloat16>(*t);
      else fill.operator()<mgpu::float16>(*t);
    }
  }
  [[nodiscard]] static double flops() { return 2.0 * n * n * n; }
  // Seconds of one product on the stream's worker.
  double seconds(mgpu::Stream& stream) {
    auto const t0 = Clock::now();
    mgpu::ops::gemm(a, false, b, false, c, 1.0f, 0.0f, stream);
    stream.synchronize();
    return seconds_since(t0);
  }
};

// The floating-point operations of causal attention's forward and backward over `batch`
// sequences: 2 d per visible (query, key) pair for each of its 7 products (forward QK^T and PV;
// backward QK^T again, dY V^T, dV, dK and dQ).
inline double attention_flops(mgpu::nn::GptConfig const& config, std::int64_t batch) {
  double const t = static_cast<double>(config.block_size), d = static_cast<double>(config.n_embd / config.n_head);
  return 7.0 * 2.0 * d * t * (t + 1) / 2 * static_cast<double>(batch * config.n_head * config.n_layer);
}

}  // namespace bench::gpt
