// The GPT ops and layers against independent references: a naive float64 attention over the whole
// [T, T] matrix, float64 cross-entropy, central finite differences, and PyTorch through the
// committed parity fixture (tests/data/README.md; its format in support/gpt_fixture.hpp).
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <mgpu/core/detail/training_math.hpp>
#include <mgpu/io/checkpoint.hpp>
#include <mgpu/nn/gpt.hpp>
#include <mgpu/nn/transformer.hpp>
#include <mgpu/ops/ops.hpp>
#include <mgpu/ops/transformer.hpp>
#include <mgpu/optim/optim.hpp>

#include "support/catch.hpp"
#include "support/expect_error.hpp"
#include "support/gpt_fixture.hpp"
#include "support/nn_env.hpp"

using mgpu::DType;
using mgpu::Errc;
using mgpu::Tensor;
using mgpu::test::as_double;
using mgpu::test::Env;
using mgpu::test::random_ids;
using mgpu::test::Fixture;
using mgpu::test::read_fixture;
namespace nn = mgpu::nn;
namespace ops = mgpu::ops;

namespace {

Tensor ids_tensor(Env& env, mgpu::Shape shape, std::vector<std::int32_t> const& values) {
  Tensor t = Tensor::empty(std::move(shape), DType::int32, *env.allocator);
  std::copy(values.begin(), values.end(), t.host_span<std::int32_t>().begin());
  return t;
}

// Attention over the whole [T, T] score matrix in float64: y [B, T, C] from qkv [B, T, 3C], with
// the dropout mask ops::causal_attention documents when p > 0.
std::vector<double> naive_attention(std::vector<double> const& qkv, std::int64_t b_count, std::int64_t t,
                                    std::int64_t c, std::int64_t heads, ops::AttentionDropout const& dropout = {}) {
  std::int64_t const d = c / heads;
  std::vector<double> y(static_cast<std::size_t>(b_count * t * c), 0.0);
  auto at = [&](std::int64_t b, std::int64_t i, std::int64_t part, std::int64_t h, std::int64_t e) {
    return qkv[static_cast<std::size_t>((b * t + i) * 3 * c + part * c + h * d + e)];
  };
  for (std::int64_t b = 0; b < b_count; ++b) {
    for (std::int64_t h = 0; h < heads; ++h) {
      for (std::int64_t i = 0; i < t; ++i) {
        std::vector<double> s(static_cast<std::size_t>(t), -INFINITY);  // the [T] row of the [T, T] matrix
        double max = -INFINITY;
        for (std::int64_t j = 0; j <= i; ++j) {
          double dot = 0;
          for (std::int64_t e = 0; e < d; ++e) dot += at(b, i, 0, h, e) * at(b, j, 1, h, e);
          s[static_cast<std::size_t>(j)] = dot / std::sqrt(static_cast<double>(d));
          max = std::max(max, s[static_cast<std::size_t>(j)]);
        }
        double sum = 0;
        for (std::int64_t j = 0; j <= i; ++j) sum += std::exp(s[static_cast<std::size_t>(j)] - max);
        for (std::int64_t j = 0; j <= i; ++j) {
          double p = std::exp(s[static_cast<std::size_t>(j)] - max) / sum;
          if (dropout.p > 0) {
            auto const counter = static_cast<std::uint64_t>((((dropout.row_offset + b) * heads + h) * t + i) * t + j);
            p = mgpu::detail::uniform01(dropout.seed, counter) < 1.0f - dropout.p ? p / (1.0 - dropout.p) : 0.0;
          }
          for (std::int64_t e = 0; e < d; ++e)
            y[static_cast<std::size_t>((b * t + i) * c + h * d + e)] += p * at(b, j, 2, h, e);
        }
      }
    }
  }
  return y;
}

double dot(std::vector<double> const& a, std::vector<double> const& b) {
  double s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

void check_attention_against_naive(ops::AttentionDropout const& dropout) {
  Env env;
  std::int64_t const b = 2, t = 70, c = 8, heads = 2;  // 70 keys: two tiles of the online softmax
  Tensor const qkv = env.random({b, t, 3 * c}, 1);
  Tensor const r = env.random({b, t, c}, 2);
  Tensor const y = Tensor::empty({b, t, c}, DType::float32, *env.allocator);
  Tensor const lse = Tensor::empty({b, heads, t}, DType::float32, *env.allocator);
  Tensor const dqkv = Tensor::empty(qkv.shape(), DType::float32, *env.allocator);
  ops::causal_attention(qkv, y, lse, heads, env.stream, dropout);
  ops::causal_attention_backward(qkv, y, lse, r, dqkv, heads, env.stream, dropout);
  env.stream.synchronize();
  std::vector<double> q = as_double(qkv);
  std::vector<double> const rv = as_double(r);
  std::vector<double> const ref = naive_attention(q, b, t, c, heads, dropout);
  std::vector<double> const got = as_double(y);
  for (std::size_t i = 0; i < ref.size(); ++i) REQUIRE(std::abs(got[i] - ref[i]) <= 2e-6 * (1 + std::abs(ref[i])));
  // dL/dqkv for L = sum(y * r), by central differences of the float64 reference, at every 23rd
  // element: 23 is prime to the 3C = 24 columns, so the sample walks every q, k and v column of
  // every head at positions in both key tiles (every element took minutes under ThreadSanitizer).
  std::vector<double> const grad = as_double(dqkv);
  double const h = 1e-6;
  for (std::size_t k = 0; k < q.size(); k += 23) {
    double const keep = q[k];
    q[k] = keep + h;
    double const up = dot(naive_attention(q, b, t, c, heads, dropout), rv);
    q[k] = keep - h;
    double const down = dot(naive_attention(q, b, t, c, heads, dropout), rv);
    q[k] = keep;
    double const fd = (up - down) / (2 * h);
    INFO("qkv element " << k);
    REQUIRE(std::abs(grad[k] - fd) <= 2e-5 * (1 + std::abs(fd)));
  }
}

// Central differences of L = sum(model(x) * r) (float32 model, L summed in float64) for sampled
// parameters and, for a float32 input, input elements, against backward. The model is materialized
// with parameters redrawn N(0, 0.3) so every path carries signal; the RNG state of its dropouts
// is reset before each forward so every evaluation draws the same masks.
void check_finite_differences(Env& env, nn::Sequential& model, Tensor const& x, double tolerance) {
  model.materialize(env.ctx, 7);
  std::mt19937 rng(11);
  std::normal_distribution<float> n(0.0f, 0.3f);
  auto params = model.parameters().host_span<float>();
  for (float& p : params) p = n(rng);
  auto const rng_state = model.rng_state();
  Tensor const y = model.forward(x, env.ctx);
  Tensor const r = env.random(y.shape(), 5);
  bool const float_input = x.dtype() == DType::float32;
  Tensor const dx = model.backward(r, env.ctx, float_input);
  env.stream.synchronize();
  std::vector<double> const grads = as_double(model.gradients());
  std::vector<double> const rv = as_double(r);
  auto loss = [&] {
    model.set_rng_state(rng_state);
    Tensor const out = model.forward(x, env.ctx);
    env.stream.synchronize();
    return dot(as_double(out), rv);
  };
  float const h = 1e-2f;
  auto const check = [&](float& value, double analytic, std::string const& what) {
    float const keep = value;
    value = keep + h;
    double const up = loss();
    value = keep - h;
    double const down = loss();
    value = keep;
    double const fd = (up - down) / (2.0 * static_cast<double>(h));
    INFO(what << ": backward " << analytic << ", finite difference " << fd);
    CHECK(std::abs(analytic - fd) <= tolerance * (1 + std::abs(fd)));
  };
  std::size_t const stride = std::max<std::size_t>(1, params.size() / 150);
  for (std::size_t k = 0; k < params.size(); k += stride) check(params[k], grads[k], "parameter " + std::to_string(k));
  if (float_input) {
    auto xs = x.host_span<float>();
    std::vector<double> const dxv = as_double(dx);
    for (std::size_t k = 0; k < xs.size(); k += 7) check(xs[k], dxv[k], "input " + std::to_string(k));
  }
}

}  // namespace

TEST_CASE(
    "causal_attention: the online softmax over key tiles equals the naive [T, T] attention, and its backward the "
    "float64 gradient",
    "[nn][gpt]") {
  SECTION("no dropout") { check_attention_against_naive({}); }
  SECTION("attention dropout 0.3") { check_attention_against_naive({0.3f, 12345, 3}); }
}

TEST_CASE("causal_attention: every host tiling gives the float64 attention and the library's tiling's gradient",
          "[nn][gpt]") {
  Env env;
  // Head sizes 4 (single-column register blocks) and 32 (whole 32-wide panels, so register blocks
  // above the diagonal are skipped); with dropout (rows to their visible length) and without
  // (rows in whole vectors, the entries past the diagonal masked).
  auto const shape = GENERATE(std::pair{std::int64_t{8}, ops::AttentionDropout{0.3f, 12345, 3}},
                              std::pair{std::int64_t{8}, ops::AttentionDropout{}},
                              std::pair{std::int64_t{64}, ops::AttentionDropout{}});
  std::int64_t const c = shape.first;  // plain variables: lambdas capture them (Clang 14 cannot capture bindings)
  ops::AttentionDropout const dropout = shape.second;
  std::int64_t const b = 2, t = 70, heads = 2;
  INFO("C " << c << ", dropout " << dropout.p);
  Tensor const qkv = env.random({b, t, 3 * c}, 1);
  Tensor const r = env.random({b, t, c}, 2);
  auto const run = [&](ops::AttentionTiles tiles) {
    ops::set_host_attention_tiles(tiles);
    Tensor const y = Tensor::empty({b, t, c}, DType::float32, *env.allocator);
    Tensor const lse = Tensor::empty({b, heads, t}, DType::float32, *env.allocator);
    Tensor const dqkv = Tensor::empty(qkv.shape(), DType::float32, *env.allocator);
    ops::causal_attention(qkv, y, lse, heads, env.stream, dropout);
    ops::causal_attention_backward(qkv, y, lse, r, dqkv, heads, env.stream, dropout);
    env.stream.synchronize();
    ops::set_host_attention_tiles({});
    return std::pair{as_double(y), as_double(dqkv)};
  };
  // The library's tiling's gradient is checked against finite differences above.
  auto const [y_ref, grad_ref] = run({});
  std::vector<double> const ref = naive_attention(as_double(qkv), b, t, c, heads, dropout);
  // Rows and keys that divide 70 or not, blocks of queries past a key tile's diagonal, single rows.
  for (ops::AttentionTiles const tiles :
       {ops::AttentionTiles{1, 7}, {16, 32}, {32, 16}, {64, 128}, {128, 64}, {7, 70}, {32, 128}}) {
    INFO("tiles " << tiles.queries << " x " << tiles.keys);
    auto const [y, grad] = run(tiles);
    for (std::size_t i = 0; i < ref.size(); ++i) REQUIRE(std::abs(y[i] - ref[i]) <= 2e-6 * (1 + std::abs(ref[i])));
    for (std::size_t i = 0; i < grad.size(); ++i)
      REQUIRE(std::abs(grad[i] - grad_ref[i]) <= 1e-5 * (1 + std::abs(grad_ref[i])));
  }
}

TEST_CASE("causal_attention_backward refuses a dqkv that overlaps its inputs", "[nn][gpt]") {
  Env env;
  std::int64_t const b = 1, t = 4, c = 4, heads = 2;
  Tensor const qkv = env.random({b, t, 3 * c}, 1);
  Tensor const y = Tensor::empty({b, t, c}, DType::float32, *env.allocator);
  Tensor const lse = Tensor::empty({b, heads, t}, DType::float32, *env.allocator);
  Tensor const dy = env.random({b, t, c}, 2);
  ops::causal_attention(qkv, y, lse, heads, env.stream);
  REQUIRE_MGPU_ERROR(ops::causal_attention_backward(qkv, y, lse, dy, qkv, heads, env.stream), mgpu::Errc::invalid_argument,
                     "causal_attention_backward: dqkv overlaps qkv (expected dqkv in memory of its own)");
}

TEST_CASE("token_cross_entropy: loss and dlogits against float64, with ignored rows and an explicit divisor",
          "[nn][gpt]") {
  Env env;
  std::int64_t const n = 6, v = 5;
  Tensor const logits = env.random({2, 3, v}, 3, 2.0f);
  Tensor const targets = ids_tensor(env, {2, 3}, {4, 0, -1, 2, 2, 1});
  Tensor const dlogits = Tensor::empty(logits.shape(), DType::float32, *env.allocator);
  Tensor const loss = env.scalar();
  float const divisor = 8.0f;  // e.g. the counted tokens of a whole batch of which this is a shard
  ops::token_cross_entropy(logits, targets, dlogits, loss, divisor, env.stream, -1, 2.0f);
  env.stream.synchronize();
  std::vector<double> const x = as_double(logits);
  std::vector<double> const dx = as_double(dlogits);
  auto const t = targets.host_span<std::int32_t>();
  double total = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    double max = -INFINITY, sum = 0;
    for (std::int64_t j = 0; j < v; ++j) max = std::max(max, x[static_cast<std::size_t>(i * v + j)]);
    for (std::int64_t j = 0; j < v; ++j) sum += std::exp(x[static_cast<std::size_t>(i * v + j)] - max);
    double const lse = max + std::log(sum);
    bool const ignored = t[static_cast<std::size_t>(i)] == -1;
    if (!ignored) total += lse - x[static_cast<std::size_t>(i * v + t[static_cast<std::size_t>(i)])];
    for (std::int64_t j = 0; j < v; ++j) {
      double const expected = ignored ? 0.0
                                      : (std::exp(x[static_cast<std::size_t>(i * v + j)] - lse) -
                                         (j == t[static_cast<std::size_t>(i)] ? 1 : 0)) *
                                            2.0 / divisor;
      CHECK(std::abs(dx[static_cast<std::size_t>(i * v + j)] - expected) <= 1e-6);
    }
  }
  CHECK(std::abs(loss.host_span<float>()[0] - total / divisor) <= 1e-6 * total);
}

