// The host's element-wise math against float64: exp_vec (the vectorized exponential of the
// softmaxes and GELU) against std::exp over the range softmax feeds it, GELU and its gradient in
// bfloat16 and float32 against the float64 formula, and the bias gradient of 16-bit storage
// (column sums over contiguous rows) against serial float64 sums.
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

#include <mgpu/core/detail/training_math.hpp>
#include <mgpu/ops/ops.hpp>

#include "support/catch.hpp"
#include "support/nn_env.hpp"

using mgpu::DType;
using mgpu::Tensor;
using mgpu::test::Env;
using mgpu::test::to_dtype;
using mgpu::test::widened;

namespace {
// The spacing of floats at |v| (one ulp), for normal v.
double ulp(double v) {
  auto const f = static_cast<float>(std::abs(v));
  return static_cast<double>(std::nextafter(f, std::numeric_limits<float>::infinity()) - f);
}

double gelu_ref(double v) { return 0.5 * v * (1 + std::tanh(std::sqrt(2 / 3.141592653589793) * (v + 0.044715 * v * v * v))); }
double gelu_grad_ref(double v) {
  double const k = std::sqrt(2 / 3.141592653589793), u = k * (v + 0.044715 * v * v * v), t = std::tanh(u);
  return 0.5 * (1 + t) + 0.5 * v * (1 - t * t) * k * (1 + 3 * 0.044715 * v * v);
}
}  // namespace

TEST_CASE("exp_vec is within 1 ulp of the float64 exponential over softmax's range", "[ops]") {
  // Softmax calls it on s - max <= 0 (down to where e^x leaves the normal floats, -87), GELU on
  // -2|u| <= 0; the positive side up to 88 is checked too. Every 1/4096 of the range and its ends.
  double worst = 0;
  for (int i = 0; i <= 175 * 4096; ++i) {
    float const x = -87.0f + static_cast<float>(i) / 4096.0f;
    double const want = std::exp(static_cast<double>(x));
    double const err = std::abs(static_cast<double>(mgpu::detail::exp_vec(x)) - want) / ulp(want);
    worst = std::max(worst, err);
  }
  INFO("worst error " << worst << " ulp");
  CHECK(worst <= 1.0);  // 0.99 measured
  CHECK(mgpu::detail::exp_vec(0.0f) == 1.0f);
  CHECK(mgpu::detail::exp_vec(-INFINITY) == 0.0f);  // masked scores
  CHECK(mgpu::detail::exp_vec(-1000.0f) == 0.0f);
  CHECK(std::isinf(mgpu::detail::exp_vec(100.0f)));
  CHECK(std::isnan(mgpu::detail::exp_vec(std::numeric_limits<float>::quiet_NaN())));
}

TEST_CASE("Host GELU and its gradient in bfloat16 and float32 match the float64 formula", "[ops]") {
  auto const [dtype, tolerance] = GENERATE(std::tuple{DType::float32, 1e-6}, std::tuple{DType::bfloat16, 1e-2});
  INFO(mgpu::to_string(dtype));
  Env env;
  std::int64_t const n = 1001;  // [-8, 8] in steps of 1/62.5: both tails and no multiple of a vector
  Tensor x32 = Tensor::empty({n}, DType::float32, *env.allocator);
  auto xs32 = x32.host_span<float>();
  for (std::int64_t i = 0; i < n; ++i) xs32[static_cast<std::size_t>(i)] = -8.0f + 16.0f * static_cast<float>(i) / (n - 1);
  Tensor const x = to_dtype(env, x32, dtype);
  Tensor const dy = to_dtype(env, env.random({n}, 1), dtype);
  Tensor const y = Tensor::empty({n}, dtype, *env.allocator);
  Tensor const dx = Tensor::empty({n}, dtype, *env.allocator);
  mgpu::ops::gelu(x, y, env.stream);
  mgpu::ops::gelu_backward(x, dy, dx, env.stream);
  std::vector<double> const xs = widened(env, x), g = widened(env, dy), ys = widened(env, y), dxs = widened(env, dx);
  // Bounds: `tolerance` relative (float32's or bfloat16's rounding), plus an absolute 2e-7 for
  // 0.5 (1 + tanh u) = 1 / (1 + e^(-2u)) (training_math.hpp: exp_vec's ulp and the rounding of u,
  // which matters in the tails where GELU is flat) carried through each formula: |x| / 2 of it into
  // GELU, and |dy| (0.5 + |x| d_inner) into the gradient.
  double const tanh_err = 2e-7;
  for (std::size_t i = 0; i < xs.size(); ++i) {
    INFO("x " << xs[i]);
    double const v = xs[i], want = gelu_ref(v), want_grad = gelu_grad_ref(v) * g[i];
    double const d_inner = std::sqrt(2 / 3.141592653589793) * (1 + 3 * 0.044715 * v * v);
    REQUIRE(std::abs(ys[i] - want) <= tolerance * std::abs(want) + tanh_err * 0.5 * std::abs(v));
    REQUIRE(std::abs(dxs[i] - want_grad) <=
            tolerance * std::abs(want_grad) + tanh_err * std::abs(g[i]) * (0.5 + std::abs(v) * d_inner));
  }
}

TEST_CASE("Host bias gradients in 16 and 32 bits equal serial float64 column sums", "[ops]") {
  auto const [dtype, accumulate, tolerance] = GENERATE(std::tuple{DType::bfloat16, false, 1e-2},
                                                       std::tuple{DType::bfloat16, true, 1e-2},
                                                       std::tuple{DType::float16, true, 2e-3},
                                                       std::tuple{DType::float32, false, 1e-5},
                                                       std::tuple{DType::float32, true, 1e-5});
  INFO(mgpu::to_string(dtype) << ", accumulate " << accumulate);
  Env env;
  std::int64_t const rows = 67, cols = 45;  // a width that is no multiple of the vector
  Tensor const dy = to_dtype(env, env.random({rows, cols}, 2), dtype);
  Tensor const db = to_dtype(env, env.random({cols}, 3), dtype);
  std::vector<double> want = widened(env, db);
  if (!accumulate) want.assign(want.size(), 0.0);
  mgpu::ops::bias_grad(dy, db, env.stream, accumulate);
  std::vector<double> const g = widened(env, dy), got = widened(env, db);
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t j = 0; j < cols; ++j) want[static_cast<std::size_t>(j)] += g[static_cast<std::size_t>(r * cols + j)];
  for (std::size_t j = 0; j < want.size(); ++j) REQUIRE(std::abs(got[j] - want[j]) <= tolerance * (1 + std::abs(want[j])));
}
