// Cached decoding, sampling and evaluate_lm against independent references: the full forward of
// the whole sequence (logits at every position, greedy tokens), and a hand loop of float64
// cross-entropy over the windows evaluate_lm defines.
#include <algorithm>
#include <cmath>
#include <random>
#include <span>
#include <vector>

#include <mgpu/nn/gpt.hpp>
#include <mgpu/data/evaluate.hpp>
#include <mgpu/nn/lm.hpp>

#include "support/catch.hpp"
#include "support/expect_error.hpp"
#include "support/nn_env.hpp"

using mgpu::DType;
using mgpu::Errc;
using mgpu::Tensor;
using mgpu::test::Env;
namespace nn = mgpu::nn;

namespace {

nn::GptConfig const config{.vocab = 23, .block_size = 12, .n_layer = 2, .n_head = 2, .n_embd = 16, .dropout = 0.1f};

// A model whose weights are redrawn N(0, 0.3), so attention is far from uniform and the logits
// differ clearly between positions (GPT-2's init gives nearly flat logits).
nn::Sequential make_model(Env& env) {
  nn::Sequential model = nn::gpt(config);
  model.materialize(env.ctx, 5);
  std::mt19937 rng(3);
  std::normal_distribution<float> n(0.0f, 0.3f);
  for (float& p : model.parameters().host_span<float>()) p = n(rng);
  return model;
}

Tensor ids_tensor(Env& env, std::int64_t batch, std::vector<std::int32_t> const& values) {
  Tensor t = Tensor::empty({batch, static_cast<std::int64_t>(values.size()) / batch}, DType::int32, *env.allocator);
  std::copy(values.begin(), values.end(), t.host_span<std::int32_t>().begin());
  return t;
}

// Logits [T, V] of the full forward (evaluation mode) of one sequence.
std::vector<float> full_logits(Env& env, nn::Sequential& model, std::vector<std::int32_t> const& tokens) {
  model.train(false);
  Tensor const logits = model.forward(ids_tensor(env, 1, tokens), env.ctx);
  env.stream.synchronize();
  model.train(true);
  auto const l = logits.host_span<float>();
  return {l.begin(), l.end()};
}

std::int32_t argmax(std::span<float const> row) {
  return static_cast<std::int32_t>(std::max_element(row.begin(), row.end()) - row.begin());
}

}  // namespace

TEST_CASE("Decoder: the cached logits at every position equal the full forward's", "[nn][gpt][lm]") {
  Env env;
  nn::Sequential model = make_model(env);
  std::int64_t const batch = 2, t = config.block_size, v = config.vocab;
  std::vector<std::int32_t> tokens(static_cast<std::size_t>(batch * t));
  std::mt19937 rng(9);
  for (auto& id : tokens) id = static_cast<std::int32_t>(rng() % v);
  model.train(false);
  Tensor const full = model.forward(ids_tensor(env, batch, tokens), env.ctx);
  env.stream.synchronize();
  model.train(true);  // dropout 0.1 must not reach the decoder
  auto const expected = full.host_span<float>();

  nn::Decoder decoder(model, env.ctx, batch);
  CHECK(decoder.capacity() == t);
  std::int64_t position = 0;
  for (std::int64_t const chunk : {5, 1, 1, 2, 1, 1, 1}) {  // a prompt, then single tokens: 12 in all
    std::vector<std::int32_t> part;
    for (std::int64_t b = 0; b < batch; ++b)
      for (std::int64_t i = position; i < position + chunk; ++i)
        part.push_back(tokens[static_cast<std::size_t>(b * t + i)]);
    Tensor const logits = decoder.append(ids_tensor(env, batch, part));
    REQUIRE(logits.shape() == mgpu::Shape{batch, chunk, v});
    auto const got = logits.host_span<float>();
    for (std::int64_t b = 0; b < batch; ++b)
      for (std::int64_t i = 0; i < chunk; ++i)
        for (std::int64_t j = 0; j < v; ++j) {
          float const want = expected[static_cast<std::size_t>((b * t + position + i) * v + j)];
          float const have = got[static_cast<std::size_t>((b * chunk + i) * v + j)];
          INFO("sequence " << b << ", position " << position + i << ", id " << j);
          REQUIRE(std::abs(have - want) <= 1e-5f * (1 + std::abs(want)));
        }
    position += chunk;
    CHECK(decoder.length() == position);
  }
  REQUIRE_MGPU_ERROR(decoder.append(ids_tensor(env, batch, {1, 2})), Errc::invalid_argument,
                     "expected at most the block size 12");
  decoder.reset();
  CHECK(decoder.length() == 0);
  REQUIRE_MGPU_ERROR(decoder.append(ids_tensor(env, batch, {1, 23})), Errc::invalid_argument,
                     "token id 23 at position 1 (expected a token id in [0, 23))");
}