TEST_CASE("vocab-shard ops: the ranks' parts, reduced by hand, are embedding's and token_cross_entropy's",
          "[nn][gpt]") {
  // A vocab of 7 over three ranks holding ids [0, 2), [2, 4) and [4, 7); the reductions between
  // the passes (max, then sum) done here on the host, as the ranks' all-reduces would.
  Env env;
  std::int64_t const n = 6, v = 7, c = 3, p = 4;
  std::vector<std::pair<std::int64_t, std::int64_t>> const shards = {{0, 2}, {2, 4}, {4, 7}};
  auto const rows_of = [&](Tensor const& t, std::int64_t width, std::int64_t begin, std::int64_t end) {
    Tensor part = Tensor::empty({t.numel() / width, end - begin}, DType::float32, *env.allocator);
    auto const src = t.host_span<float>();
    auto const dst = part.host_span<float>();
    for (std::int64_t r = 0; r < part.dim(0); ++r)
      for (std::int64_t j = begin; j < end; ++j)
        dst[static_cast<std::size_t>(r * (end - begin) + j - begin)] = src[static_cast<std::size_t>(r * width + j)];
    return part;
  };

  // Cross-entropy, with an ignored row and grad_scale 2 over a divisor of 8.
  Tensor const logits = env.random({2, 3, v}, 9, 2.0f);
  Tensor const targets = ids_tensor(env, {2, 3}, {6, 0, -1, 3, 2, 5});
  Tensor const want_d = Tensor::empty(logits.shape(), DType::float32, *env.allocator);
  Tensor const want_loss = env.scalar();
  ops::token_cross_entropy(logits, targets, want_d, want_loss, 8.0f, env.stream, -1, 2.0f);
  std::vector<Tensor> parts, maxes, sums;
  for (auto const& [begin, end] : shards) {
    parts.push_back(rows_of(logits.reshape({n, v}), v, begin, end));
    maxes.push_back(Tensor::empty({n}, DType::float32, *env.allocator));
    sums.push_back(Tensor::empty({n, 2}, DType::float32, *env.allocator));
    ops::vocab_shard_row_max(parts.back(), maxes.back(), env.stream);
  }
  env.stream.synchronize();
  for (std::size_t r = 1; r < shards.size(); ++r)
    for (std::int64_t i = 0; i < n; ++i) {
      auto const k = static_cast<std::size_t>(i);
      maxes[0].host_span<float>()[k] = std::max(maxes[0].host_span<float>()[k], maxes[r].host_span<float>()[k]);
    }
  for (std::size_t r = 0; r < shards.size(); ++r)
    ops::vocab_shard_row_sums(parts[r], targets, maxes[0], sums[r], shards[r].first, env.stream);
  env.stream.synchronize();
  for (std::size_t r = 1; r < shards.size(); ++r)
    for (std::int64_t i = 0; i < 2 * n; ++i)
      sums[0].host_span<float>()[static_cast<std::size_t>(i)] +=
          sums[r].host_span<float>()[static_cast<std::size_t>(i)];
  for (std::size_t r = 0; r < shards.size(); ++r) {
    auto const [begin, end] = shards[r];
    CAPTURE(r);
    Tensor const d = Tensor::empty(parts[r].shape(), DType::float32, *env.allocator);
    Tensor const loss = env.scalar();
    ops::vocab_shard_cross_entropy(parts[r], targets, maxes[0], sums[0], d, loss, begin, v, 8.0f, env.stream, -1, 2.0f);
    env.stream.synchronize();
    CHECK(loss.host_span<float>()[0] == Approx(want_loss.host_span<float>()[0]).epsilon(1e-6));
    std::vector<double> const got = as_double(d), want = as_double(rows_of(want_d.reshape({n, v}), v, begin, end));
    for (std::size_t k = 0; k < got.size(); ++k) CHECK(std::abs(got[k] - want[k]) <= 1e-7);
  }

  // Embedding: the ranks' outputs sum to embedding()'s exactly (rank 0 adding the positions), and
  // their wte gradients are embedding_backward()'s rows.
  Tensor const ids = ids_tensor(env, {2, 3}, {6, 0, 3, 3, 2, 5});
  Tensor const wte = env.random({v, c}, 10), wpe = env.random({p, c}, 11), dy = env.random({2, 3, c}, 12);
  Tensor const want_y = Tensor::empty({2, 3, c}, DType::float32, *env.allocator);
  Tensor const want_dwte = Tensor::empty({v, c}, DType::float32, *env.allocator);
  Tensor const want_dwpe = Tensor::empty({p, c}, DType::float32, *env.allocator);
  ops::embedding(ids, wte, wpe, want_y, env.stream);
  ops::embedding_backward(ids, dy, want_dwte, want_dwpe, false, false, env.stream);
  std::vector<float> y(static_cast<std::size_t>(want_y.numel()), 0.0f);
  for (std::size_t r = 0; r < shards.size(); ++r) {
    auto const [begin, end] = shards[r];
    Tensor const rows =
        rows_of(wte.reshape({v * c}).reshape({1, v * c}), v * c, begin * c, end * c).reshape({end - begin, c});
    Tensor const part = Tensor::empty({2, 3, c}, DType::float32, *env.allocator);
    Tensor const dwte = Tensor::empty({end - begin, c}, DType::float32, *env.allocator);
    Tensor const dwpe = Tensor::empty({p, c}, DType::float32, *env.allocator);
    ops::vocab_shard_embedding(ids, rows, wpe, part, begin, v, r == 0, env.stream);
    ops::vocab_shard_embedding_backward(ids, dy, dwte, dwpe, begin, v, false, false, env.stream);
    env.stream.synchronize();
    for (std::size_t k = 0; k < y.size(); ++k) y[k] += part.host_span<float>()[k];
    auto const want_rows = rows_of(want_dwte.reshape({1, v * c}), v * c, begin * c, end * c).host_span<float>();
    CHECK(std::equal(want_rows.begin(), want_rows.end(), dwte.host_span<float>().begin()));
    CHECK(std::equal(want_dwpe.host_span<float>().begin(), want_dwpe.host_span<float>().end(),
                     dwpe.host_span<float>().begin()));
  }
  CHECK(std::equal(y.begin(), y.end(), want_y.host_span<float>().begin()));
  REQUIRE_MGPU_ERROR(ops::vocab_shard_embedding(ids, wte, wpe, want_y, 1, v, true, env.stream), Errc::invalid_argument,
                     "ids [1, 8) of a vocab of 7 (expected a nonempty range inside [0, vocab))");
  // A target outside the whole vocab fails the stream, on any rank.
  ops::vocab_shard_cross_entropy(parts[0], ids_tensor(env, {2, 3}, {0, 1, 7, 0, 0, 0}), maxes[0], sums[0],
                                 Tensor::empty(parts[0].shape(), DType::float32, *env.allocator), env.scalar(), 0, v,
                                 8.0f, env.stream);
  REQUIRE_MGPU_ERROR(env.stream.synchronize(), Errc::invalid_argument, "target 7 at position 2");
}

