// LayerNorm's parameter gradients on the host (rows in order, columns in vectors) against serial
// float64 sums of dy xhat and dy from the forward's own statistics: accumulation into the old
// gradients, a width that is no multiple of the vector, float32 and bfloat16.
#include <cmath>
#include <cstdint>
#include <vector>

#include <mgpu/ops/ops.hpp>

#include "support/catch.hpp"
#include "support/nn_env.hpp"

using mgpu::DType;
using mgpu::Tensor;
using mgpu::test::as_double;
using mgpu::test::Env;
using mgpu::test::to_dtype;
using mgpu::test::widened;

TEST_CASE("Host LayerNorm parameter gradients equal serial float64 sums over the rows", "[ops][nn]") {
  Env env;
  std::int64_t const rows = 37, cols = 45;
  auto const [dtype, accumulate, tolerance] = GENERATE(std::tuple{DType::float32, false, 1e-5},
                                                       std::tuple{DType::float32, true, 1e-5},
                                                       std::tuple{DType::bfloat16, true, 1e-2});
  INFO(mgpu::to_string(dtype) << ", accumulate " << accumulate);
  Tensor const x = to_dtype(env, env.random({rows, cols}, 1, 2.0f), dtype);
  Tensor const gamma = to_dtype(env, env.random({cols}, 2), dtype);
  Tensor const beta = to_dtype(env, env.random({cols}, 3), dtype);
  Tensor const dy = to_dtype(env, env.random({rows, cols}, 4), dtype);
  Tensor const dgamma = to_dtype(env, env.random({cols}, 5), dtype);
  Tensor const dbeta = to_dtype(env, env.random({cols}, 6), dtype);
  Tensor const y = Tensor::empty({rows, cols}, dtype, *env.allocator);
  Tensor const dx = Tensor::empty({rows, cols}, dtype, *env.allocator);
  Tensor const stats = Tensor::empty({2, rows}, DType::float32, *env.allocator);
  std::vector<double> want_g = widened(env, dgamma), want_b = widened(env, dbeta);
  if (!accumulate) {
    want_g.assign(want_g.size(), 0.0);
    want_b.assign(want_b.size(), 0.0);
  }
  mgpu::ops::layer_norm(x, gamma, beta, y, stats, 1e-5f, env.stream);
  mgpu::ops::layer_norm_backward(x, gamma, stats, dy, dx, dgamma, dbeta, env.stream, accumulate);
  std::vector<double> const xs = widened(env, x), g = widened(env, dy), s = as_double(stats);
  for (std::int64_t r = 0; r < rows; ++r) {
    double mean = 0, var = 0;
    for (std::int64_t j = 0; j < cols; ++j) mean += xs[static_cast<std::size_t>(r * cols + j)] / cols;
    for (std::int64_t j = 0; j < cols; ++j) var += std::pow(xs[static_cast<std::size_t>(r * cols + j)] - mean, 2) / cols;
    REQUIRE(std::abs(s[static_cast<std::size_t>(r)] - mean) <= 1e-5);
    for (std::int64_t j = 0; j < cols; ++j) {
      auto const i = static_cast<std::size_t>(r * cols + j);
      want_g[static_cast<std::size_t>(j)] += g[i] * (xs[i] - mean) / std::sqrt(var + 1e-5);
      want_b[static_cast<std::size_t>(j)] += g[i];
    }
  }
  std::vector<double> const got_g = widened(env, dgamma), got_b = widened(env, dbeta);
  for (std::size_t j = 0; j < want_g.size(); ++j) {
    REQUIRE(std::abs(got_g[j] - want_g[j]) <= tolerance * (1 + std::abs(want_g[j])));
    REQUIRE(std::abs(got_b[j] - want_b[j]) <= tolerance * (1 + std::abs(want_b[j])));
  }
}
