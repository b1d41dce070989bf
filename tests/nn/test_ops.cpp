// LayerNorm, dropout, reductions, 16-bit storage, loss scaling and mixed-precision training, against
// float64 references, finite differences and the float32 path.
#include <mgpu/nn/layers.hpp>
#include <mgpu/nn/train.hpp>
#include <mgpu/ops/ops.hpp>
#include <mgpu/optim/optim.hpp>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "support/catch.hpp"
#include "support/expect_error.hpp"
#include "support/nn_env.hpp"

using mgpu::DType;
using mgpu::Tensor;
using mgpu::test::as_double;
using mgpu::test::Env;
using mgpu::test::to_dtype;
using mgpu::test::widened;

namespace {

// sum over elements of w * LayerNorm(x; gamma, beta), in float64: its gradient is backward(dy = w).
double layer_norm_objective(std::vector<double> const& x, std::vector<double> const& gamma, std::vector<double> const& beta,
                            std::vector<double> const& w, std::int64_t rows, std::int64_t cols, double eps) {
  double total = 0;
  for (std::int64_t r = 0; r < rows; ++r) {
    double mean = 0;
    for (std::int64_t j = 0; j < cols; ++j) mean += x[static_cast<std::size_t>(r * cols + j)];
    mean /= static_cast<double>(cols);
    double var = 0;
    for (std::int64_t j = 0; j < cols; ++j) var += std::pow(x[static_cast<std::size_t>(r * cols + j)] - mean, 2);
    double const rstd = 1 / std::sqrt(var / static_cast<double>(cols) + eps);
    for (std::int64_t j = 0; j < cols; ++j) {
      auto const i = static_cast<std::size_t>(r * cols + j);
      total += w[i] * ((x[i] - mean) * rstd * gamma[static_cast<std::size_t>(j)] + beta[static_cast<std::size_t>(j)]);
    }
  }
  return total;
}

// Central difference of f with respect to values[i].
template <class F>
double numeric(std::vector<double>& values, std::size_t i, F const& f) {
  double const h = 1e-6;
  double const keep = values[i];
  values[i] = keep + h;
  double const up = f();
  values[i] = keep - h;
  double const down = f();
  values[i] = keep;
  return (up - down) / (2 * h);
}


}  // namespace

TEST_CASE("LayerNorm forward and gradients match float64 finite differences", "[ops][nn]") {
  Env env;
  std::int64_t const rows = 4;
  std::int64_t const cols = 6;
  float const eps = 1e-5f;
  Tensor x = env.random({rows, cols}, 1, 2.0f);
  Tensor gamma = env.random({cols}, 2);
  Tensor beta = env.random({cols}, 3);
  Tensor w = env.random({rows, cols}, 4);
  Tensor y = Tensor::empty({rows, cols}, DType::float32, *env.allocator);
  Tensor stats = Tensor::empty({2, rows}, DType::float32, *env.allocator);
  Tensor dx = Tensor::empty({rows, cols}, DType::float32, *env.allocator);
  Tensor dgamma = Tensor::empty({cols}, DType::float32, *env.allocator);
  Tensor dbeta = Tensor::empty({cols}, DType::float32, *env.allocator);
  mgpu::ops::layer_norm(x, gamma, beta, y, stats, eps, env.stream);
  mgpu::ops::layer_norm_backward(x, gamma, stats, w, dx, dgamma, dbeta, env.stream);
  env.stream.synchronize();

  auto xs = as_double(x);
  auto gs = as_double(gamma);
  auto bs = as_double(beta);
  auto const ws = as_double(w);
  auto const f = [&] { return layer_norm_objective(xs, gs, bs, ws, rows, cols, eps); };
  double forward = 0;
  for (std::size_t i = 0; i < ws.size(); ++i) forward += ws[i] * y.host_span<float>()[i];
  REQUIRE(forward == Approx(f()).epsilon(1e-5));
  auto const dxs = as_double(dx);
  for (std::size_t i = 0; i < xs.size(); ++i) REQUIRE(dxs[i] == Approx(numeric(xs, i, f)).margin(1e-4).epsilon(1e-3));
  auto const dgs = as_double(dgamma);
  auto const dbs = as_double(dbeta);
  for (std::size_t j = 0; j < gs.size(); ++j) {
    REQUIRE(dgs[j] == Approx(numeric(gs, j, f)).margin(1e-4).epsilon(1e-3));
    REQUIRE(dbs[j] == Approx(numeric(bs, j, f)).margin(1e-4).epsilon(1e-3));
  }
  REQUIRE_MGPU_ERROR(mgpu::ops::layer_norm(x, env.random({5}, 5), beta, y, stats, eps, env.stream), mgpu::Errc::invalid_argument,
                     "expected x [N, D], gamma [D], stats [2, N]");
}