TEST_CASE("Embedding and TiedLMHead: finite differences of the tied weight sum both uses", "[nn][gpt]") {
  Env env;
  nn::Sequential model;
  model.add(std::make_unique<nn::Embedding>(11, 6, 8));
  model.add(std::make_unique<nn::TiedLMHead>(11, 8));
  check_finite_differences(env, model, random_ids(env, {2, 5}, 11, 4), 2e-3);
  REQUIRE(model.parameter_count() == (11 + 6) * 8);
}

TEST_CASE("Embedding backward is a deterministic scatter-add: repeated ids summed, untouched rows zero", "[nn][gpt]") {
  Env env;
  nn::Sequential model;
  model.add(std::make_unique<nn::Embedding>(7, 4, 3));
  model.materialize(env.ctx, 1);
  Tensor const ids = ids_tensor(env, {2, 3}, {5, 1, 5, 5, 0, 1});
  Tensor const dy = env.random({2, 3, 3}, 9);
  (void)model.forward(ids, env.ctx);
  (void)model.backward(dy, env.ctx, false);
  env.stream.synchronize();
  std::vector<double> const g = as_double(model.gradients());
  std::vector<double> const d = as_double(dy);
  auto const row = [&](std::size_t n, std::size_t e) { return d[n * 3 + e]; };
  for (std::size_t e = 0; e < 3; ++e) {
    CHECK(g[5 * 3 + e] ==
          static_cast<double>(static_cast<float>(static_cast<float>(row(0, e)) + static_cast<float>(row(2, e))) +
                              static_cast<float>(row(3, e))));
    CHECK(g[1 * 3 + e] == static_cast<double>(static_cast<float>(row(1, e)) + static_cast<float>(row(5, e))));
    CHECK(g[0 * 3 + e] == row(4, e));
    CHECK(g[3 * 3 + e] == 0.0);
    CHECK(g[21 + 0 * 3 + e] ==
          static_cast<double>(static_cast<float>(row(0, e)) + static_cast<float>(row(3, e))));  // wpe position 0
    CHECK(g[21 + 3 * 3 + e] == 0.0);                                                            // position 3: past T
  }
}

