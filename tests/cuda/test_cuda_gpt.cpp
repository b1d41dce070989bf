// A GPT on a GPU against the same model on a host device (the host path is itself checked against
// float64 references and PyTorch in tests/nn/test_gpt.cpp): logits, loss and every gradient of one
// step, with attention dropout (also with activation recomputation), the token-id check, and the
// vocab-shard ops and attention dropout on a tensor-parallel rank's heads.
#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include <mgpu/nn/gpt.hpp>
#include <mgpu/ops/ops.hpp>
#include <mgpu/ops/transformer.hpp>

#include "support/catch.hpp"
#include "support/expect_error.hpp"

using mgpu::Device;
using mgpu::DeviceKind;
using mgpu::DType;
using mgpu::Tensor;

namespace {

struct Side {
  Device device;
  std::shared_ptr<mgpu::Allocator> allocator = mgpu::Allocator::create(device);
  mgpu::Stream stream{device};
  mgpu::nn::Context ctx{*allocator, stream};
};

// The tensor's elements as float32 host values.
std::vector<float> fetch(Side& side, Tensor const& t) {
  auto host = mgpu::Allocator::create(Device{DeviceKind::host, 0});
  Tensor f = Tensor::empty(t.shape(), t.dtype(), *host);
  mgpu::copy_async(f, t, side.stream);
  side.stream.synchronize();
  auto s = f.host_span<float>();
  return {s.begin(), s.end()};
}

Tensor ids_on(Side& side, mgpu::Shape const& shape, std::vector<std::int32_t> const& values) {
  auto host = mgpu::Allocator::create(Device{DeviceKind::host, 0});
  Tensor h = Tensor::empty(shape, DType::int32, *host);
  std::copy(values.begin(), values.end(), h.host_span<std::int32_t>().begin());
  Tensor t = Tensor::empty(shape, DType::int32, *side.allocator);
  mgpu::copy_async(t, h, side.stream);
  side.stream.synchronize();
  return t;
}

double relative_error(std::vector<float> const& a, std::vector<float> const& b) {
  double diff = 0, norm = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    diff += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    norm += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(diff) / std::max(std::sqrt(norm), 1e-30);
}

}  // namespace

TEST_CASE("a GPT step on a GPU matches the host: logits, loss, every gradient", "[cuda][gpt]") {
  mgpu::nn::GptConfig const config{
      .vocab = 50, .block_size = 40, .n_layer = 2, .n_head = 2, .n_embd = 16, .dropout = 0.1f};
  std::vector<std::int32_t> tokens(2 * 37);
  std::mt19937 rng(3);
  for (auto& t : tokens) t = static_cast<std::int32_t>(rng() % 50);
  std::vector<std::int32_t> targets(tokens.begin() + 1, tokens.end());
  targets.push_back(-100);  // one ignored position
  Side host{Device{DeviceKind::host, 0}};
  Side gpu{Device{DeviceKind::cuda, 0}};
  struct Result {
    std::vector<float> logits, loss, grads;
  };
  auto step = [&](Side& side, mgpu::nn::Recompute recompute = mgpu::nn::Recompute::none) {
    mgpu::nn::GptConfig c = config;
    c.recompute = recompute;
    mgpu::nn::Sequential model = mgpu::nn::gpt(c);
    model.materialize(side.ctx, 5);
    Tensor const logits = model.forward(ids_on(side, {2, 37}, tokens), side.ctx);
    Tensor const dlogits = Tensor::empty(logits.shape(), DType::float32, *side.allocator);
    Tensor const loss = Tensor::empty({1}, DType::float32, *side.allocator);
    mgpu::ops::token_cross_entropy(logits, ids_on(side, {2, 37}, targets), dlogits, loss, 73.0f, side.stream);
    (void)model.backward(dlogits, side.ctx, false);
    return Result{fetch(side, logits), fetch(side, loss), fetch(side, model.gradients())};
  };
  Result const h = step(host);
  Result const g = step(gpu);
  CHECK(relative_error(g.logits, h.logits) <= 1e-5);
  CHECK(std::abs(g.loss[0] - h.loss[0]) <= 1e-5 * h.loss[0]);
  CHECK(relative_error(g.grads, h.grads) <= 1e-4);
  for (mgpu::nn::Recompute const recompute : {mgpu::nn::Recompute::selective, mgpu::nn::Recompute::full}) {
    CAPTURE(mgpu::nn::to_string(recompute));  // the recomputed forward's kernels on the GPU stream
    Result const r = step(gpu, recompute);
    CHECK(relative_error(r.logits, h.logits) <= 1e-5);
    CHECK(relative_error(r.grads, h.grads) <= 1e-4);
  }
}