TEST_CASE("LayerNorm backward with a residual gradient: float64 finite differences of the norm plus the residual path",
          "[ops][nn]") {
  Env env;
  std::int64_t const rows = 3;
  float const eps = 1e-5f;
  for (std::int64_t const cols : {37, 64}) {  // rows the 16 lanes of the sums divide, and ones with a tail
    INFO("cols " << cols);
    Tensor x = env.random({rows, cols}, 1, 2.0f);
    Tensor gamma = env.random({cols}, 2);
    Tensor beta = env.random({cols}, 3);
    Tensor w = env.random({rows, cols}, 4);
    Tensor residual = env.random({rows, cols}, 5);
    Tensor y = Tensor::empty({rows, cols}, DType::float32, *env.allocator);
    Tensor stats = Tensor::empty({2, rows}, DType::float32, *env.allocator);
    Tensor dx = Tensor::empty({rows, cols}, DType::float32, *env.allocator);
    Tensor dgamma = Tensor::empty({cols}, DType::float32, *env.allocator);
    Tensor dbeta = Tensor::empty({cols}, DType::float32, *env.allocator);
    mgpu::ops::layer_norm(x, gamma, beta, y, stats, eps, env.stream);
    mgpu::ops::layer_norm_backward(x, gamma, stats, w, dx, dgamma, dbeta, env.stream, false, residual);
    env.stream.synchronize();
    auto xs = as_double(x);
    auto const gs = as_double(gamma), bs = as_double(beta), ws = as_double(w), rs = as_double(residual);
    // sum w * LayerNorm(x) + sum residual * x: x feeds the norm and a path whose gradient is residual.
    auto const f = [&] {
      double total = layer_norm_objective(xs, gs, bs, ws, rows, cols, eps);
      for (std::size_t i = 0; i < xs.size(); ++i) total += rs[i] * xs[i];
      return total;
    };
    double forward = 0;
    for (std::size_t i = 0; i < ws.size(); ++i) forward += ws[i] * y.host_span<float>()[i] + rs[i] * xs[i];
    REQUIRE(forward == Approx(f()).epsilon(1e-5));
    auto const dxs = as_double(dx);
    for (std::size_t i = 0; i < xs.size(); ++i) REQUIRE(dxs[i] == Approx(numeric(xs, i, f)).margin(1e-4).epsilon(1e-3));
  }
  Tensor const x = env.random({2, 8}, 1);
  Tensor const g = env.random({8}, 2);
  Tensor const stats = Tensor::empty({2, 2}, DType::float32, *env.allocator);
  REQUIRE_MGPU_ERROR(mgpu::ops::layer_norm_backward(x, g, stats, x, env.random({2, 8}, 3), env.random({8}, 4),
                                                    env.random({8}, 5), env.stream, false, env.random({2, 9}, 6)),
                     mgpu::Errc::invalid_argument, "expected equal shapes");
}