TEST_CASE("CausalSelfAttention and TransformerBlock: finite differences of parameters and inputs", "[nn][gpt]") {
  Env env;
  SECTION("attention") {
    nn::Sequential model;
    model.add(std::make_unique<nn::CausalSelfAttention>(8, 2));
    check_finite_differences(env, model, env.random({2, 5, 8}, 3), 2e-3);
  }
  SECTION("block") {
    nn::Sequential model;
    model.add(std::make_unique<nn::TransformerBlock>(8, 2));
    check_finite_differences(env, model, env.random({2, 5, 8}, 3), 2e-3);
  }
  SECTION("block with dropout 0.25 (the same masks at every evaluation)") {
    nn::Sequential model;
    model.add(std::make_unique<nn::TransformerBlock>(8, 2, 0.25f));
    check_finite_differences(env, model, env.random({2, 5, 8}, 3), 2e-3);
  }
}

TEST_CASE("gpt: finite differences through the whole model; the split backward equals backward", "[nn][gpt]") {
  Env env;
  nn::GptConfig const config{.vocab = 13, .block_size = 6, .n_layer = 2, .n_head = 2, .n_embd = 8, .dropout = 0.1f};
  Tensor const ids = random_ids(env, {2, 6}, 13, 8);
  SECTION("finite differences") {
    nn::Sequential model = nn::gpt(config);
    check_finite_differences(env, model, ids, 3e-3);
  }
  SECTION("backward_input then backward_weight, and accumulation") {
    nn::Sequential a = nn::gpt(config);
    nn::Sequential b = nn::gpt(config);
    a.materialize(env.ctx, 3);
    b.materialize(env.ctx, 3);
    auto const start = b.rng_state();
    Tensor const dy = env.random({2, 6, 13}, 4);
    (void)a.forward(ids, env.ctx);
    (void)a.backward(dy, env.ctx, false);
    (void)b.forward(ids, env.ctx);
    (void)b.backward_input(dy, env.ctx, false);
    b.backward_weight(env.ctx);
    env.stream.synchronize();
    CHECK(as_double(a.gradients()) == as_double(b.gradients()));
    env.ctx.accumulate_gradients = true;
    b.set_rng_state(start);  // the same dropout masks again
    (void)b.forward(ids, env.ctx);
    (void)b.backward(dy, env.ctx, false);
    env.stream.synchronize();
    std::vector<double> const once = as_double(a.gradients());
    std::vector<double> const twice = as_double(b.gradients());
    for (std::size_t i = 0; i < once.size(); ++i)
      REQUIRE(std::abs(twice[i] - 2 * once[i]) <= 1e-6 * (1 + std::abs(once[i])));
    env.ctx.accumulate_gradients = false;
  }
  SECTION("the parameter table covers the flat buffer") {
    nn::Sequential model = nn::gpt(config);
    auto const table = nn::gpt_parameters(config);
    std::int64_t offset = 0;
    for (auto const& p : table) {
      CHECK(p.offset == offset);
      offset += p.numel();
    }
    CHECK(offset == model.parameter_count());
  }
}