TEST_CASE("a token id >= vocab fails the GPU stream with the host's error", "[cuda][gpt]") {
  Side gpu{Device{DeviceKind::cuda, 0}};
  mgpu::nn::Sequential model = mgpu::nn::gpt({.vocab = 13, .block_size = 6, .n_layer = 1, .n_head = 2, .n_embd = 8});
  model.materialize(gpu.ctx, 1);
  (void)model.forward(ids_on(gpu, {1, 3}, {1, 2, 13}), gpu.ctx);
  REQUIRE_MGPU_ERROR(gpu.stream.synchronize(), mgpu::Errc::invalid_argument, "token id 13 at position 2");
}

TEST_CASE("the vocab-shard ops and attention dropout on a rank's heads on a GPU match the host", "[cuda][gpt]") {
  // One rank's pieces of a tensor-parallel GPT: ids [20, 50) of a vocab of 50, and head 1 of 2.
  std::int64_t const n = 2 * 37, v = 50, begin = 20, cols = 30, c = 8;
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::vector<float> logits(static_cast<std::size_t>(n * cols)), wte(static_cast<std::size_t>(cols * c)),
      wpe(static_cast<std::size_t>(37 * c)), dy(static_cast<std::size_t>(n * c)),
      qkv(static_cast<std::size_t>(n * 3 * c));
  for (auto* values : {&logits, &wte, &wpe, &dy, &qkv})
    for (float& x : *values) x = normal(rng);
  std::vector<std::int32_t> ids(static_cast<std::size_t>(n));
  for (auto& t : ids) t = static_cast<std::int32_t>(rng() % v);
  std::vector<std::int32_t> targets = ids;
  targets[3] = -100;
  auto const floats = [](Side& side, mgpu::Shape const& shape, std::vector<float> const& values) {
    auto host = mgpu::Allocator::create(Device{DeviceKind::host, 0});
    Tensor h = Tensor::empty(shape, DType::float32, *host);
    std::copy(values.begin(), values.end(), h.host_span<float>().begin());
    Tensor t = Tensor::empty(shape, DType::float32, *side.allocator);
    mgpu::copy_async(t, h, side.stream);
    side.stream.synchronize();
    return t;
  };
  auto const run = [&](Side& side) {
    Tensor const x = floats(side, {n, cols}, logits);
    Tensor const t = ids_on(side, {2, 37}, targets);
    Tensor const max = Tensor::empty({n}, DType::float32, *side.allocator);
    Tensor const sums = Tensor::empty({n, 2}, DType::float32, *side.allocator);
    Tensor const dx = Tensor::empty({n, cols}, DType::float32, *side.allocator);
    Tensor const loss = Tensor::empty({1}, DType::float32, *side.allocator);
    mgpu::ops::vocab_shard_row_max(x, max, side.stream);
    mgpu::ops::vocab_shard_row_sums(x, t, max, sums, begin, side.stream);
    mgpu::ops::vocab_shard_cross_entropy(x, t, max, sums, dx, loss, begin, v, 73.0f, side.stream);
    Tensor const i = ids_on(side, {2, 37}, ids);
    Tensor const w = floats(side, {cols, c}, wte), p = floats(side, {37, c}, wpe), d = floats(side, {2, 37, c}, dy);
    Tensor const y = Tensor::empty({2, 37, c}, DType::float32, *side.allocator);
    Tensor const dw = Tensor::empty({cols, c}, DType::float32, *side.allocator);
    Tensor const dp = Tensor::empty({37, c}, DType::float32, *side.allocator);
    mgpu::ops::vocab_shard_embedding(i, w, p, y, begin, v, true, side.stream);
    mgpu::ops::vocab_shard_embedding_backward(i, d, dw, dp, begin, v, false, false, side.stream);
    Tensor const q = floats(side, {2, 37, 3 * c}, qkv);
    Tensor const a = Tensor::empty({2, 37, c}, DType::float32, *side.allocator);
    Tensor const lse = Tensor::empty({2, 1, 37}, DType::float32, *side.allocator);
    mgpu::ops::causal_attention(q, a, lse, 1, side.stream, {.p = 0.3f, .seed = 99, .head_offset = 1, .heads = 2});
    return std::vector<std::vector<float>>{fetch(side, max), fetch(side, sums), fetch(side, dx), fetch(side, loss),
                                           fetch(side, y),   fetch(side, dw),   fetch(side, dp), fetch(side, a)};
  };
  Side host{Device{DeviceKind::host, 0}};
  Side gpu{Device{DeviceKind::cuda, 0}};
  auto const h = run(host);
  auto const g = run(gpu);
  for (std::size_t k = 0; k < h.size(); ++k) {
    CAPTURE(k);
    CHECK(relative_error(g[k], h[k]) <= 1e-5);
  }
}