TEST_CASE("LayerNorm with a residual add: the sum in place and its norm equal the separate add and norm, in float64",
          "[ops][nn]") {
  Env env;
  std::int64_t const rows = 3;
  float const eps = 1e-5f;
  for (std::int64_t const cols : {37, 64}) {
    INFO("cols " << cols);
    Tensor h = env.random({rows, cols}, 1, 2.0f);
    Tensor const residual = env.random({rows, cols}, 2);
    Tensor const gamma = env.random({cols}, 3);
    Tensor const beta = env.random({cols}, 4);
    Tensor const y = Tensor::empty({rows, cols}, DType::float32, *env.allocator);
    Tensor const stats = Tensor::empty({2, rows}, DType::float32, *env.allocator);
    std::vector<double> const hs = as_double(h), rs = as_double(residual), gs = as_double(gamma), bs = as_double(beta);
    mgpu::ops::layer_norm(h, gamma, beta, y, stats, eps, env.stream, residual);
    env.stream.synchronize();
    auto const sum = as_double(h);
    auto const got = as_double(y);
    for (std::int64_t r = 0; r < rows; ++r) {
      double mean = 0, var = 0;
      for (std::int64_t j = 0; j < cols; ++j) {
        auto const i = static_cast<std::size_t>(r * cols + j);
        REQUIRE(sum[i] == static_cast<double>(static_cast<float>(hs[i]) + static_cast<float>(rs[i])));  // float32 add
        mean += hs[i] + rs[i];
      }
      mean /= static_cast<double>(cols);
      for (std::int64_t j = 0; j < cols; ++j) var += std::pow(sum[static_cast<std::size_t>(r * cols + j)] - mean, 2);
      double const rstd = 1 / std::sqrt(var / static_cast<double>(cols) + eps);
      for (std::int64_t j = 0; j < cols; ++j) {
        auto const i = static_cast<std::size_t>(r * cols + j), ju = static_cast<std::size_t>(j);
        REQUIRE(got[i] == Approx((sum[i] - mean) * rstd * gs[ju] + bs[ju]).margin(1e-5).epsilon(1e-5));
      }
    }
  }
  Tensor const x = env.random({2, 8}, 1);
  REQUIRE_MGPU_ERROR(mgpu::ops::layer_norm(x, env.random({8}, 2), env.random({8}, 3), env.random({2, 8}, 4),
                                           Tensor::empty({2, 2}, DType::float32, *env.allocator), 1e-5f, env.stream,
                                           env.random({2, 9}, 5)),
                     mgpu::Errc::invalid_argument, "expected equal shapes");
}

TEST_CASE("A LayerNorm layer inside an MLP trains (its gradients flow through Sequential)", "[nn]") {
  Env env;
  auto [x, y] = env.clusters(300, 7);
  mgpu::nn::Sequential model;
  model.add(std::make_unique<mgpu::nn::Linear>(2, 16));
  model.add(std::make_unique<mgpu::nn::LayerNorm>(16));
  model.add(std::make_unique<mgpu::nn::GELU>());
  model.add(std::make_unique<mgpu::nn::Dropout>(0.1f));
  model.add(std::make_unique<mgpu::nn::Linear>(16, 3, mgpu::nn::Init::xavier));
  model.materialize(env.ctx, 3);
  mgpu::optim::AdamW adam({.lr = 0.02f});
  for (int epoch = 0; epoch < 20; ++epoch)
    for (std::int64_t b = 0; b < 300; b += 50) mgpu::nn::classification_step(model, adam, x.slice(b, b + 50), y.slice(b, b + 50), env.ctx);
  CHECK(mgpu::nn::count_correct(model, x, y, env.ctx) >= 285);
}

TEST_CASE("Dropout keeps 1 - p of the elements, scales them, and backward uses the same mask", "[ops][nn]") {
  Env env;
  std::int64_t const n = 100000;
  float const p = 0.3f;
  Tensor x = env.random({n}, 8);
  Tensor y = Tensor::empty({n}, DType::float32, *env.allocator);
  Tensor y2 = Tensor::empty({n}, DType::float32, *env.allocator);
  Tensor dx = Tensor::empty({n}, DType::float32, *env.allocator);
  mgpu::ops::dropout(x, y, p, 42, env.stream);
  mgpu::ops::dropout(x, y2, p, 43, env.stream);
  mgpu::ops::dropout_backward(x, dx, p, 42, env.stream);  // dy = x: dx must equal y
  env.stream.synchronize();
  std::int64_t kept = 0;
  std::int64_t differ = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    auto const k = static_cast<std::size_t>(i);
    float const out = y.host_span<float>()[k];
    if (out != 0.0f) {
      ++kept;
      REQUIRE(out == Approx(x.host_span<float>()[k] / (1 - p)));
    }
    REQUIRE(dx.host_span<float>()[k] == out);
    differ += (out == 0.0f) != (y2.host_span<float>()[k] == 0.0f) ? 1 : 0;
  }
  CHECK(std::abs(static_cast<double>(kept) / n - (1 - p)) < 0.01);
  CHECK(differ > n / 4);  // another seed, another mask

  mgpu::nn::Dropout layer(p);
  layer.set_training(false);
  Tensor same = layer.forward(x, env.ctx);
  CHECK(same.shares_storage(x));
  REQUIRE_MGPU_ERROR(mgpu::nn::Dropout(1.0f), mgpu::Errc::invalid_argument, "expected 0 <= p < 1");
}

