// Language-model inference and evaluation for a GPT built by nn::gpt: a Decoder that appends
// tokens with a key/value cache per layer (each new token costs O(T) attention, not a re-run of the
// whole sequence), sampling with temperature and top-k, and generate(). The validation loss is
// data::evaluate_lm (mgpu/data/evaluate.hpp).
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <vector>

#include <mgpu/core/tensor.hpp>
#include <mgpu/nn/layers.hpp>
#include <mgpu/nn/transformer.hpp>

namespace mgpu::nn {

/// Runs a GPT one chunk of positions at a time, keeping every layer's keys and values. Host and
/// float32 only (the attention over the cache is a host loop): a model on a CUDA device or in a
/// 16-bit compute type is refused with Error(invalid_argument). Dropout is off (inference). The
/// model is held by reference and must outlive the decoder; nothing is saved for backward.
class Decoder {
 public:
  /// `model`: materialized, laid out as nn::gpt builds it (Embedding, Dropout, TransformerBlocks,
  /// LayerNorm, TiedLMHead); `batch` sequences decoded side by side. Throws
  /// Error(invalid_argument) naming the first layer that does not fit.
  Decoder(Sequential const& model, Context& ctx, std::int64_t batch = 1);

  /// Runs ids, int32 [batch, t] on the host, at positions [length(), length() + t) and returns
  /// their logits, float32 host [batch, t, vocab]; length() grows by t. Throws
  /// Error(invalid_argument) for an id outside [0, vocab) (naming it and its position), a shape
  /// other than [batch, t >= 1], or length() + t > capacity().
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

/// How the next token is drawn from a row of logits: softmax(logits / temperature) restricted to
/// the top_k largest logits (0: all); ties between equal logits go to the lower id. top_k 1 is
/// greedy decoding (argmax).
struct SampleOptions {
  float temperature = 1.0f;
  std::int64_t top_k = 0;
  std::uint64_t seed = 0;
};

/// One token drawn from `logits` (one per id) with `rng`: u = (rng() >> 11) / 2^53 picks the first
/// id, in decreasing logit order, whose cumulative probability exceeds u. Throws
/// Error(invalid_argument) for no logits, a temperature that is not finite and > 0, or top_k < 0.
std::int32_t sample_token(std::span<float const> logits, SampleOptions const& options, std::mt19937_64& rng);

/// `new_tokens` tokens continuing `prompt`, drawn with sample_token from a std::mt19937_64 seeded
/// with options.seed, through a Decoder (host, float32). The context is at most the block size:
/// a longer prompt is cropped to its last block_size tokens, and when the cache is full the
/// decoder restarts from the last max(1, block_size / 2) tokens (so each token after that sees at
/// least half a block of context, and a re-run costs one block every block_size / 2 tokens).
/// Within the first block, every token is the one a full forward of the sequence so far would
/// give. Throws Error(invalid_argument) for an empty prompt, an id outside [0, vocab) (naming it
/// and its index in the prompt), new_tokens < 0, and the decoder's and sample_token's errors.
std::vector<std::int32_t> generate(Sequential const& model, std::span<std::int32_t const> prompt,
                                   std::int64_t new_tokens, SampleOptions const& options, Context& ctx);

}  // namespace mgpu::nn
