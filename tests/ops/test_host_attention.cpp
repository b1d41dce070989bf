// Host causal attention against float64 forward and backward formulas over the whole [T, T]
// matrix, at the head sizes with AVX-512 kernels (32, 64: run where the CPU has AVX-512) and one
// without (48: the generic tiles), for tilings that do and do not divide T or 16.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include <mgpu/ops/transformer.hpp>

#include "support/catch.hpp"
#include "support/nn_env.hpp"

using mgpu::DType;
using mgpu::Tensor;
using mgpu::test::as_double;
using mgpu::test::Env;
namespace ops = mgpu::ops;

namespace {

// y, lse and dqkv of causal attention on qkv [B, T, 3C] with dy [B, T, C], in float64:
// P = softmax(q kᵀ / sqrt(d)) over j <= i, y = P v, dP = dy vᵀ, dS = P (dP - rowsum(P dP)),
// dq = dS k / sqrt(d), dk = dSᵀ q / sqrt(d), dv = Pᵀ dy.
struct Reference {
  std::vector<double> y, lse, dqkv;
};

Reference reference(std::vector<double> const& qkv, std::vector<double> const& dy, std::int64_t batch, std::int64_t t,
                    std::int64_t c, std::int64_t heads) {
  std::int64_t const d = c / heads;
  double const scale = 1.0 / std::sqrt(static_cast<double>(d));
  Reference out{std::vector<double>(dy.size()), std::vector<double>(static_cast<std::size_t>(batch * heads * t)),
                std::vector<double>(qkv.size())};
  auto at = [&](std::int64_t b, std::int64_t i, std::int64_t part, std::int64_t h) {
    return static_cast<std::size_t>((b * t + i) * 3 * c + part * c + h * d);
  };
  auto row = [&](std::int64_t b, std::int64_t i, std::int64_t h) {
    return static_cast<std::size_t>((b * t + i) * c + h * d);
  };
  auto dot = [&](double const* x, double const* y) {
    double s = 0;
    for (std::int64_t e = 0; e < d; ++e) s += x[e] * y[e];
    return s;
  };
  std::vector<double> p(static_cast<std::size_t>(t)), ds(p.size());
  for (std::int64_t b = 0; b < batch; ++b)
    for (std::int64_t h = 0; h < heads; ++h)
      for (std::int64_t i = 0; i < t; ++i) {
        double max = -INFINITY, sum = 0, row_dot = 0;
        for (std::int64_t j = 0; j <= i; ++j) {
          p[static_cast<std::size_t>(j)] = dot(&qkv[at(b, i, 0, h)], &qkv[at(b, j, 1, h)]) * scale;
          max = std::max(max, p[static_cast<std::size_t>(j)]);
        }
        for (std::int64_t j = 0; j <= i; ++j) sum += std::exp(p[static_cast<std::size_t>(j)] - max);
        out.lse[static_cast<std::size_t>((b * heads + h) * t + i)] = max + std::log(sum);
        for (std::int64_t j = 0; j <= i; ++j) {
          auto const ju = static_cast<std::size_t>(j);
          p[ju] = std::exp(p[ju] - max) / sum;
          ds[ju] = dot(&dy[row(b, i, h)], &qkv[at(b, j, 2, h)]);
          row_dot += p[ju] * ds[ju];
          for (std::int64_t e = 0; e < d; ++e)
            out.y[row(b, i, h) + static_cast<std::size_t>(e)] +=
                p[ju] * qkv[at(b, j, 2, h) + static_cast<std::size_t>(e)];
        }
        for (std::int64_t j = 0; j <= i; ++j) {
          auto const ju = static_cast<std::size_t>(j);
          double const g = p[ju] * (ds[ju] - row_dot) * scale;
          for (std::int64_t e = 0; e < d; ++e) {
            auto const eu = static_cast<std::size_t>(e);
            out.dqkv[at(b, i, 0, h) + eu] += g * qkv[at(b, j, 1, h) + eu];
            out.dqkv[at(b, j, 1, h) + eu] += g * qkv[at(b, i, 0, h) + eu];
            out.dqkv[at(b, j, 2, h) + eu] += p[ju] * dy[row(b, i, h) + eu];
          }
        }
      }
  return out;
}

}  // namespace

TEST_CASE("causal_attention on host: every head size and tiling gives the float64 attention and gradients",
          "[ops][attention]") {
  Env env;
  std::int64_t const d = GENERATE(32, 64, 48);
  std::int64_t const batch = 2, t = 70, heads = 2, c = heads * d;  // 70: neither tiles nor 16 divide it
  Tensor const qkv = env.random({batch, t, 3 * c}, 1);
  Tensor const dy = env.random({batch, t, c}, 2);
  Reference const ref = reference(as_double(qkv), as_double(dy), batch, t, c, heads);
  for (ops::AttentionTiles const tiles :
       {ops::AttentionTiles{}, {1, 7}, {16, 32}, {32, 16}, {7, 70}, {64, 128}, {13, 48}}) {
    INFO("head size " << d << ", tiles " << tiles.queries << " x " << tiles.keys);
    ops::set_host_attention_tiles(tiles);
    Tensor const y = Tensor::empty({batch, t, c}, DType::float32, *env.allocator);
    Tensor const lse = Tensor::empty({batch, heads, t}, DType::float32, *env.allocator);
    Tensor const dqkv = Tensor::empty(qkv.shape(), DType::float32, *env.allocator);
    ops::causal_attention(qkv, y, lse, heads, env.stream);
    ops::causal_attention_backward(qkv, y, lse, dy, dqkv, heads, env.stream);
    env.stream.synchronize();
    ops::set_host_attention_tiles({});
    auto const check = [](std::vector<double> const& got, std::vector<double> const& want, double tolerance) {
      REQUIRE(got.size() == want.size());
      for (std::size_t i = 0; i < got.size(); ++i) {
        INFO("element " << i << ": " << got[i] << " against " << want[i]);
        REQUIRE(std::abs(got[i] - want[i]) <= tolerance * (1 + std::abs(want[i])));
      }
    };
    check(as_double(y), ref.y, 2e-6);
    check(as_double(lse), ref.lse, 2e-6);
    check(as_double(dqkv), ref.dqkv, 2e-5);
  }
}
