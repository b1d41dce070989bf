// The host embedding backward (one pass of row scatter-adds over the tokens) against a serial
// float64 scatter-add: repeated ids, accumulation into the old gradients, a vocab shard's rows, a
// block of more positions than tokens per sequence, and bfloat16 (float32 sums, one rounding).
#include <cmath>
#include <cstdint>
#include <vector>

#include <mgpu/ops/transformer.hpp>

#include "support/catch.hpp"
#include "support/nn_env.hpp"

using mgpu::DType;
using mgpu::Tensor;
using mgpu::test::Env;
using mgpu::test::random_ids;
using mgpu::test::to_dtype;
using mgpu::test::widened;

TEST_CASE("Host embedding backward: the token and position scatter-adds equal serial float64 sums", "[ops][gpt]") {
  Env env;
  std::int64_t const batch = 3, t = 37, c = 45, vocab = 11, positions = 40;
  auto const [dtype, accumulate, begin, rows, tolerance] =
      GENERATE(std::tuple{DType::float32, false, std::int64_t{0}, std::int64_t{11}, 1e-6},
               std::tuple{DType::float32, true, std::int64_t{0}, std::int64_t{11}, 1e-6},
               std::tuple{DType::float32, true, std::int64_t{4}, std::int64_t{5}, 1e-6},
               std::tuple{DType::bfloat16, true, std::int64_t{0}, std::int64_t{11}, 8e-3});
  INFO(mgpu::to_string(dtype) << ", accumulate " << accumulate << ", rows [" << begin << ", " << begin + rows << ")");
  Tensor const ids = random_ids(env, {batch, t}, vocab, 5);  // 111 tokens over 11 ids: each repeated
  Tensor const dy = to_dtype(env, env.random({batch, t, c}, 6), dtype);
  Tensor const dwte = to_dtype(env, env.random({rows, c}, 7), dtype);
  Tensor const dwpe = to_dtype(env, env.random({positions, c}, 8), dtype);
  std::vector<double> const g = widened(env, dy);
  std::vector<double> want_wte = widened(env, dwte), want_wpe = widened(env, dwpe);
  if (!accumulate) {
    want_wte.assign(want_wte.size(), 0.0);
    want_wpe.assign(want_wpe.size(), 0.0);
  }
  auto const id = ids.host_span<std::int32_t>();
  for (std::int64_t n = 0; n < batch * t; ++n)
    for (std::int64_t e = 0; e < c; ++e) {
      double const v = g[static_cast<std::size_t>(n * c + e)];
      std::int64_t const row = id[static_cast<std::size_t>(n)] - begin;
      if (row >= 0 && row < rows) want_wte[static_cast<std::size_t>(row * c + e)] += v;
      want_wpe[static_cast<std::size_t>((n % t) * c + e)] += v;
    }
  if (begin == 0 && rows == vocab)
    mgpu::ops::embedding_backward(ids, dy, dwte, dwpe, accumulate, accumulate, env.stream);
  else
    mgpu::ops::vocab_shard_embedding_backward(ids, dy, dwte, dwpe, begin, vocab, accumulate, accumulate, env.stream);
  std::vector<double> const got_wte = widened(env, dwte), got_wpe = widened(env, dwpe);
  for (std::size_t i = 0; i < want_wte.size(); ++i)
    REQUIRE(std::abs(got_wte[i] - want_wte[i]) <= tolerance * (1 + std::abs(want_wte[i])));
  for (std::size_t i = 0; i < want_wpe.size(); ++i)
    REQUIRE(std::abs(got_wpe[i] - want_wpe[i]) <= tolerance * (1 + std::abs(want_wpe[i])));
}