TEST_CASE("Dropout of row shards with their global row offset equals dropout of the whole batch", "[ops][nn]") {
  Env env;
  std::int64_t const rows = 37;
  std::int64_t const cols = 11;
  Tensor x = env.random({rows, cols}, 9);
  std::mt19937_64 rng(5);
  mgpu::nn::Dropout whole(0.4f);
  whole.initialize(rng);
  Tensor const full = whole.forward(x, env.ctx);
  Tensor const dfull = whole.backward(x, env.ctx);
  env.stream.synchronize();
  std::int64_t const cuts[] = {0, 10, 10, 29, rows};  // includes an empty shard
  for (std::size_t s = 0; s + 1 < std::size(cuts); ++s) {
    rng.seed(5);
    mgpu::nn::Dropout part(0.4f);
    part.initialize(rng);
    mgpu::nn::Context ctx{*env.allocator, env.stream, cuts[s]};
    Tensor const shard = x.slice(cuts[s], cuts[s + 1]);
    Tensor const y = part.forward(shard, ctx);
    Tensor const dx = part.backward(shard, ctx);
    env.stream.synchronize();
    for (std::int64_t i = 0; i < shard.numel(); ++i) {
      auto const k = static_cast<std::size_t>(i);
      auto const g = static_cast<std::size_t>(cuts[s] * cols + i);
      REQUIRE(y.host_span<float>()[k] == full.host_span<float>()[g]);
      REQUIRE(dx.host_span<float>()[k] == dfull.host_span<float>()[g]);
    }
  }
  REQUIRE_MGPU_ERROR(mgpu::ops::dropout(x, full, 0.4f, 1, env.stream, -1), mgpu::Errc::invalid_argument, "expected >= 0");
}

TEST_CASE("Reductions and the non-finite count against serial float64", "[ops]") {
  Env env;
  Tensor t = env.random({1001}, 9);
  Tensor s = env.scalar();
  Tensor sq = env.scalar();
  mgpu::ops::sum(t, s, env.stream);
  mgpu::ops::sum_squares(t, sq, env.stream);
  double ref_sum = 0;
  double ref_sq = 0;
  for (double v : as_double(t)) {
    ref_sum += v;
    ref_sq += v * v;
  }
  CHECK(mgpu::ops::item(s, env.stream) == Approx(ref_sum).epsilon(1e-6));
  CHECK(mgpu::ops::item(sq, env.stream) == Approx(ref_sq).epsilon(1e-6));
  Tensor bad = env.make({5}, {1, std::numeric_limits<float>::infinity(), std::nanf(""), -std::numeric_limits<float>::infinity(), 0});
  Tensor count = env.scalar();
  mgpu::ops::count_nonfinite(bad, count, env.stream);
  CHECK(mgpu::ops::item(count, env.stream) == 3.0f);
  REQUIRE_MGPU_ERROR(mgpu::ops::sum(t, env.random({2}, 1), env.stream), mgpu::Errc::invalid_argument, "expected one element");
}

