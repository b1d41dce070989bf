// Decoder (cached inference), sampling and generate.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>

#include <mgpu/core/error.hpp>
#include <mgpu/nn/lm.hpp>
#include <mgpu/ops/ops.hpp>
#include <mgpu/ops/transformer.hpp>

namespace mgpu::nn {
namespace {

std::size_t at(std::int64_t i) { return static_cast<std::size_t>(i); }

std::string layout_error(Sequential const& model, std::size_t i, char const* expected) {
  return "Decoder: layer " + std::to_string(i) + " is " + (i < model.size() ? model.layer(i).name() : "missing") +
         " (expected " + expected + ": a model laid out as nn::gpt builds it)";
}

}  // namespace

Decoder::Decoder(Sequential const& model, Context& ctx, std::int64_t batch) : ctx_(&ctx), batch_(batch) {
  if (batch < 1)
    throw Error(Errc::invalid_argument, "Decoder for " + std::to_string(batch) + " sequences (expected >= 1)");
  std::size_t i = 0;
  embedding_ = model.size() > 0 ? dynamic_cast<Embedding const*>(&model.layer(0)) : nullptr;
  if (embedding_ == nullptr) throw Error(Errc::invalid_argument, layout_error(model, 0, "an Embedding"));
  if (!embedding_->token_weight().defined())
    throw Error(Errc::invalid_argument, "Decoder on a model that is not materialized (expected materialize first)");
  Tensor const& w = embedding_->token_weight();
  if (w.dtype() != DType::float32 || w.device().kind != DeviceKind::host)
    throw Error(Errc::invalid_argument, "Decoder on a " + std::string(to_string(w.dtype())) + " model on " +
                                            w.device().to_string() +
                                            " (expected float32 on a host device: cached inference runs host loops)");
  for (++i; i < model.size() && dynamic_cast<Dropout const*>(&model.layer(i)) != nullptr; ++i) {
  }
  for (; i < model.size(); ++i) {
    auto const* block = dynamic_cast<TransformerBlock const*>(&model.layer(i));
    if (block == nullptr) break;
    blocks_.push_back(block);
  }
  final_norm_ = i < model.size() ? dynamic_cast<LayerNorm const*>(&model.layer(i)) : nullptr;
  if (final_norm_ == nullptr)
    throw Error(Errc::invalid_argument, layout_error(model, i, "a TransformerBlock or LayerNorm"));
  ++i;
  if (i >= model.size() || dynamic_cast<TiedLMHead const*>(&model.layer(i)) == nullptr || i + 1 != model.size())
    throw Error(Errc::invalid_argument, layout_error(model, i, "the TiedLMHead, last"));
  std::int64_t const c = embedding_->features();
  caches_.resize(blocks_.size());
  for (KvCache& cache : caches_) {
    cache.k = Tensor::empty({batch, capacity(), c}, DType::float32, ctx.allocator);
    cache.v = Tensor::empty({batch, capacity(), c}, DType::float32, ctx.allocator);
  }
}

void Decoder::reset() noexcept {
  for (KvCache& cache : caches_) cache.length = 0;
}

Tensor Decoder::append(Tensor const& ids) {
  if (ids.dtype() != DType::int32 || ids.rank() != 2 || ids.dim(0) != batch_ || ids.dim(1) < 1 ||
      ids.device().kind != DeviceKind::host)
    throw Error(Errc::invalid_argument, "Decoder::append of " + std::string(to_string(ids.dtype())) + " ids " +
                                            to_string(ids.shape()) + " on " + ids.device().to_string() +
                                            " (expected int32 host ids [" + std::to_string(batch_) + ", t >= 1])");
  std::int64_t const t = ids.dim(1), start = length(), c = embedding_->features(), v = vocab();
  if (start + t > capacity())
    throw Error(Errc::invalid_argument, "Decoder::append of " + std::to_string(t) + " positions after " +
                                            std::to_string(start) + " (expected at most the block size " +
                                            std::to_string(capacity()) + " in all; reset() or crop the context)");
  Context& ctx = *ctx_;
  ctx.stream.synchronize();  // the parameters may still be being written (an optimizer step)
  auto const id = ids.host_span<std::int32_t>();
  for (std::int64_t n = 0; n < batch_ * t; ++n)
    if (id[at(n)] < 0 || id[at(n)] >= v)
      throw Error(Errc::invalid_argument, "Decoder::append: token id " + std::to_string(id[at(n)]) + " at position " +
                                              std::to_string(n) + " (expected a token id in [0, " + std::to_string(v) +
                                              "))");
  Tensor x = Tensor::empty({batch_, t, c}, DType::float32, ctx.allocator);
  auto const xs = x.host_span<float>();
  auto const wte = embedding_->token_weight().host_span<float>();
  auto const wpe = embedding_->position_weight().host_span<float>();
  for (std::int64_t b = 0; b < batch_; ++b)
    for (std::int64_t i = 0; i < t; ++i)
      for (std::int64_t e = 0; e < c; ++e)
        xs[at((b * t + i) * c + e)] = wte[at(id[at(b * t + i)] * c + e)] + wpe[at((start + i) * c + e)];
  for (std::size_t l = 0; l < blocks_.size(); ++l) x = blocks_[l]->forward_cached(x, caches_[l], ctx);
  Tensor const h = x.reshape({batch_ * t, c});
  Tensor const normed = Tensor::empty(h.shape(), DType::float32, ctx.allocator);
  Tensor const stats = Tensor::empty({2, batch_ * t}, DType::float32, ctx.allocator);
  ops::layer_norm(h, final_norm_->gamma(), final_norm_->beta(), normed, stats, final_norm_->eps(), ctx.stream);
  Tensor logits = Tensor::empty({batch_ * t, v}, DType::float32, ctx.allocator);
  ops::gemm(normed, false, embedding_->token_weight(), true, logits, 1.0f, 0.0f, ctx.stream);  // the tied head
  ctx.stream.synchronize();
  return logits.reshape({batch_, t, v});
}

std::int32_t sample_token(std::span<float const> logits, SampleOptions const& options, std::mt19937_64& rng) {
  if (logits.empty()) throw Error(Errc::invalid_argument, "sample_token from no logits (expected one per token id)");
  if (!(options.temperature > 0.0f) || !std::isfinite(options.temperature))
    throw Error(Errc::invalid_argument,
                "sample_token: temperature " + std::to_string(options.temperature) + " (expected finite and > 0)");
  if (options.top_k < 0)
    throw Error(Errc::invalid_argument,
                "sample_token: top_k " + std::to_string(options.top_k) + " (expected >= 0; 0 keeps every id)");
  auto const n = static_cast<std::int64_t>(logits.size());
  std::int64_t const k = options.top_k == 0 ? n : std::min(options.top_k, n);
  std::vector<std::int32_t> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](std::int32_t a, std::int32_t b) {
    return logits[at(a)] > logits[at(b)] || (logits[at(a)] == logits[at(b)] && a < b);
  });
  double const top = logits[at(order.front())];
  std::vector<double> weight(at(k));
  double total = 0;
  for (std::int64_t i = 0; i < k; ++i)
    total += weight[at(i)] = std::exp((logits[at(order[at(i)])] - top) / options.temperature);
  double const u = static_cast<double>(rng() >> 11) * 0x1.0p-53 * total;
  double cumulative = 0;
  for (std::int64_t i = 0; i < k; ++i) {
    cumulative += weight[at(i)];
    if (cumulative > u) return order[at(i)];
  }
  return order[at(k - 1)];  // u within rounding of the total
}