TEST_CASE(
    "gpt in bfloat16 and float16 compute follows float32: loss within 0.1%, gradients within 2% (bf16) and 0.4% (fp16) "
    "relative L2",
    "[nn][gpt]") {
  nn::GptConfig const config{.vocab = 40, .block_size = 12, .n_layer = 2, .n_head = 2, .n_embd = 16};
  Env env;
  Tensor const ids = random_ids(env, {2, 12}, 40, 6);
  Tensor const targets = random_ids(env, {2, 12}, 40, 7);
  auto run = [&](DType compute) {
    nn::Sequential model = nn::gpt(config);
    model.materialize(env.ctx, 2, compute);
    Tensor const logits = model.forward(ids, env.ctx);
    Tensor const dlogits = Tensor::empty(logits.shape(), compute, *env.allocator);
    Tensor const loss = env.scalar();
    ops::token_cross_entropy(logits, targets, dlogits, loss, 24.0f, env.stream);
    (void)model.backward(dlogits, env.ctx, false);
    model.unscale_gradients(1.0f, env.stream);
    env.stream.synchronize();
    auto const g = model.master_gradients().host_span<float>();
    return std::pair{static_cast<double>(loss.host_span<float>()[0]), std::vector<double>(g.begin(), g.end())};
  };
  auto const [loss32, grads32] = run(DType::float32);
  for (DType const compute : {DType::bfloat16, DType::float16}) {
    INFO(mgpu::to_string(compute));
    auto const [loss, grads] = run(compute);
    CHECK(std::abs(loss - loss32) <= 1e-3 * loss32);
    double diff = 0, norm = 0;
    for (std::size_t i = 0; i < grads.size(); ++i) {
      diff += (grads[i] - grads32[i]) * (grads[i] - grads32[i]);
      norm += grads32[i] * grads32[i];
    }
    CHECK(std::sqrt(diff / norm) <= (compute == DType::bfloat16 ? 2e-2 : 4e-3));
  }
}