TEST_CASE("generate: greedy decoding equals the argmax of the full forward, also past the block size",
          "[nn][gpt][lm]") {
  Env env;
  nn::Sequential model = make_model(env);
  std::int64_t const block = config.block_size, keep = block / 2;
  for (std::size_t const prompt_length : {3u, 15u}) {  // 15 > block: the prompt is cropped to its last 12 tokens
    INFO("prompt of " << prompt_length);
    std::vector<std::int32_t> prompt(prompt_length);
    for (std::size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<std::int32_t>((7 * i + 2) % 23);
    std::vector<std::int32_t> const out = nn::generate(model, prompt, 20, {.top_k = 1}, env.ctx);
    REQUIRE(out.size() == 20);
    // The reference: the context generate documents, re-run in full for every token.
    std::vector<std::int32_t> context(prompt.end() - std::min<std::ptrdiff_t>(std::ssize(prompt), block), prompt.end());
    for (std::int32_t const token : out) {
      std::vector<float> const logits = full_logits(env, model, context);
      CHECK(token == argmax(std::span(logits).last(23)));
      if (std::ssize(context) == block) context.erase(context.begin(), context.end() - (keep - 1));
      context.push_back(token);
    }
  }
}

TEST_CASE("sample_token and generate: seeded, within the top k, temperature, hostile arguments", "[nn][gpt][lm]") {
  Env env;
  nn::Sequential model = make_model(env);
  std::vector<std::int32_t> const prompt{1, 2, 3};
  nn::SampleOptions const options{.temperature = 0.8f, .top_k = 3, .seed = 42};
  std::vector<std::int32_t> const a = nn::generate(model, prompt, 8, options, env.ctx);
  CHECK(a == nn::generate(model, prompt, 8, options, env.ctx));
  // Every token is among the 3 largest logits of the full forward of the sequence so far.
  std::vector<std::int32_t> context = prompt;
  for (std::int32_t const token : a) {
    std::vector<float> const logits = full_logits(env, model, context);
    std::vector<float> row(logits.end() - 23, logits.end());
    float const chosen = row[static_cast<std::size_t>(token)];
    CHECK(std::count_if(row.begin(), row.end(), [&](float x) { return x > chosen; }) < 3);
    context.push_back(token);
  }
  SECTION("the frequencies follow softmax(logits / T)") {
    std::vector<float> const logits{0.0f, 1.0f, 2.0f, -1.0f};
    std::mt19937_64 rng(1);
    std::vector<int> counts(4, 0);
    int const n = 20000;
    for (int i = 0; i < n; ++i)
      ++counts[static_cast<std::size_t>(nn::sample_token(logits, {.temperature = 2.0f}, rng))];
    double total = 0;
    for (float const x : logits) total += std::exp(x / 2.0);
    for (std::size_t i = 0; i < 4; ++i) {
      double const p = std::exp(logits[i] / 2.0) / total;
      CHECK(std::abs(counts[i] / static_cast<double>(n) - p) <= 4 * std::sqrt(p * (1 - p) / n));
    }
  }
  SECTION("hostile inputs") {
    REQUIRE_MGPU_ERROR(nn::generate(model, std::vector<std::int32_t>{4, 23}, 2, {}, env.ctx), Errc::invalid_argument,
                       "prompt token 23 at index 1 (expected a token id in [0, 23))");
    REQUIRE_MGPU_ERROR(nn::generate(model, std::vector<std::int32_t>{-1}, 2, {}, env.ctx), Errc::invalid_argument,
                       "prompt token -1 at index 0");
    REQUIRE_MGPU_ERROR(nn::generate(model, std::vector<std::int32_t>{}, 2, {}, env.ctx), Errc::invalid_argument,
                       "empty prompt");
    REQUIRE_MGPU_ERROR(nn::generate(model, prompt, 2, {.temperature = 0.0f}, env.ctx), Errc::invalid_argument,
                       "temperature 0.000000 (expected finite and > 0)");
    REQUIRE_MGPU_ERROR(nn::generate(model, prompt, 2, {.top_k = -1}, env.ctx), Errc::invalid_argument, "top_k -1");
    REQUIRE_MGPU_ERROR(nn::generate(model, prompt, -1, {}, env.ctx), Errc::invalid_argument, "(expected >= 0)");
    nn::Sequential mlp = nn::Sequential::mlp({4, 3});
    mlp.materialize(env.ctx, 1);
    REQUIRE_MGPU_ERROR(nn::Decoder(mlp, env.ctx), Errc::invalid_argument, "(expected an Embedding");
    nn::Sequential half = nn::gpt(config);
    half.materialize(env.ctx, 1, DType::bfloat16);
    REQUIRE_MGPU_ERROR(nn::Decoder(half, env.ctx), Errc::invalid_argument, "(expected float32 on a host device");
  }
}

TEST_CASE("evaluate_lm: the mean cross-entropy over the first K block windows, as a hand loop computes it",
          "[nn][gpt][lm]") {
  Env env;
  nn::Sequential model = make_model(env);
  std::int64_t const block = 8;
  std::vector<std::uint16_t> stream(150);
  std::mt19937 rng(4);
  for (auto& t : stream) t = static_cast<std::uint16_t>(rng() % 23);
  mgpu::data::TokenLoader const loader({stream}, 23, {.batch = 3, .block = block, .sequential = true});
  std::int64_t const windows = 7;  // not a multiple of the batch: the last forward holds one window
  double const got = mgpu::data::evaluate_lm(model, loader, windows, env.ctx);
  double total = 0;
  for (std::int64_t w = 0; w < windows; ++w) {
    auto const first = stream.begin() + w * block;
    std::vector<std::int32_t> const x(first, first + block);
    std::vector<float> const logits = full_logits(env, model, x);
    for (std::int64_t i = 0; i < block; ++i) {
      auto const row = std::span(logits).subspan(static_cast<std::size_t>(i * 23), 23);
      double max = -INFINITY, sum = 0;
      for (float const l : row) max = std::max(max, static_cast<double>(l));
      for (float const l : row) sum += std::exp(l - max);
      total += max + std::log(sum) - row[*(first + i + 1)];
    }
  }
  double const expected = total / static_cast<double>(windows * block);
  CHECK(std::abs(got - expected) <= 1e-5 * expected);
  CHECK(mgpu::data::evaluate_lm(model, loader, 1, env.ctx) != got);
  mgpu::data::TokenLoader const sampled({stream}, 23, {.batch = 3, .block = block});
  REQUIRE_MGPU_ERROR(mgpu::data::evaluate_lm(model, sampled, 2, env.ctx), Errc::invalid_argument, "expected a sequential one");
  REQUIRE_MGPU_ERROR(mgpu::data::evaluate_lm(model, loader, 19, env.ctx), Errc::invalid_argument,
                     "over 19 windows (expected 1 to the 18 the data holds)");
}

TEST_CASE("evaluate_lm keeps nothing for backward: every layer's saved micro-batches and the allocator's bytes are as before",
          "[nn][gpt][lm][memory]") {
  std::vector<std::uint16_t> stream(150);
  std::mt19937 rng(5);
  for (auto& t : stream) t = static_cast<std::uint16_t>(rng() % 23);
  mgpu::data::TokenLoader const loader({stream}, 23, {.batch = 3, .block = 8, .sequential = true});
  for (nn::Recompute recompute : {nn::Recompute::none, nn::Recompute::selective, nn::Recompute::full}) {
    INFO("recompute " << nn::to_string(recompute));
    Env env;
    nn::GptConfig c = config;
    c.recompute = recompute;
    nn::Sequential model = nn::gpt(c);
    model.materialize(env.ctx, 5);
    auto const saved = [&] {
      std::size_t count = 0;
      for (std::size_t l = 0; l < model.size(); ++l) count += model.layer(l).saved_micro_batches();
      return count;
    };
    env.stream.synchronize();
    std::size_t const before = env.allocator->stats().allocated;
    (void)mgpu::data::evaluate_lm(model, loader, 7, env.ctx);
    env.stream.synchronize();
    CHECK(saved() == 0);
    CHECK(env.allocator->stats().allocated == before);
    // A training forward does keep them: the checks above can tell.
    (void)model.forward(ids_tensor(env, 1, std::vector<std::int32_t>(8, 1)), env.ctx);
    CHECK(saved() > 0);
    CHECK(env.allocator->stats().allocated > before);
  }
}