std::vector<std::int32_t> generate(Sequential const& model, std::span<std::int32_t const> prompt,
                                   std::int64_t new_tokens, SampleOptions const& options, Context& ctx) {
  Decoder decoder(model, ctx);
  if (prompt.empty())
    throw Error(Errc::invalid_argument, "generate from an empty prompt (expected at least one token)");
  if (new_tokens < 0)
    throw Error(Errc::invalid_argument, "generate " + std::to_string(new_tokens) + " tokens (expected >= 0)");
  for (std::size_t i = 0; i < prompt.size(); ++i)
    if (prompt[i] < 0 || prompt[i] >= decoder.vocab())
      throw Error(Errc::invalid_argument, "generate: prompt token " + std::to_string(prompt[i]) + " at index " +
                                              std::to_string(i) + " (expected a token id in [0, " +
                                              std::to_string(decoder.vocab()) + "))");
  auto const run = [&](std::span<std::int32_t const> tokens) {
    Tensor ids = Tensor::empty({1, static_cast<std::int64_t>(tokens.size())}, DType::int32, ctx.allocator);
    std::copy(tokens.begin(), tokens.end(), ids.host_span<std::int32_t>().begin());
    return decoder.append(ids);
  };
  std::vector<std::int32_t> context(prompt.end() - std::min<std::ptrdiff_t>(std::ssize(prompt), decoder.capacity()),
                                    prompt.end());
  Tensor logits = run(context);
  std::mt19937_64 rng(options.seed);
  std::vector<std::int32_t> out;
  std::int64_t const keep = std::max<std::int64_t>(1, decoder.capacity() / 2);
  for (std::int64_t n = 0; n < new_tokens; ++n) {
    auto const row = logits.host_span<float>().last(at(decoder.vocab()));
    std::int32_t const token = sample_token(row, options, rng);
    out.push_back(token);
    if (n + 1 == new_tokens) break;
    context.push_back(token);
    if (decoder.length() == decoder.capacity()) {
      decoder.reset();
      logits = run(std::span(context).last(at(keep)));
    } else {
      logits = run(std::span(context).last(1));
    }
  }
  return out;
}

}  // namespace mgpu::nn