TEST_CASE("gpt with dropout resumes from a checkpoint: the same losses as the uninterrupted run", "[nn][gpt]") {
  nn::GptConfig const config{.vocab = 20, .block_size = 8, .n_layer = 2, .n_head = 2, .n_embd = 8, .dropout = 0.2f};
  Env env;
  Tensor const ids = random_ids(env, {2, 8}, 20, 1);
  Tensor const targets = random_ids(env, {2, 8}, 20, 2);
  auto train_step = [&](nn::Sequential& model, mgpu::optim::AdamW& opt) {
    Tensor const logits = model.forward(ids, env.ctx);
    Tensor const dlogits = Tensor::empty(logits.shape(), DType::float32, *env.allocator);
    Tensor const loss = env.scalar();
    ops::token_cross_entropy(logits, targets, dlogits, loss, 16.0f, env.stream);
    (void)model.backward(dlogits, env.ctx, false);
    opt.step(model.master_parameters(), model.master_gradients(), *env.allocator, env.stream);
    env.stream.synchronize();
    return loss.host_span<float>()[0];
  };
  std::filesystem::path const file =
      std::filesystem::temp_directory_path() / ("mgpu-gpt-" + std::to_string(std::random_device{}()) + ".ckpt");
  nn::Sequential a = nn::gpt(config);
  a.materialize(env.ctx, 1);
  mgpu::optim::AdamW adam_a(mgpu::optim::AdamWOptions{});
  for (int i = 0; i < 2; ++i) (void)train_step(a, adam_a);
  mgpu::io::save_training(file, a, adam_a, {.step = 2}, env.stream);
  std::vector<float> expected;
  for (int i = 0; i < 2; ++i) expected.push_back(train_step(a, adam_a));
  nn::Sequential b = nn::gpt(config);
  b.materialize(env.ctx, 1);  // the same seed: dropout seeds come from it, as for Dropout
  mgpu::fill_async(b.master_parameters(), 0.0f, env.stream);  // the checkpoint must bring the weights back
  mgpu::optim::AdamW adam_b(mgpu::optim::AdamWOptions{});
  CHECK(mgpu::io::load_training(file, b, adam_b, *env.allocator, env.stream).step == 2);
  std::filesystem::remove(file);
  for (float const loss : expected) CHECK(train_step(b, adam_b) == loss);
}