TEST_CASE("16-bit storage: element ops round the float32 result, GEMM and the loss stay close", "[ops]") {
  for (DType dtype : {DType::bfloat16, DType::float16}) {
    INFO(mgpu::to_string(dtype));
    Env env;
    Tensor x = to_dtype(env, env.random({8, 16}, 10), dtype);
    Tensor y = Tensor::empty({8, 16}, dtype, *env.allocator);
    mgpu::ops::gelu(x, y, env.stream);
    auto const xs = widened(env, x);
    // The reference: GELU in float32 of the same stored inputs, rounded to the storage type.
    Tensor expected32 = Tensor::empty({8, 16}, DType::float32, *env.allocator);
    for (std::size_t i = 0; i < xs.size(); ++i) {
      auto const v = static_cast<float>(xs[i]);
      expected32.host_span<float>()[i] = 0.5f * v * (1.0f + std::tanh(0.7978845608028654f * (v + 0.044715f * v * v * v)));
    }
    auto const expected = widened(env, to_dtype(env, expected32, dtype));
    auto const got = widened(env, y);
    for (std::size_t i = 0; i < xs.size(); ++i) REQUIRE(got[i] == Approx(expected[i]).margin(1e-6));

    Tensor w = to_dtype(env, env.random({16, 4}, 11), dtype);
    Tensor c = Tensor::empty({8, 4}, dtype, *env.allocator);
    mgpu::ops::gemm(x, false, w, false, c, 1.0f, 0.0f, env.stream);
    auto const ws = widened(env, w);
    auto const cs = widened(env, c);
    for (int i = 0; i < 8; ++i) {
      for (int j = 0; j < 4; ++j) {
        double acc = 0;
        for (int k = 0; k < 16; ++k) acc += xs[static_cast<std::size_t>(i * 16 + k)] * ws[static_cast<std::size_t>(k * 4 + j)];
        REQUIRE(cs[static_cast<std::size_t>(i * 4 + j)] == Approx(acc).margin(0.05).epsilon(0.02));
      }
    }
    Tensor labels = env.make({8}, {0, 1, 2, 3, 0, 1, 2, 3});
    Tensor d16 = Tensor::empty({8, 4}, dtype, *env.allocator);
    Tensor d32 = Tensor::empty({8, 4}, DType::float32, *env.allocator);
    Tensor l16 = env.scalar();
    Tensor l32 = env.scalar();
    Tensor c32 = to_dtype(env, c, DType::float32);
    mgpu::ops::softmax_cross_entropy(c, labels, d16, l16, env.stream);
    mgpu::ops::softmax_cross_entropy(c32, labels, d32, l32, env.stream);
    CHECK(mgpu::ops::item(l16, env.stream) == Approx(mgpu::ops::item(l32, env.stream)).epsilon(1e-5));
    auto const g16 = widened(env, d16);
    auto const g32 = as_double(d32);
    for (std::size_t i = 0; i < g32.size(); ++i) REQUIRE(g16[i] == Approx(g32[i]).margin(2e-3));
  }
}

TEST_CASE("scale_convert unscales 16-bit gradients into float32", "[ops]") {
  Env env;
  Tensor g = to_dtype(env, env.make({3}, {1024, -2048, 0.5f}), DType::float16);
  Tensor master = Tensor::empty({3}, DType::float32, *env.allocator);
  mgpu::ops::scale_convert(master, g, 1.0f / 1024, env.stream);
  env.stream.synchronize();
  CHECK(as_double(master) == std::vector<double>{1, -2, 0.5 / 1024});
}

TEST_CASE("add_scaled accumulates a scaled, widened tensor into float32", "[ops]") {
  Env env;
  Tensor g = to_dtype(env, env.make({3}, {1024, -2048, 0.5f}), DType::bfloat16);
  Tensor acc = env.make({3}, {1, 2, 3});
  mgpu::ops::add_scaled(acc, g, 0.25f, env.stream);
  env.stream.synchronize();
  CHECK(as_double(acc) == std::vector<double>{1 + 256, 2 - 512, 3 + 0.125});
  REQUIRE_MGPU_ERROR(mgpu::ops::add_scaled(acc, env.make({2}, {1, 2}), 1.0f, env.stream), mgpu::Errc::invalid_argument,
                     "expected the same number of elements");
}

TEST_CASE("copy_columns moves a block of columns between matrices as a serial loop does", "[ops]") {
  Env env;
  constexpr std::int64_t rows = 3, a = 5, b = 7, columns = 3, from = 2, to = 1;
  std::vector<float> src(rows * a), dst(rows * b);
  for (std::size_t i = 0; i < src.size(); ++i) src[i] = static_cast<float>(i) + 0.5f;
  for (std::size_t i = 0; i < dst.size(); ++i) dst[i] = -static_cast<float>(i);
  std::vector<double> want(dst.begin(), dst.end());
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < columns; ++c)
      want[static_cast<std::size_t>(r * b + to + c)] = src[static_cast<std::size_t>(r * a + from + c)];
  Tensor const s = env.make({rows, a}, src);
  Tensor const d = env.make({1, rows, b}, dst);  // viewed by its last dimension
  mgpu::ops::copy_columns(s, from, d, to, columns, env.stream);
  env.stream.synchronize();
  CHECK(as_double(d) == want);
  REQUIRE_MGPU_ERROR(mgpu::ops::copy_columns(s, 3, d, 0, columns, env.stream), mgpu::Errc::invalid_argument,
                     "3 columns from 3 of 5 to 0 of 7 (expected blocks inside both)");
  REQUIRE_MGPU_ERROR(mgpu::ops::copy_columns(s, 0, env.make({2, b}, std::vector<float>(2 * b)), 0, 1, env.stream),
                     mgpu::Errc::invalid_argument, "(expected [..., a] and [..., b] with as many rows)");
  REQUIRE_MGPU_ERROR(mgpu::ops::copy_columns(s, 0, to_dtype(env, d, DType::bfloat16), 0, 1, env.stream),
                     mgpu::Errc::invalid_argument, "dst is bfloat16 (expected float32)");
}

