// Language-model inference for a GPT built by nn::gpt: a Decoder with a key/value cache, sampling
// and generate().
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <vector>

#include <mgpu/core/tensor.hpp>
#include <mgpu/nn/layers.hpp>
#include <mgpu/nn/transformer.hpp>

namespace mgpu::nn {

/// Runs a GPT one chunk of positions at a time, keeping every layer's keys and values; dropout
/// off. Host and float32 only. The model must outlive the decoder.
class Decoder {
 public:
  /// `model`: materialized, as nn::gpt builds it; `batch` sequences side by side. Throws
  /// Error(invalid_argument) naming the first layer that does not fit (or a CUDA or 16-bit model).
  Decoder(Sequential const& model, Context& ctx, std::int64_t batch = 1);

  /// Runs ids, int32 host [batch, t], at the next t positions; returns float32 host logits [batch,
  /// t, vocab]. Throws Error(invalid_argument) for an id outside [0, vocab), a shape other than
  /// [batch, t >= 1], or length() + t > capacity().
  Tensor append(Tensor const& ids);

  /// Positions decoded so far, and at most (the model's block size).
  [[nodiscard]] std::int64_t length() const noexcept { return caches_.empty() ? 0 : caches_.front().length; }
  [[nodiscard]] std::int64_t capacity() const noexcept { return embedding_->block_size(); }
  [[nodiscard]] std::int64_t vocab() const noexcept { return embedding_->vocab(); }
  /// Forgets every position (the next append starts at position 0).
  void reset() noexcept;

 private:
  Context* ctx_;
  std::int64_t batch_;
  Embedding const* embedding_ = nullptr;
  std::vector<TransformerBlock const*> blocks_;
  LayerNorm const* final_norm_ = nullptr;
  std::vector<KvCache> caches_;
};

/// softmax(logits / temperature) over the top_k largest logits (0: all); top_k 1 is greedy.
struct SampleOptions {
  float temperature = 1.0f;
  std::int64_t top_k = 0;
  std::uint64_t seed = 0;
};

/// One token drawn from `logits` with `rng`. Throws Error(invalid_argument) for no logits, a
/// temperature that is not finite and > 0, or top_k < 0.
std::int32_t sample_token(std::span<float const> logits, SampleOptions const& options, std::mt19937_64& rng);

/// `new_tokens` tokens continuing `prompt`, sampled through a Decoder (host, float32) with a
/// std::mt19937_64 seeded with options.seed; the context is at most the block size. Throws
/// Error(invalid_argument) for an empty prompt, an id outside [0, vocab), new_tokens < 0, and the
/// decoder's and sample_token's errors.
std::vector<std::int32_t> generate(Sequential const& model, std::span<std::int32_t const> prompt,
                                   std::int64_t new_tokens, SampleOptions const& options, Context& ctx);

}  // namespace mgpu::nn