TEST_CASE("gpt: hostile inputs and configurations throw mgpu::Error", "[nn][gpt]") {
  nn::GptConfig const config{.vocab = 13, .block_size = 6, .n_layer = 1, .n_head = 2, .n_embd = 8};
  SECTION("a token id >= vocab fails the stream") {
    Env env;
    nn::Sequential model = nn::gpt(config);
    model.materialize(env.ctx, 1);
    (void)model.forward(ids_tensor(env, {1, 3}, {1, 13, 2}), env.ctx);
    REQUIRE_MGPU_ERROR(env.stream.synchronize(), Errc::invalid_argument,
                       "token id 13 at position 1 (expected a token id in [0, 13)");
  }
  SECTION("a negative target fails the stream") {
    Env env;
    Tensor const logits = env.random({2, 4}, 1);
    Tensor const dlogits = env.random({2, 4}, 1);
    ops::token_cross_entropy(logits, ids_tensor(env, {2}, {0, -3}), dlogits, env.scalar(), 2.0f, env.stream);
    REQUIRE_MGPU_ERROR(env.stream.synchronize(), Errc::invalid_argument, "target -3 at position 1");
  }
  SECTION("T > block_size, float ids, a head without its embedding, bad configs") {
    Env env;
    nn::Sequential model = nn::gpt(config);
    model.materialize(env.ctx, 1);
    REQUIRE_MGPU_ERROR(model.forward(random_ids(env, {1, 7}, 13, 1), env.ctx), Errc::invalid_argument,
                       "sequences of 7 tokens (expected at most the block size 6)");
    REQUIRE_MGPU_ERROR(model.forward(env.random({1, 3}, 1), env.ctx), Errc::invalid_argument,
                       "(expected int32 token ids)");
    nn::Sequential head;
    head.add(std::make_unique<nn::TiedLMHead>(13, 8));
    REQUIRE_MGPU_ERROR(head.materialize(env.ctx, 1), Errc::invalid_argument, "no Embedding(13, *, 8)");
    REQUIRE_MGPU_ERROR(nn::gpt({.n_head = 3}), Errc::invalid_argument, "n_head dividing n_embd");
    REQUIRE_MGPU_ERROR(nn::gpt({.bias = false}), Errc::invalid_argument, "expected bias true");
    REQUIRE_MGPU_ERROR(nn::gpt({.dropout = 1.0f}), Errc::invalid_argument, "0 <= dropout < 1");
  }
}