TEST_CASE("The loss scaler backs off on overflow and grows after a run of finite steps", "[optim]") {
  mgpu::optim::LossScaler scaler(1024, 2, 0.5f, 3);
  CHECK_FALSE(scaler.update(false));
  CHECK(scaler.scale() == 512);
  CHECK(scaler.update(true));
  CHECK(scaler.update(true));
  CHECK(scaler.scale() == 512);
  CHECK(scaler.update(true));
  CHECK(scaler.scale() == 1024);
  CHECK(scaler.skipped() == 1);
  REQUIRE_MGPU_ERROR(mgpu::optim::LossScaler(0), mgpu::Errc::invalid_argument, "expected initial > 0");
}

TEST_CASE("Mixed precision: bfloat16 and float16 compute with float32 masters train like float32", "[nn][train]") {
  for (DType compute : {DType::float32, DType::bfloat16, DType::float16}) {
    INFO(mgpu::to_string(compute));
    Env env;
    auto [x, y] = env.clusters(600, 4);
    auto model = mgpu::nn::Sequential::mlp({2, 32, 3});
    model.materialize(env.ctx, 1, compute);
    CHECK(model.parameters().dtype() == compute);
    CHECK(model.master_parameters().dtype() == DType::float32);
    mgpu::optim::SGD sgd({.lr = 0.1f, .momentum = 0.9f});
    mgpu::optim::LossScaler scaler(1e30f);  // far too large: the first float16 steps overflow
    mgpu::nn::StepOptions const options{.scaler = compute == DType::float16 ? &scaler : nullptr};
    std::int64_t skipped = 0;
    for (int epoch = 0; epoch < 30; ++epoch) {
      for (std::int64_t b = 0; b < 600; b += 60) {
        Tensor const before = Tensor::empty({model.parameter_count()}, DType::float32, *env.allocator);
        mgpu::copy_async(before, model.master_parameters(), env.stream);
        auto const step = mgpu::nn::classification_step(model, sgd, x.slice(b, b + 60), y.slice(b, b + 60), env.ctx, options);
        if (!step.applied) {
          ++skipped;
          env.stream.synchronize();
          REQUIRE(as_double(before) == as_double(model.master_parameters()));  // a skipped step changes nothing
        }
      }
    }
    if (compute == DType::float16) {
      CHECK(skipped > 0);
      CHECK(scaler.scale() < 65536.0f);
    } else {
      CHECK(skipped == 0);
    }
    CHECK(mgpu::nn::count_correct(model, x, y, env.ctx, 128) >= 570);
  }
}