namespace {

// ||a - b||_2 / ||b||_2 over all elements (float64).
double relative_error(std::vector<float> const& a, std::vector<float> const& b) {
  double diff = 0, norm = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    diff += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    norm += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(diff) / std::max(std::sqrt(norm), 1e-30);
}

}  // namespace

TEST_CASE("gpt matches PyTorch on the parity fixture: logits, loss, every gradient and 5 AdamW steps (float32, host)",
          "[nn][gpt]") {
  Fixture const f = read_fixture(MGPU_GPT_FIXTURE);
  nn::GptConfig const config{
      .vocab = f.vocab, .block_size = f.block, .n_layer = f.n_layer, .n_head = f.n_head, .n_embd = f.n_embd};
  Env env;
  nn::Sequential model = nn::gpt(config);
  model.materialize(env.ctx, 0);
  auto const table = nn::gpt_parameters(config);
  REQUIRE(table.size() == f.tensors.size());
  auto flat = model.parameters().host_span<float>();
  for (std::size_t k = 0; k < table.size(); ++k) {
    REQUIRE(table[k].name == f.tensors[k].name);
    REQUIRE(table[k].shape == f.tensors[k].shape);
    nn::load_gpt_parameter(table[k], f.tensors[k].value, flat);
  }
  Tensor const inputs = ids_tensor(env, {f.batch, f.block}, f.inputs);
  Tensor const targets = ids_tensor(env, {f.batch, f.block}, f.targets);
  auto const divisor = static_cast<float>(f.batch * f.block);
  auto step = [&](Tensor const& loss) {
    Tensor const logits = model.forward(inputs, env.ctx);
    Tensor const dlogits = Tensor::empty(logits.shape(), DType::float32, *env.allocator);
    ops::token_cross_entropy(logits, targets, dlogits, loss, divisor, env.stream);
    (void)model.backward(dlogits, env.ctx, false);
    env.stream.synchronize();
    return logits;
  };
  Tensor const loss = env.scalar();
  Tensor const logits = step(loss);
  auto const l = logits.host_span<float>();
  double const logits_error = relative_error({l.begin(), l.end()}, f.logits);
  double const loss_error = std::abs(loss.host_span<float>()[0] - f.loss) / f.loss;
  INFO("logits relative L2 error " << logits_error << ", loss " << loss.host_span<float>()[0] << " vs " << f.loss);
  CHECK(logits_error <= 1e-4);
  CHECK(loss_error <= 1e-4);
  double worst = 0;
  auto const grads = model.gradients().host_span<float>();
  for (std::size_t k = 0; k < table.size(); ++k) {
    double const e = relative_error(nn::read_gpt_parameter(table[k], {grads.data(), grads.size()}), f.tensors[k].grad);
    INFO(table[k].name << ": gradient relative L2 error " << e);
    CHECK(e <= 1e-4);
    worst = std::max(worst, e);
  }

  // 5 AdamW steps on the same batch: the loss before each step.
  mgpu::optim::AdamW opt({.lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.0f});
  double worst_step = 0;
  for (std::int32_t s = 0; s < f.steps; ++s) {
    if (s > 0) (void)step(loss);
    float const got = loss.host_span<float>()[0];
    float const expected = f.losses[static_cast<std::size_t>(s)];
    INFO("step " << s << ": loss " << got << " vs PyTorch " << expected);
    CHECK(std::abs(got - expected) <= 1e-4 * expected);
    worst_step = std::max(worst_step, static_cast<double>(std::abs(got - expected) / expected));
    opt.step(model.master_parameters(), model.master_gradients(), *env.allocator, env.stream);
  }
  env.stream.synchronize();
  WARN("parity with PyTorch (relative errors): logits " << logits_error << ", loss " << loss_error
                                                        << ", worst gradient " << worst << ", worst AdamW-step loss "
                                                        << worst_step);
}