TEST_CASE("Fused linear ops match float64 references of gemm, bias and activation", "[ops]") {
  using mgpu::ops::ActivationKind;
  auto const act_ref = [](ActivationKind act, double v) {
    if (act == ActivationKind::relu) return std::max(v, 0.0);
    if (act == ActivationKind::gelu) return 0.5 * v * (1 + std::tanh(std::sqrt(2 / 3.141592653589793) * (v + 0.044715 * v * v * v)));
    return v;
  };
  // act'(z) by a central difference of the float64 activation (ReLU away from its kink).
  auto const grad_ref = [&](ActivationKind act, double z) { return (act_ref(act, z + 1e-6) - act_ref(act, z - 1e-6)) / 2e-6; };
  for (DType dtype : {DType::float32, DType::bfloat16, DType::float16}) {
    double const tol = dtype == DType::float32 ? 1e-5 : 2e-2;
    for (ActivationKind act : {ActivationKind::identity, ActivationKind::relu, ActivationKind::gelu}) {
      INFO(mgpu::to_string(dtype) << ' ' << mgpu::ops::activation_name(act));
      Env env;
      std::int64_t const n = 7;
      std::int64_t const in = 5;
      std::int64_t const out = 6;
      Tensor x = to_dtype(env, env.random({n, in}, 1), dtype);
      Tensor w = to_dtype(env, env.random({in, out}, 2), dtype);
      Tensor b = to_dtype(env, env.random({out}, 3), dtype);
      Tensor y = Tensor::empty({n, out}, dtype, *env.allocator);
      bool const gelu = act == ActivationKind::gelu;
      Tensor pre = gelu ? Tensor::empty({n, out}, dtype, *env.allocator) : Tensor{};
      mgpu::ops::linear(x, w, b, y, act, pre, env.stream);
      auto const xs = widened(env, x);
      auto const ws = widened(env, w);
      auto const bs = widened(env, b);
      auto const ys = widened(env, y);
      auto const pres = gelu ? widened(env, pre) : std::vector<double>{};
      for (std::int64_t i = 0; i < n; ++i) {
        for (std::int64_t j = 0; j < out; ++j) {
          double v = bs[static_cast<std::size_t>(j)];
          for (std::int64_t k = 0; k < in; ++k) v += xs[static_cast<std::size_t>(i * in + k)] * ws[static_cast<std::size_t>(k * out + j)];
          auto const e = static_cast<std::size_t>(i * out + j);
          REQUIRE(ys[e] == Approx(act_ref(act, v)).margin(tol).epsilon(tol));
          if (gelu) REQUIRE(pres[e] == Approx(v).margin(tol).epsilon(tol));
        }
      }
      // Backward epilogue, from a z kept away from ReLU's kink.
      Tensor z32 = env.random({n, out}, 4);
      for (float& v : z32.host_span<float>()) v += v >= 0 ? 0.1f : -0.1f;
      Tensor z = to_dtype(env, z32, dtype);
      Tensor dy = to_dtype(env, env.random({n, out}, 5), dtype);
      Tensor dz = Tensor::empty({n, out}, dtype, *env.allocator);
      Tensor db = Tensor::empty({out}, dtype, *env.allocator);
      mgpu::ops::activation_bias_grad(act, z, dy, dz, db, env.stream);
      auto const zs = widened(env, z);
      auto const dys = widened(env, dy);
      auto const dzs = widened(env, dz);
      auto const dbs = widened(env, db);
      for (std::int64_t j = 0; j < out; ++j) {
        double sum = 0;
        for (std::int64_t i = 0; i < n; ++i) {
          auto const e = static_cast<std::size_t>(i * out + j);
          double const d = grad_ref(act, zs[e]) * dys[e];
          REQUIRE(dzs[e] == Approx(d).margin(tol).epsilon(tol));
          sum += d;
        }
        REQUIRE(dbs[static_cast<std::size_t>(j)] == Approx(sum).margin(5 * tol).epsilon(5 * tol));
      }
    }
  }
  Env env;
  Tensor x = env.random({4, 3}, 1);
  Tensor w = env.random({3, 2}, 2);
  Tensor b = env.random({2}, 3);
  Tensor y = env.random({4, 2}, 4);
  REQUIRE_MGPU_ERROR(mgpu::ops::linear(x, w, b, y, ActivationKind::gelu, {}, env.stream), mgpu::Errc::invalid_argument,
                     "linear: pre is undefined (expected a tensor)");
  REQUIRE_MGPU_ERROR(mgpu::ops::linear(x, w, b, y, ActivationKind::relu, env.random({4, 2}, 5), env.stream), mgpu::Errc::invalid_argument,
                     "only gelu keeps one");
  REQUIRE_MGPU_ERROR(mgpu::ops::linear(x, env.random({2, 2}, 6), b, y, ActivationKind::relu, {}, env.stream), mgpu::Errc::invalid_argument,
                     "expected x [N, in], w [in, out], bias [out], y [N, out]");
  REQUIRE_MGPU_ERROR(mgpu::ops::activation_bias_grad(ActivationKind::relu, y, y, env.random({4, 2}, 7), env.random({3}, 8), env.stream),
                     mgpu::Errc::invalid_argument, "expected dy [N, out] and db [out]");
}
